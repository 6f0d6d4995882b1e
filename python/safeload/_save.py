"""Saving a checkpoint: transformers' sharded layout, its shards written side by side, and the
``SHA256SUMS`` of what was written, for ``safeload.torch`` and ``safeload.numpy``.

The split rule is ``huggingface_hub.split_state_dict_into_shards_factory``'s (what
``save_pretrained`` uses): tensors in the state dict's order fill a shard until the next would
pass ``max_shard_size``; a tensor larger than that gets a shard of its own; tensors that share
storage go with the first of them. One shard is ``model.safetensors`` and no index; more are
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``
and ``weight_map``, as transformers writes it).

Order of a save, so that a save killed at any point leaves a checkpoint that loads: the shards are
written to temporary files and renamed into place only once all are written (by the Rust writer);
then ``SHA256SUMS`` and last the index, each written to a temporary file and renamed. A
checkpoint whose shards have other names stays whole until the new index replaces its own; one
whose shards have the same names has them replaced together, and a save killed between those
renames and the new manifest leaves an old ``SHA256SUMS`` that ``verify`` reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

from ._safeload import SafetensorError, manifest_line, read_manifest, serialize_files

PathLike = Union[str, "os.PathLike[str]"]

#: huggingface_hub's default shard size.
MAX_SHARD_SIZE = "5GB"
#: The name transformers gives a checkpoint's files ({suffix}: "" or "-0000k-of-0000n").
FILENAME_PATTERN = "model{suffix}.safetensors"
#: The manifest written beside the shards (what ``sha256sum -c`` and ``safeload verify`` read).
SUMS = "SHA256SUMS"
#: Makes a patched ``save_file`` (transformers' and diffusers' ``save_pretrained``) record each
#: file's digest in the ``SHA256SUMS`` beside it.
MANIFEST_ENV = "SAFELOAD_SAVE_MANIFEST"

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` -> 5 * 10**9, as huggingface_hub's ``parse_size_to_int`` (and ``"5GiB"``)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", str(size).upper())
    if match is None:
        raise ValueError(f"Could not parse the size {size!r}: expected an int or a string such as '5GB' or '500MB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def split(names: Sequence[str], size_of: Callable[[str], int], storage_of: Callable[[str], Optional[Hashable]],
          max_shard_size: Union[int, str]) -> Tuple[List[List[str]], int]:
    """The names of each shard, by huggingface_hub's rule, and the bytes of them all (each storage once)."""
    limit = parse_size(max_shard_size)
    shards: List[List[str]] = []
    current: List[str] = []
    current_size = total = 0
    first_of: Dict[Hashable, str] = {}
    sharing: Dict[str, List[str]] = {}
    for name in names:
        storage = storage_of(name)
        if storage is not None:
            if storage in first_of:
                sharing[first_of[storage]].append(name)
                continue
            first_of[storage] = name
            sharing[name] = []
        size = size_of(name)
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    for shard in shards:
        for name in list(shard):
            shard.extend(sharing.get(name, ()))
    return shards, total


def shard_names(count: int, pattern: str = FILENAME_PATTERN) -> List[str]:
    """The file name of each of ``count`` shards; refuses a pattern that names a path."""
    names = ([pattern.format(suffix="")] if count == 1 else
             [pattern.format(suffix=f"-{k + 1:05d}-of-{count:05d}") for k in range(count)])
    for name in names:
        if not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
            raise SafetensorError(
                f"Error while serializing: the checkpoint file name {name!r} (from filename_pattern {pattern!r}) "
                "is not a plain file name in the checkpoint's directory")
    return names


def write_atomic(path: str, text: str, fsync: bool) -> None:
    """``text`` at ``path``, through a temporary sibling renamed over it."""
    directory = os.path.dirname(path) or "."
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def record_digests(directory: str, digests: Dict[str, Optional[str]], fsync: bool = False) -> None:
    """``digests`` (file name -> hex) into ``directory``'s ``SHA256SUMS``: lines of files that are
    gone are dropped, those of other files that are there kept, these replace their own; a name
    given None (a file written again without its digest) loses its line, so no manifest is left
    naming bytes that are no longer there. Without a digest to record, a directory without a
    ``SHA256SUMS`` is left without one."""
    path = os.path.join(directory, SUMS)
    entries: Dict[str, Optional[str]] = {}
    if not os.path.isfile(path) and not any(digests.values()):
        return
    if os.path.isfile(path):
        try:
            entries = {name: digest for name, digest in read_manifest(path)
                       if os.path.isfile(os.path.join(directory, name))}
        except SafetensorError:
            entries = {}
    entries.update(digests)
    lines = [manifest_line(d, n) + "\n" for n, d in sorted(entries.items()) if d is not None]
    write_atomic(path, "".join(lines), fsync)


def manifest_wanted() -> bool:
    return os.environ.get(MANIFEST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


#: A framework's writer: ``write(files, fsync, hash)`` writes ``files`` (tensors by name, path,
#: metadata) together and returns their SHA-256 (hex) when ``hash``.
Write = Callable[[List[Tuple[Dict[str, Any], str, Optional[Dict[str, str]]]], bool, bool], Optional[List[str]]]


def host_writer(flatten: Callable[[Dict[str, Any]], Dict[str, Any]]) -> Write:
    """The writer of tensors in host memory: ``flatten`` makes each file's TensorSpecs (keeping
    what they point at alive), the Rust writer writes them straight from that memory."""
    def write(files: List[Tuple[Dict[str, Any], str, Optional[Dict[str, str]]]], fsync: bool,
              hash: bool) -> Optional[List[str]]:
        return serialize_files([(flatten(t), path, meta) for t, path, meta in files], fsync=fsync, hash=hash)

    return write


def save_file(write: Write, tensors: Dict[str, Any], filename: PathLike, metadata: Optional[Dict[str, str]],
              fsync: bool, manifest: bool) -> None:
    """One file; with ``manifest``, its digest (of the bytes written) into the ``SHA256SUMS`` beside it."""
    path = os.fspath(filename)
    digests = write([(tensors, path, metadata)], fsync, manifest)
    record_digests(os.path.dirname(path) or ".", {os.path.basename(path): digests[0] if digests else None}, fsync)


def save_checkpoint(write: Write, state_dict: Dict[str, Any], directory: PathLike,
                    sizes: Tuple[Callable[[str], int], Callable[[str], Optional[Hashable]]], *,
                    max_shard_size: Union[int, str], metadata: Optional[Dict[str, str]], manifest: bool,
                    filename_pattern: str, fsync: bool) -> List[str]:
    """Writes ``state_dict`` as a sharded checkpoint in ``directory`` with ``write`` (every shard
    in one call, so they are written side by side); returns the shards' paths. ``sizes``: each
    name's storage size and storage (tensors sharing one go in the same shard)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    size_of, storage_of = sizes
    shards, total = split(list(state_dict), size_of, storage_of, max_shard_size)
    names = shard_names(max(len(shards), 1), filename_pattern)
    if not shards:
        shards = [[]]
    paths = [os.path.join(directory, name) for name in names]
    jobs = [({k: state_dict[k] for k in shard}, path, metadata) for shard, path in zip(shards, paths)]
    digests = write(jobs, fsync, manifest)
    listed: List[Optional[str]] = list(digests) if digests else [None] * len(names)
    record_digests(directory, dict(zip(names, listed)), fsync)
    if len(shards) > 1:
        weight_map = {k: name for shard, name in zip(shards, names) for k in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index_name = filename_pattern.format(suffix="") + ".index.json"
        write_atomic(os.path.join(directory, index_name), json.dumps(index, indent=2, sort_keys=True) + "\n", fsync)
    _remove_earlier(directory, names, filename_pattern)
    return paths


def _remove_earlier(directory: str, names: List[str], pattern: str) -> None:
    """What an earlier save with ``pattern`` left that the new checkpoint does not use (as
    ``save_pretrained`` cleans its folder): other shard files, and the index when there is one shard."""
    single, _, rest = pattern.partition("{suffix}")
    shard = re.compile(re.escape(single) + r"-\d{5}-of-\d{5}" + re.escape(rest))
    stale = [n for n in os.listdir(directory) if shard.fullmatch(n) and n not in names]
    if len(names) == 1:
        stale.append(pattern.format(suffix="") + ".index.json")
    for name in stale:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))



# -- tensors on a device: staged through a ring of host buffers ---------------------------------

#: Each staging buffer's size, and how many there are (one fills from the device while the one
#: before is written).
STAGING_BYTES = 64 << 20
STAGING_SLOTS = 2


def write_staged(files: List[Tuple[Dict[str, Any], str, Optional[Dict[str, str]]]], sink: Any, *, fsync: bool,
                 hash: bool, staging_bytes: int = STAGING_BYTES, slots: int = STAGING_SLOTS) -> Optional[List[str]]:
    """Writes ``files`` (tensors by name, path, metadata) whose tensors live on a device: each
    file's bytes, in file order, are copied into host buffers by ``sink`` (a
    :class:`safeload._sinks.Sink`: pinned buffers and a copy stream for CUDA) and written by the
    Rust writer on a thread of its own while the next buffer fills. Host memory: the ring, never
    the state dict. Returns the files' SHA-256 (hex) when ``hash``."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from ._safeload import Writer

    layouts = [([(name, str(t.dtype).split(".")[-1], list(t.shape), t.nelement() * t.element_size())
                 for name, t in tensors.items()], path, metadata) for tensors, path, metadata in files]
    writer = Writer(layouts, fsync=fsync, hash=hash)
    fills = _fills(writer.offsets, [tensors for tensors, _, _ in files], staging_bytes)
    largest = max((sum(src.numel() for _, src in parts) for _, _, parts in fills), default=1)
    ring = [sink.alloc_staging(largest) for _ in range(max(1, min(slots, len(fills))))]  # small saves, small ring
    pending: List[Future] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="safeload-save")
    try:
        sink.start()  # the copies wait for the work that made the tensors
        for index, (file, offset, parts) in enumerate(fills):
            if len(pending) == len(ring):
                pending.pop(0).result()  # the buffer's last write is done: refill it
            buf, ptr = ring[index % len(ring)]
            sink.filling(index, index % len(ring))
            sink.copy_fill(index, [(buf[at:at + src.numel()], src) for at, src in parts])
            sink.wait(index)
            size = sum(src.numel() for _, src in parts)
            pending.append(pool.submit(writer.write, file, offset, ptr, size))
        for done in pending:
            done.result()
        sink.finish()
        return writer.finish()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        sink.abort()
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True)


def _fills(offsets: List[List[Tuple[str, int]]], tensors: List[Dict[str, Any]],
           staging_bytes: int) -> List[Tuple[int, int, List[Tuple[int, Any]]]]:
    """Each file's data cut into buffers of at most ``staging_bytes``: (file, offset in the file,
    [(offset in the buffer, 1-D uint8 view of a tensor's bytes)]), in file order."""
    import torch

    fills: List[Tuple[int, int, List[Tuple[int, Any]]]] = []
    for file, placed in enumerate(offsets):
        parts: List[Tuple[int, Any]] = []
        start = used = 0
        for name, offset in placed:
            data = tensors[file][name].reshape(-1).view(torch.uint8)
            done = 0
            while done < data.numel():
                if not parts:
                    start, used = offset + done, 0
                n = min(data.numel() - done, staging_bytes - used)
                parts.append((used, data[done:done + n]))
                used += n
                done += n
                if used == staging_bytes:
                    fills.append((file, start, parts))
                    parts = []
        if parts:
            fills.append((file, start, parts))
    return fills
