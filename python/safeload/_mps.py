"""MPS loads straight into device memory, through torch's host alias of MPS storage.

On Apple silicon an MPS tensor's ``MTLBuffer`` lives in unified memory. Where torch has
``torch.mps._host_alias_storage(untyped_storage)`` (a CPU ``UntypedStorage`` sharing the buffer's
memory, which keeps the MPS storage alive; it raises for storage that is not a shared-storage
``MTLBuffer``), every destination tensor is allocated on the device up front, each is aliased, and
the parallel reader (``Handle.read_ranges``, one call per file) writes the file's bytes straight
through the aliases,
between two ``torch.mps.synchronize()`` calls: one host write per byte, no host copy of the
tensors, 1x memory.

Everything that can fail (torch without the alias, an alias that raises or looks wrong, a dtype
the device refuses, device memory) fails before the first byte is read, and then :func:`load`
returns None so the caller takes the host-then-``.to`` path (:class:`safeload._sinks.HostThenToSink`)
instead: never a wrong value. A missing or raising alias is remembered for the process
(:data:`alias_usable`); other failures only affect the load at hand.

Tensors pulled one at a time (``get_tensor`` loops, ``get_slice(k)[...]`` from several threads)
go through the Rust reader's read-ahead instead (:func:`take`): it asks for the destinations of
the tensors it is about to read, :func:`_allocator` makes them here, on the caller's thread (MPS
memory and its alias, then one ``synchronize``), and the reader's workers write the file's bytes
into them in file order while the caller works on the tensors it already has.

The parts are separate so the path is tested on Linux with a CPU stand-in for the device
(``tests/test_mps.py``): :func:`load` and :func:`take`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._frameworks import torch_dtype, torch_shape
from ._logging import logger
from ._safeload import Handle, TensorInfo
from ._stats import StagingStats

Progress = Callable[[int, int], None]

#: None: not probed yet in this process; True: the alias worked; False: torch lacks it or it
#: raised, so MPS loads go through host memory (tests reset it).
alias_usable: Optional[bool] = None


def _alias_function(torch: Any) -> Optional[Callable[[Any], Any]]:
    return getattr(getattr(torch, "mps", None), "_host_alias_storage", None)


def _synchronize(torch: Any) -> None:
    torch.mps.synchronize()


def _destination(torch: Any, alias_fn: Callable[[Any], Any], device: Any, name: str, code: str,
                 shape: List[int], nbytes: int) -> Tuple[Any, Any, Any]:
    """A tensor of ``nbytes`` on the device, and a uint8 CPU tensor over its alias that the reader
    writes (None for an empty one), and the alias (keeps the memory mapped). Raises when the
    device refuses the allocation or the alias fails or looks wrong (``alias_usable`` then False)."""
    global alias_usable
    raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
    tensor = raw.view(torch_dtype(code, name)).reshape(torch_shape(code, shape))
    if nbytes == 0:
        return tensor, None, None
    try:
        alias = alias_fn(raw.untyped_storage())
        at = raw.storage_offset()
        if alias.device.type != "cpu" or alias.nbytes() < at + nbytes or not alias.data_ptr():
            raise RuntimeError(f"alias of {alias.nbytes()} bytes on {alias.device} for {at}+{nbytes}")
    except Exception as e:  # noqa: BLE001 - any alias failure: host path instead
        logger.debug("MPS: torch.mps._host_alias_storage failed (%s); loading through host memory", e)
        alias_usable = False
        raise
    alias_usable = True
    view = torch.empty(0, dtype=torch.uint8).set_(alias)  # CPU tensor over the alias
    return tensor, view[at:at + nbytes], alias


def _allocator(torch: Any, alias_fn: Callable[[Any], Any], device: Any) -> Callable[[Any], Any]:
    """What the read-ahead calls for destinations (``Handle.take_into``): for each (name, dtype
    code, shape, bytes), the device tensor and the host view it reads into; None, having made
    nothing it keeps, when any of them fails (those tensors are then read the fallback way)."""

    def allocate(items: Sequence[Tuple[str, str, List[int], int]]) -> Optional[List[Tuple[Any, Any]]]:
        pairs: List[Tuple[Any, Any]] = []
        try:
            for name, code, shape, nbytes in items:
                tensor, view, _ = _destination(torch, alias_fn, device, name, code, shape, nbytes)
                pairs.append((tensor, torch.empty(0, dtype=torch.uint8) if view is None else view))
        except Exception as e:  # noqa: BLE001
            if alias_usable is not False:
                logger.debug("MPS: device allocation failed (%s); reading on demand", e)
            return None
        _synchronize(torch)  # no GPU work may still touch the (recycled) buffers
        return pairs

    return allocate


def allocator(device: Any) -> Optional[Callable[[Any], Any]]:
    """The read-ahead's destinations on ``device`` (:func:`_allocator`), or None where this torch
    has no usable host alias."""
    import torch

    alias_fn = _alias_function(torch)
    if alias_fn is None or alias_usable is False:
        return None
    return _allocator(torch, alias_fn, device)


def take(handle: Handle, device: Any, name: str, key: Any = None, bounds: str = "strict") -> Optional[Any]:
    """Tensor ``name`` (or ``[key]`` when it covers it) on MPS from the handle's read-ahead,
    which writes it and the tensors after it straight into MPS memory through host aliases; None
    when the read-ahead does not serve it (a part of a tensor, read-ahead off, no usable alias):
    the caller then reads it the per-tensor way."""
    allocate = allocator(device)
    return None if allocate is None else handle.take_into(name, allocate, key, bounds)


def load(
    handles: Sequence[Handle],
    wanted: Sequence[Sequence[TensorInfo]],
    device: Any,
    progress: Optional[Progress] = None,
) -> Optional[Tuple[Dict[str, Any], StagingStats]]:
    """Reads ``wanted`` (per handle, the tensors in offset order, already checked) into MPS
    tensors on ``device`` through host aliases. Returns the tensors in file order and what the
    load did, or None, having read nothing, when the alias path is not usable here (the caller
    falls back)."""
    global alias_usable
    import torch

    started = time.perf_counter()
    alias_fn = _alias_function(torch)
    if alias_fn is None or alias_usable is False:
        if alias_usable is None:
            logger.debug("MPS: torch %s has no torch.mps._host_alias_storage; loading through "
                         "host memory", torch.__version__)
        alias_usable = False
        return None

    # Every destination and alias before any read: a failure here costs no I/O.
    out: Dict[str, Any] = {}
    aliases: List[Any] = []  # kept alive until the writes are complete
    spans: List[List[Tuple[Any, int]]] = [[] for _ in wanted]  # per file: (host view, data offset)
    try:
        for source, infos in enumerate(wanted):
            for t in infos:
                name, code, shape, begin, end = t.name, t.dtype, t.shape, t.begin, t.end
                tensor, view, alias = _destination(torch, alias_fn, device, name, code, shape, end - begin)
                out[name] = tensor
                if view is not None:
                    aliases.append(alias)
                    spans[source].append((view, begin))
    except Exception as e:  # noqa: BLE001
        if alias_usable is not False:
            logger.debug("MPS: device allocation failed (%s); loading through host memory", e)
        out.clear()
        aliases.clear()
        return None

    total = sum(t.nbytes for infos in wanted for t in infos)
    _synchronize(torch)  # no GPU work may still touch the (recycled) buffers
    stats = StagingStats()
    done = 0
    for source, ranges in enumerate(spans):  # one call per file, read in parallel, file order
        if ranges:
            read = handles[source].read_ranges(ranges)
            stats.add_read(read)
            done += read.bytes_read
        if progress is not None:
            progress(done, total)
    _synchronize(torch)  # the host writes are visible before any GPU work reads them
    aliases.clear()

    stats.bytes = total
    stats.tensors = len(out)
    stats.fills = sum(1 for ranges in spans if ranges)
    stats.seconds = time.perf_counter() - started
    # File order (offset order per file, files in order), as the other paths return.
    return {t.name: out[t.name] for infos in wanted for t in infos}, stats
