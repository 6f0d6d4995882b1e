"""Whole checkpoints: one file, a list of shards, a directory, or a ``*.index.json``, read through
one worker pool so shards overlap; or streamed tensor by tensor with bounded memory."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _device
from ._frameworks import CONVERTERS, FRAMEWORKS
from ._safeload import Handle, SafetensorError, read_checkpoint

Progress = Callable[[int, int], None]


def resolve(path_or_paths: Any) -> List[str]:
    """The shard files of a checkpoint, in a stable order."""
    if isinstance(path_or_paths, (list, tuple)):
        return [os.fspath(p) for p in path_or_paths]
    path = os.fspath(path_or_paths)
    if os.path.isdir(path):
        indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if indexes:
            return resolve(os.path.join(path, indexes[0]))
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"No .safetensors files in directory: {path}")
        return [os.path.join(path, f) for f in files]
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise SafetensorError(f"{path}: not a safetensors index (no 'weight_map' object)")
        base = os.path.dirname(path)
        shards = sorted(set(weight_map.values()))
        return [os.path.join(base, s) for s in shards]
    return [path]


def _converter(framework: str, device: Any) -> Callable[[str, str, List[int], Any], Any]:
    try:
        name = FRAMEWORKS[framework]
    except KeyError:
        raise SafetensorError(f"framework {framework} is invalid") from None
    convert = CONVERTERS[name]
    parsed = _device.parse(device)
    if parsed == "cpu":
        return lambda n, code, shape, data: convert(code, shape, data, n)
    if name != "pytorch":
        raise SafetensorError(f"Device {parsed} is not supported for framework {name}")
    target = _device.torch_device(parsed)
    return lambda n, code, shape, data: convert(code, shape, data, n).to(target)


def load_checkpoint(
    path_or_paths: Any,
    framework: str = "pt",
    *,
    device: Any = "cpu",
    backend: str = "auto",
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> Dict[str, Any]:
    """One state dict from every shard. ``backend="mmap"`` maps instead of reading."""
    paths = resolve(path_or_paths)
    convert = _converter(framework, device)
    if backend == "mmap":
        out: Dict[str, Any] = {}
        for p in paths:
            h = Handle(p, "mmap")
            for name, code, shape, data in h.read_many():
                out[name] = convert(name, code, shape, data)
        return out
    if backend not in ("auto", "pread"):
        Handle(paths[0], backend).close()  # raises the invalid-backend error
    if progress is None:
        per_file = read_checkpoint(paths, threads=threads, chunk_bytes=chunk_bytes)
    else:
        return dict(iter_checkpoint(paths, framework, device=device, threads=threads,
                                    chunk_bytes=chunk_bytes, progress=progress))
    result: Dict[str, Any] = {}
    for tensors in per_file:
        for name, code, shape, data in tensors:
            if name in result:
                raise SafetensorError(f"tensor {name} appears in more than one shard")
            result[name] = convert(name, code, shape, data)
    return result


def iter_checkpoint(
    path_or_paths: Any,
    framework: str = "pt",
    *,
    device: Any = "cpu",
    max_inflight_bytes: int = 1 << 30,
    threads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> Iterator[Tuple[str, Any]]:
    """Yields ``(name, tensor)`` in file order, reading batches of at most ``max_inflight_bytes``
    (a tensor larger than that is read alone), so a checkpoint larger than memory can be copied
    into a model tensor by tensor."""
    paths = resolve(path_or_paths)
    convert = _converter(framework, device)
    plan: List[Tuple[int, str, int]] = []
    for i, p in enumerate(paths):
        h = Handle(p, "pread")
        plan.extend((i, name, end - begin) for name, _, _, begin, end in h.infos())
        h.close()
    total = sum(n for _, _, n in plan)
    done = 0
    for batch in _batches(plan, max_inflight_bytes):
        selection: List[Optional[List[str]]] = [[] for _ in paths]
        for i, name, _ in batch:
            selection[i].append(name)  # type: ignore[union-attr]
        per_file = read_checkpoint(paths, selection, threads=threads, chunk_bytes=chunk_bytes)
        for tensors in per_file:
            for name, code, shape, data in tensors:
                yield name, convert(name, code, shape, data)
        done += sum(n for _, _, n in batch)
        if progress is not None:
            progress(done, total)


def _batches(plan: Sequence[Tuple[int, str, int]], limit: int) -> Iterator[List[Tuple[int, str, int]]]:
    batch: List[Tuple[int, str, int]] = []
    size = 0
    for item in plan:
        if batch and size + item[2] > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item[2]
    if batch:
        yield batch
