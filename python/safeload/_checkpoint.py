"""Whole checkpoints: one file, a list of shards, a directory, or a ``*.index.json``, read through
one worker pool so shards overlap; or streamed tensor by tensor with bounded memory."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from . import _device, _logging, _staging
from ._frameworks import dtype_code, gc_paused, torch_read_many
from ._options import open_options
from ._safeload import Checkpoint

Progress = Callable[[int, int], None]


def load_checkpoint(
    path_or_paths: Any,
    framework: str = "pt",
    *,
    device: Any = "cpu",
    backend: Optional[str] = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    drop_cache: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
    verify: Any = None,
    verify_cache: Any = None,
    progress: Any = None,
    return_stats: bool = False,
    dtype: Any = None,
) -> Any:
    """One state dict from every shard, read through one worker pool.

    backend, threads, chunk_bytes, drop_cache, storage_options, verify, verify_cache: the reader's
    options (see :class:`safeload._options.Options`). Under ``verify``, each shard's
    SHA-256 is computed in the same pass as its read and checked before anything of it is
    returned.

    ``dtype`` (torch.float32/float16/bfloat16) converts the floating-point tensors on the way.

    ``progress``: a callable ``(bytes_done, bytes_total)``, True for a tqdm bar (streams in
    batches to report), False for none; by default a bar is shown for multi-shard checkpoints
    when tqdm is installed and stderr is a terminal. ``return_stats``: also return a
    :class:`Stats`."""
    where = _device.target(framework, device)  # before anything is opened
    ckpt = Checkpoint(path_or_paths, open_options(backend=backend, threads=threads, chunk_bytes=chunk_bytes,
                                                  drop_cache=drop_cache, storage_options=storage_options,
                                                  verify=verify, verify_cache=verify_cache))
    paths = ckpt.paths
    if progress is None:
        progress = _wants_bar(paths) or None
    elif progress is False:
        progress = None
    out: Dict[str, Any] = {}
    try:
        if where.torch is not None:  # accelerator: every shard through one staging ring
            callback = _progress_callback(progress) if progress is not None else None
            out = _staging.load_checkpoint_to_device(ckpt, where.torch, progress=callback, dtype=dtype)
        elif progress is not None and dtype is None:  # in batches, to report
            for name, tensor in _stream(ckpt, where, None, _progress_callback(progress)):
                out[name] = tensor
        else:  # one read (or maps, when "auto" maps)
            with gc_paused():
                if where.framework == "pytorch":
                    out = torch_read_many(ckpt, dtype_code(dtype))
                else:
                    items, _ = ckpt.read(dtype=dtype_code(dtype))
                    out = where.many(items)
        stats = ckpt.stats()
        checked = ckpt.pinned()
    finally:
        ckpt.close()
    _logging.log_read(paths, stats, "load_checkpoint")
    _logging.log_verified(checked)
    return (out, stats) if return_stats else out


def _wants_bar(paths: Sequence[str]) -> bool:
    """The default: a bar for multi-shard loads when someone is watching stderr."""
    if len(paths) < 2 or not sys.stderr.isatty():
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _progress_callback(progress: Any) -> Optional[Progress]:
    """A callable as given, or a tqdm bar (bytes, rate, ETA) for ``progress=True``."""
    if progress is True:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="loading")

        def update(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if done >= total:
                bar.close()

        return update
    return progress or None


def iter_checkpoint(
    path_or_paths: Any,
    framework: str = "pt",
    *,
    device: Any = "cpu",
    max_inflight_bytes: int = 1 << 30,
    backend: Optional[str] = None,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    drop_cache: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
    verify: Any = None,
    verify_cache: Any = None,
    progress: Any = None,
) -> Iterator[Tuple[str, Any]]:
    """Yields ``(name, tensor)`` in file order, reading batches of at most ``max_inflight_bytes``
    (a tensor larger than that is read alone), so a checkpoint larger than memory can be copied
    into a model tensor by tensor. The reader's options: as :func:`load_checkpoint` takes them.

    ``verify``: no tensor of a shard is yielded before the whole shard hashed right, so a shard
    larger than a batch is read whole first and its tensors are yielded from those bytes: memory
    in flight is then up to one shard."""
    where = _device.target(framework, device)
    ckpt = Checkpoint(path_or_paths, open_options(backend=backend, threads=threads, chunk_bytes=chunk_bytes,
                                                  drop_cache=drop_cache, storage_options=storage_options,
                                                  verify=verify, verify_cache=verify_cache))
    try:
        yield from _stream(ckpt, where, max_inflight_bytes, _progress_callback(progress))
        _logging.log_read(ckpt.paths, ckpt.stats(), "iter_checkpoint")
        _logging.log_verified(ckpt.pinned())
    finally:
        ckpt.close()


def _stream(
    ckpt: Any,
    where: _device.Target,
    max_inflight_bytes: Optional[int],
    progress: Optional[Progress],
) -> Iterator[Tuple[str, Any]]:
    """The checkpoint in file order, batch by batch: the reader reads the next batch (on a
    thread of its own) while the caller uses the current one, so each holds at most half of
    ``max_inflight_bytes`` (a tensor larger than that is a batch of its own; None: the reader's
    budget for a whole load reporting progress)."""
    with ckpt.stream(max_inflight_bytes=max_inflight_bytes) as batches:
        for items in batches:
            for name, code, shape, data in items:
                yield name, where.tensor(code, shape, data, name)
            if progress is not None:
                progress(*batches.progress())
