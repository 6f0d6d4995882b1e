"""``safeload.torch``: safetensors 0.8's ``safetensors.torch``, on safeload's reader."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import _checkpoint, _inplace, _save
from ._shared import (  # noqa: F401 (safetensors.torch has these names)
    _end_ptr,
    _filter_shared_not_shared,
    _find_shared_tensors,
    _is_complete,
    _remove_duplicate_names,
    account_removed,
    storage_ptr,
    storage_size,
)
from ._open import safe_open
from ._options import Options
from ._safeload import DTYPES, TensorSpec, deserialize, serialize

__all__ = [
    "load",
    "load_file",
    "load_checkpoint",
    "iter_checkpoint",
    "load_model",
    "load_into",
    "save",
    "save_file",
    "save_model",
    "save_checkpoint",
    "storage_ptr",
    "storage_size",
]

if TYPE_CHECKING:
    from typing_extensions import Unpack

PathLike = Union[str, "os.PathLike[str]"]

# safetensors.torch's tables, from the reader's one (DTYPES): format code -> torch dtype, for
# the codes this torch has (fp8 / fp4 need torch >= 2.1 / 2.8), and each dtype's element size.
_TYPES: Dict[str, Any] = {code: getattr(torch, names[0]) for code, names in DTYPES.items()
                          if names[0] is not None and hasattr(torch, names[0])}
_SIZE: Dict[Any, int] = {dtype: dtype.itemsize for dtype in _TYPES.values()}
#: each dtype's name as TensorSpec takes it ("float32"), looked up once per tensor saved
_NAMES: Dict[Any, str] = {dtype: str(dtype).split(".")[-1] for dtype in _TYPES.values()}


def _getdtype(dtype_str: str) -> Any:
    return _TYPES[dtype_str]


# -- saving ------------------------------------------------------------------------------------


def _evaluate_tensors_for_save(tensors: Dict[str, torch.Tensor]) -> None:
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(tensor)}")
        if tensor.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not support."
            " You can make it a dense tensor before saving with `.to_dense()` but be aware this might"
            " make a much larger file than needed."
        )
    failing = [names for names in _find_shared_tensors(tensors) if len(names) > 1]
    if failing:
        raise RuntimeError(
            f"""
            Some tensors share memory, this will lead to duplicate memory on disk and potential differences when loading them again: {failing}.
            A potential way to correctly save your model is to use `save_model`.
            More information at https://huggingface.co/docs/safetensors/torch_shared_tensors
            """
        )


def _check_contiguous(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``tensors`` after 0.8's checks (tensors, dense, not sharing memory, contiguous)."""
    _evaluate_tensors_for_save(tensors)
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. It either means you"
                " are trying to save tensors which are reference of each other in which case it's recommended to save"
                " only the full tensors, and reslice at load time, or simply call `.contiguous()` on your tensor to"
                " pack it before saving."
            )
    return tensors


def _writer(tensors: Dict[str, torch.Tensor]) -> _save.Write:
    """How ``tensors`` are written: CUDA tensors (of one device) through the pinned staging ring
    (device-to-host copies overlapped with the writes; host memory: the ring), others straight
    from their CPU memory (another device's copied to the CPU first; MPS through that copy)."""
    values = tensors.values() if isinstance(tensors, dict) else ()  # else 0.8's error, from the checks
    devices = {t.device for t in values if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        from ._sinks import make_sink

        sink = make_sink(next(iter(devices)))
        return lambda files, fsync, hash: _save.write_staged([(_check_contiguous(t), p, m) for t, p, m in files],
                                                             sink, fsync=fsync, hash=hash)
    keep_alive: List[Any] = []
    return _save.host_writer(lambda shard: _flatten_as_ptr(shard, keep_alive))


def _flatten_as_ptr(tensors: Dict[str, torch.Tensor], keep_alive: List[Any]) -> Dict[str, TensorSpec]:
    """TensorSpecs pointing at each tensor's CPU bytes; ``keep_alive`` holds what they point at."""
    specs = {}
    cpu = torch.device("cpu")
    for name, tensor in _check_contiguous(tensors).items():
        if tensor.device != cpu:
            tensor = tensor.to(cpu)
        keep_alive.append(tensor)
        dtype = tensor.dtype
        nbytes = tensor.nelement() * _SIZE[dtype]
        specs[name] = TensorSpec(dtype=_NAMES[dtype], shape=tensor.shape, data_ptr=tensor.data_ptr() if nbytes else 0,
                                 data_len=nbytes)
    return specs


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors``."""
    keep_alive: List[Any] = []
    return bytes(serialize(_flatten_as_ptr(tensors, keep_alive), metadata=metadata))


def save_file(
    tensors: Dict[str, torch.Tensor],
    filename: PathLike,
    metadata: Optional[Dict[str, str]] = None,
    *,
    fsync: bool = False,
    manifest: bool = False,
) -> None:
    """Writes ``tensors`` to ``filename`` atomically (temporary file + rename), its bytes written
    side by side from the tensors' memory with the GIL released. ``fsync``: on the disk before
    returning. ``manifest``: the file's SHA-256, computed from the bytes as they are written, goes
    into the ``SHA256SUMS`` beside it."""
    _save.save_file(_writer(tensors), tensors, filename, metadata, fsync, manifest)


def save_checkpoint(
    state_dict: Dict[str, torch.Tensor],
    directory: PathLike,
    *,
    max_shard_size: Union[int, str] = _save.MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
    manifest: bool = True,
    filename_pattern: str = _save.FILENAME_PATTERN,
    fsync: bool = False,
) -> List[str]:
    """Writes ``state_dict`` as transformers' sharded checkpoint in ``directory`` (shards split as
    ``huggingface_hub.split_torch_state_dict_into_shards`` splits them, written side by side, then
    ``model.safetensors.index.json``) with, under ``manifest``, a ``SHA256SUMS`` of the bytes
    written (no second read): ``load_checkpoint(directory, verify=True)`` checks it. Returns the
    shards' paths. See :mod:`safeload._save` for what a save killed half-way leaves."""
    def size_of(name: str) -> int:
        return int(storage_size(state_dict[name]))

    def storage_of(name: str) -> Any:
        t = state_dict[name]
        return None if t.device.type == "meta" else (t.device, storage_ptr(t), storage_size(t))

    return _save.save_checkpoint(_writer(state_dict), state_dict, directory,
                                 (size_of, storage_of), max_shard_size=max_shard_size, metadata=metadata,
                                 manifest=manifest, filename_pattern=filename_pattern, fsync=fsync)


def save_model(
    model: torch.nn.Module,
    filename: str,
    metadata: Optional[Dict[str, str]] = None,
    force_contiguous: bool = True,
) -> None:
    """Saves ``model``'s state dict, dropping names that share memory (recorded in metadata)."""
    state_dict = model.state_dict()
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        for name in dropped:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata)
    except ValueError as e:
        raise ValueError(
            str(e) + " Or use save_model(..., force_contiguous=True), read the docs for potential caveats."
        ) from e


# -- loading -----------------------------------------------------------------------------------


def load_file(filename: PathLike, device: Any = "cpu", *, backend: Optional[str] = None,
              dtype: Any = None, storage_options: Optional[Dict[str, Any]] = None,
              verify: Any = None, verify_cache: Any = None) -> Dict[str, torch.Tensor]:
    """Loads every tensor of ``filename`` (a path or a URL; in parallel, into memory each tensor
    owns). ``dtype`` (torch.float32, float16 or bfloat16) converts the floating-point tensors on
    the way, bit-exact with ``tensor.to(dtype)``. backend, storage_options, verify, verify_cache:
    the reader's options (see :class:`safeload._options.Options`); under ``verify``, the file's
    SHA-256 is checked in the same pass before anything is returned."""
    with safe_open(filename, framework="pt", device=device, backend=backend, storage_options=storage_options,
                   verify=verify, verify_cache=verify_cache) as f:
        return f.get_tensors(dtype=dtype) if dtype is not None else f.get_tensors()


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """Loads tensors from the bytes of a whole file."""
    return _view2torch(deserialize(data))


def _view2torch(safeview: Any) -> Dict[str, torch.Tensor]:
    from ._frameworks import to_torch

    return {name: to_torch(v["dtype"], v["shape"], v["data"], name) for name, v in safeview}


def load_model(
    model: torch.nn.Module,
    filename: PathLike,
    strict: bool = True,
    device: Any = "cpu",
    *,
    backend: Optional[str] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    verify: Any = None,
    verify_cache: Any = None,
) -> Tuple[List[str], List[str]]:
    """Loads ``filename`` (or shards, a directory, an index.json) into ``model``, handling names
    that share memory in the model, with safetensors' results: ``(missing, unexpected)``, the
    same strict errors. CPU parameters and buffers are read straight into (no new memory, dtypes
    converted on the way, storages unchanged); a model that loads its state its own way (hooks,
    a custom ``_load_from_state_dict``) goes through ``load_state_dict``. backend,
    storage_options, verify, verify_cache: the reader's options (see
    :class:`safeload._options.Options`); under ``verify``, every shard is checked before the model
    is touched."""
    options = Options(backend=backend, storage_options=storage_options, verify=verify, verify_cache=verify_cache)
    direct = _inplace.load_model_into(model, filename, strict, **options)
    if direct is not None:
        missing, unexpected = direct
    else:
        state_dict = load_checkpoint(filename, device=device, **options)
        model_state_dict = model.state_dict()
        to_removes = _remove_duplicate_names(model_state_dict, preferred_names=state_dict.keys())
        missing_list, unexpected = model.load_state_dict(state_dict, strict=False)
        missing, unexpected = account_removed(to_removes, set(missing_list), unexpected)
    if strict and (missing or unexpected):
        missing_keys = ", ".join(f'"{k}"' for k in sorted(missing))
        unexpected_keys = ", ".join(f'"{k}"' for k in sorted(unexpected))
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += f"\n    Missing key(s) in state_dict: {missing_keys}"
        if unexpected:
            error += f"\n    Unexpected key(s) in state_dict: {unexpected_keys}"
        raise RuntimeError(error)
    return missing, unexpected  # type: ignore[return-value]


def load_checkpoint(
    path_or_paths: Any,
    device: Any = "cpu",
    *,
    process_group: Any = None,
    plan: Optional[Dict[str, Any]] = None,
    ranks_needing: Optional[Dict[str, Iterable[int]]] = None,
    **kwargs: Any,
) -> Any:
    """Loads a whole checkpoint: a file, a list of shards, a directory, or an index.json, with
    every shard read through one worker pool. Keywords: progress, return_stats, dtype (see
    :func:`safeload._checkpoint.load_checkpoint`) and the reader's options (backend, threads,
    chunk_bytes, drop_cache, storage_options, verify, verify_cache: see
    :class:`safeload._options.Options`).

    ``process_group`` (a torch.distributed group), ``ranks_needing``, ``selection`` or ``plan``
    (per-rank slices): the ranks split the read and exchange tensors with the group's
    collectives, see :mod:`safeload.distributed`."""
    if process_group is not None or plan is not None or ranks_needing is not None or "selection" in kwargs:
        from . import distributed

        return distributed.load_checkpoint(path_or_paths, device, process_group=process_group, plan=plan,
                                           ranks_needing=ranks_needing, **kwargs)
    return _checkpoint.load_checkpoint(path_or_paths, "pt", device=device, **kwargs)


def load_into(tensors: Dict[str, torch.Tensor], path_or_paths: Any, **options: Unpack[Options]) -> Any:
    """Reads each named tensor of a checkpoint straight into the given tensor, in place
    (converting F32/F16/BF16 as needed). ``**options``: the reader's (see
    :class:`safeload._options.Options`). Returns the read's stats. See :mod:`safeload._inplace`."""
    return _inplace.load_into(tensors, path_or_paths, **options)


def iter_checkpoint(path_or_paths: Any, device: Any = "cpu", **kwargs: Any) -> Iterable[Tuple[str, torch.Tensor]]:
    """Streams ``(name, tensor)`` in file order with bounded memory. See ``_checkpoint``."""
    return _checkpoint.iter_checkpoint(path_or_paths, "pt", device=device, **kwargs)
