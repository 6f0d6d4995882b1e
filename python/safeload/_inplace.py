"""Reading a checkpoint straight into tensors that already exist: ``load_into`` and the in-place
path of ``load_model``.

A model's CPU parameters and buffers are handed to the Rust reader as DLPack (no addresses), and
the parallel reader writes the file's bytes into them in place, converting F32/F16/BF16 on the
way: no new memory, one copy, storages unchanged. The reader decides which tensors it can fill
(``Checkpoint.read_into`` returns the others); those get a copy, never a wrong value: tensors
that are not contiguous, dtype pairs without a converter (read into new memory, then ``copy_``
converts as torch does), tensors on a device, and tensors that share memory with one another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from . import _logging
from ._frameworks import gc_paused, torch_many, torch_shape
from ._options import Options, open_options
from ._stats import Stats
from ._safeload import Checkpoint, OpenOptions, SafetensorError
from ._shared import _remove_duplicate_names, account_removed

if TYPE_CHECKING:
    from typing_extensions import Unpack

_strided = torch.strided

#: Host memory used at a time by tensors that take a copy (on a device, not contiguous ...).
COPY_BATCH_BYTES = 256 << 20


def load_into(tensors: Dict[str, Any], path_or_paths: Any, *, backend: Optional[str] = None,
              threads: Optional[int] = None, chunk_bytes: Optional[int] = None, drop_cache: bool = False,
              storage_options: Optional[Dict[str, Any]] = None, verify: Any = None, verify_cache: Any = None) -> Stats:
    """Reads each named tensor of a checkpoint (a file, shards, a directory or an index.json)
    into the given tensor, in place. Every name must be in the checkpoint and every shape must
    match (checked before anything is read). The reader's options: see
    :class:`safeload._options.Options`; under ``verify``, every shard is read whole and hashed
    into memory of the reader's own before the first byte is copied into a tensor, so a mismatch
    leaves them untouched. Returns the read's :class:`Stats`."""
    ckpt = Checkpoint(path_or_paths, open_options(backend=backend, threads=threads, chunk_bytes=chunk_bytes,
                                                  drop_cache=drop_cache, storage_options=storage_options,
                                                  verify=verify, verify_cache=verify_cache))
    try:
        stats = _read_into(ckpt, tensors)
        _logging.log_read(ckpt.paths, stats, "load_into")
        _logging.log_verified(ckpt.pinned())
        return stats
    finally:
        ckpt.close()


def _read_into(ckpt: Any, tensors: Dict[str, Any]) -> Stats:
    infos = {i.name: (i.dtype, i.shape) for i in ckpt.infos()}
    for name, t in tensors.items():
        if name not in infos:
            raise SafetensorError(f"File does not contain tensor {name}")
        code, shape = infos[name]
        if list(t.shape) != list(torch_shape(code, shape)):
            raise SafetensorError(f"tensor {name}: the checkpoint has shape {shape}, "
                                  f"the destination {list(t.shape)}")
    rest = ckpt.read_into(list(tensors), [_exported(t) for t in tensors.values()])[1]
    if rest:  # copies, converted by torch as load_state_dict would, a bounded batch at a time
        for batch in ckpt.batches(rest, max_bytes=COPY_BATCH_BYTES):
            items, _ = ckpt.read(batch)
            with torch.no_grad():
                for name, t in torch_many(items).items():
                    tensors[name].copy_(t)
    return ckpt.stats()


def _exported(t: Any) -> Any:
    """What the reader borrows ``t`` through: its DLPack capsule (``to_dlpack``, a fifth of the
    cost of torch's ``__dlpack__``, whose checks are made here) for a plain CPU tensor, else the
    tensor, whose ``__dlpack__`` the reader calls (and copies into what it cannot borrow)."""
    t = t.detach()
    if t.is_cpu and t.layout is _strided and not t.is_conj() and not t.is_neg():
        return _to_dlpack(t)
    return t


def _custom_loading(model: Any) -> bool:
    """Whether some module loads its state its own way (hooks, an overridden
    ``_load_from_state_dict``): then only ``load_state_dict`` itself gives the right result."""
    base = torch.nn.Module._load_from_state_dict
    for m in model.modules():
        if type(m)._load_from_state_dict is not base:
            return True
        if getattr(m, "_load_state_dict_pre_hooks", None) or getattr(m, "_load_state_dict_post_hooks", None):
            return True
    return bool(getattr(model, "_state_dict_pre_hooks", None))


def load_model_into(model: Any, path_or_paths: Any, strict: bool,
                    **options: Unpack[Options]) -> Optional[Tuple[Any, List[str]]]:
    """safetensors' ``load_model`` semantics, reading straight into the model's tensors.
    Returns (missing, unexpected), or None when the model loads its state its own way (the
    caller then goes through ``load_state_dict``)."""
    with gc_paused():  # a model of 20,000 tensors: two full collections of 70-130 ms each
        if _custom_loading(model):
            return None
        return _load_model_into(model, path_or_paths, open_options(**options))


def _load_model_into(model: Any, path_or_paths: Any, options: OpenOptions) -> Tuple[Any, List[str]]:
    state = model.state_dict()
    ckpt = Checkpoint(path_or_paths, options)
    try:
        infos = {i.name: (i.dtype, i.shape) for i in ckpt.infos()}
        to_removes = _remove_duplicate_names(state, preferred_names=list(infos))
        removed = {n for group in to_removes.values() for n in group}
        wanted = {n: t for n, t in state.items() if n in infos and n not in removed}
        mismatched = [f"size mismatch for {n}: copying a param with shape "
                      f"{torch.Size(torch_shape(*infos[n]))} from checkpoint, the shape in current "
                      f"model is {t.shape}." for n, t in wanted.items()
                      if list(t.shape) != list(torch_shape(*infos[n]))]
        if mismatched:  # before any read: the model is left untouched
            raise RuntimeError(f"Error(s) in loading state_dict for {model.__class__.__name__}:\n\t"
                               + "\n\t".join(mismatched))
        _logging.log_read(ckpt.paths, _read_into(ckpt, wanted), "load_model")
        _logging.log_verified(ckpt.pinned())
    finally:
        ckpt.close()
    missing = {n for n in state if n not in infos}
    unexpected = [n for n in infos if n not in state]
    return account_removed(to_removes, missing, unexpected)
