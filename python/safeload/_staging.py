"""Accelerator loads through a ring of host staging buffers.

CUDA: a few page-locked (pinned) host buffers, allocated once per load through torch (no CUDA
toolkit at build time), are filled by the parallel pread engine (``Handle.read_ranges``, one call
per fill) in offset order; each is drained by an asynchronous host-to-device copy on a dedicated stream into the
destination tensors, which are all allocated up front. The next buffer fills while the previous
one copies; a buffer is refilled only after an event says its copies are complete, and tensors are
returned only once every copy is complete, so user code never sees partial data. Pinned memory in
use is bounded by the ring (``ring_buffers x buffer_bytes``, default 4 x 64 MiB), whatever the
checkpoint size.

MPS: straight into the device tensors through torch's host alias of their storage where torch has
it (:mod:`safeload._mps`), else like the other torch devices (xpu, npu, hpu ...): the same ring in
plain host memory, each tensor gathered into host memory it owns, then ``.to(device)`` once
complete (never mmap-backed).

The parts are separate so the scheduling is tested byte for byte without a GPU:

* the reader's plan (``staging_plan``: the wanted tensors, checked, and the fills: which bytes of
  the data area go through which fill, and where each piece lands in which tensor);
* a :class:`~safeload._sinks.Sink` (where bytes go, :mod:`safeload._sinks`): ``CudaSink``,
  ``HostThenToSink``, and the tests' ``CpuSink`` (``tests/support/cpu_sink.py``: plain memory;
  can defer its copies until ``wait`` to simulate an asynchronous device, and logs what
  happened);
* :func:`load_to_device`: runs the plan through a sink.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _device, _mps
from ._frameworks import to_dtype, torch_dtype, torch_shape
from ._options import Options, open_options
from ._sinks import Sink, make_sink
from ._safeload import STAGING_RING_ENV, Checkpoint, Fill, Handle, TensorInfo, staging_plan, staging_ring
from ._stats import StagingStats

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Environment variable for the ring, e.g. "4x64MiB", "2x256MiB", "8x16777216"; the ring's rule
#: (arguments, this, a bound by what the process may take) is the reader's: ``staging_ring``.
RING_ENV = STAGING_RING_ENV

Info = TensorInfo  # a header entry, as Handle.infos() returns it
Progress = Callable[[int, int], None]


# -- plan -----------------------------------------------------------------------------------------


def _pow2ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# -- loader ---------------------------------------------------------------------------------------


Source = Union[Handle, str, "os.PathLike[str]"]


def load_to_device(
    sources: Union[Source, Sequence[Source]],
    device: Any,
    *,
    names: Optional[Sequence[Any]] = None,
    ring_buffers: Optional[int] = None,
    buffer_bytes: Optional[int] = None,
    sink: Optional[Sink] = None,
    progress: Optional[Progress] = None,
    **options: Unpack[Options],
) -> Tuple[Dict[str, Any], StagingStats]:
    """Loads tensors of one or more files onto ``device`` through the staging ring.

    ``sources``: a ``Handle`` or path, or a list of them (shards; a tensor name may appear in
    only one). ``names``: the tensors wanted (a list for one source, or one list-or-None per
    source); all when None. ``sink``: replaces the device's (tests). Returns a dict in file order
    of typed tensors, each with its own storage, every copy complete. Paths are opened as one
    checkpoint (``**options``: the reader's, see :class:`safeload._options.Options`) and closed
    after."""
    single = isinstance(sources, (Handle, str, os.PathLike))
    items: List[Any] = [sources] if single else list(sources)  # type: ignore[arg-type]
    if names is None:
        per_source: List[Optional[List[str]]] = [None] * len(items)
    elif single:
        per_source = [list(names)]
    else:
        per_source = [None if n is None else list(n) for n in names]
        if len(per_source) != len(items):
            raise ValueError("names: one entry per source")
    mps: Any = None
    if sink is None:
        target = _device.target("pytorch", device).torch  # raises before any read
        if target is None:
            raise ValueError("load_to_device: device is the CPU (use the plain reader)")
        if target.type == "mps":
            mps = target  # straight into device memory when torch aliases it (safeload._mps)
        else:
            sink = make_sink(target)
    n_buffers, buf_bytes = staging_ring(ring_buffers, buffer_bytes)

    # Paths are opened as one checkpoint (a name in two shards is an error there), read file by
    # file through its handles.
    paths = [os.fspath(i) for i in items if not isinstance(i, Handle)]
    ckpt = Checkpoint(paths, open_options(**options)) if paths else None
    shards = iter(ckpt.handles() if ckpt is not None else [])
    handles = [i if isinstance(i, Handle) else next(shards) for i in items]
    try:
        loaded = None
        if mps is not None:
            loaded = _mps.load(handles, wanted_tensors(handles, per_source)[0], mps, progress)
            sink = make_sink(mps)  # used when there is no usable alias: host memory, then .to
        if loaded is None:
            assert sink is not None
            loaded = _load(handles, per_source, sink, n_buffers, buf_bytes, progress)
        return loaded
    finally:
        if ckpt is not None:
            ckpt.close()


def wanted_tensors(handles: Sequence[Handle], per_source: Sequence[Optional[List[str]]],
                   buffer_bytes: Optional[int] = None) -> Tuple[List[List[Info]], List[Fill]]:
    """The wanted tensors per file in offset order, and their fills through a ring of
    ``buffer_bytes`` buffers (none when None): the reader's plan, names checked, each with a
    torch dtype, before anything is allocated."""
    wanted, fills = staging_plan([h.infos() for h in handles], list(per_source), buffer_bytes)
    for infos in wanted:
        for t in infos:
            torch_dtype(t.dtype, t.name)
    return wanted, fills


def _load(
    handles: List[Handle],
    per_source: List[Optional[List[str]]],
    sink: Sink,
    n_buffers: int,
    buf_bytes: int,
    progress: Optional[Progress],
) -> Tuple[Dict[str, Any], StagingStats]:
    started = time.perf_counter()
    stats = StagingStats()
    stats.pinned = sink.pinned
    wanted, fills = wanted_tensors(handles, per_source, buf_bytes)
    total = sum(f.length for f in fills)
    tensors = _Destinations(sink, wanted)
    tensors.allocate_up_front()
    ring = _allocate_ring(sink, fills, n_buffers, buf_bytes, stats)
    sink.start()
    try:
        _run_fills(handles, fills, ring, sink, tensors, stats, progress, total)
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    del ring

    stats.bytes = total
    stats.tensors = len(tensors.out)
    stats.fills = len(fills)
    stats.seconds = time.perf_counter() - started
    # File order (offset order per file, files in order), as the CPU path returns.
    return {t.name: tensors.out[t.name] for infos in wanted for t in infos}, stats


class _Destinations:
    """The wanted tensors' destination bytes while a load fills them: the bytes each still waits
    for, and the tensors delivered so far (``out``)."""

    def __init__(self, sink: Sink, wanted: List[List[Info]]) -> None:
        self.sink = sink
        self.remaining: Dict[str, int] = {}
        self.meta: Dict[str, Tuple[str, List[int]]] = {}
        for infos in wanted:
            for t in infos:
                self.remaining[t.name] = t.nbytes
                self.meta[t.name] = (t.dtype, t.shape)
        self.dests: Dict[str, Any] = {}
        self.out: Dict[str, Any] = {}

    def allocate_up_front(self) -> None:
        """Every destination when the sink wants them before any read; zero-size tensors (which
        have no fill) delivered now."""
        sink = self.sink
        if sink.eager_dest:
            for name, n in self.remaining.items():
                self.dests[name] = sink.alloc_dest(n)
        for name, n in self.remaining.items():
            if n == 0:
                if name not in self.dests:
                    self.dests[name] = sink.alloc_dest(0)
                self.out[name] = sink.deliver(self._typed(name), -1)
                del self.dests[name]

    def pieces(self, fill: Fill, buf: Any) -> Tuple[List[Tuple[Any, Any]], List[str]]:
        """The ``(destination, staging)`` byte views of ``fill``'s copies out of ``buf``
        (allocating a destination at its first piece), and the tensors they complete."""
        pairs = []
        finished = []
        for name, t_off, s_off, n in fill.copies:
            dest = self.dests.get(name)
            if dest is None:
                dest = self.dests[name] = self.sink.alloc_dest(self.remaining[name])
            pairs.append((dest[t_off : t_off + n], buf[s_off : s_off + n]))
            left = self.remaining[name] - n
            self.remaining[name] = left
            if left == 0:
                finished.append(name)
        return pairs, finished

    def deliver(self, names: List[str], index: int) -> None:
        """Hands the sink the tensors whose last piece was enqueued in fill ``index``."""
        for name in names:
            self.out[name] = self.sink.deliver(self._typed(name), index)
            del self.dests[name]

    def _typed(self, name: str) -> Any:
        code, shape = self.meta[name]
        return self.dests[name].view(torch_dtype(code, name)).reshape(torch_shape(code, shape))


def _allocate_ring(sink: Sink, fills: List[Fill], n_buffers: int, buf_bytes: int,
                   stats: StagingStats) -> List[Tuple[Any, int]]:
    """The ring: as many buffers as fills need (at most ``n_buffers``), each no larger than
    needed; its sizes go into ``stats``."""
    size = min(buf_bytes, _pow2ceil(max((f.length for f in fills), default=0)))
    ring: List[Tuple[Any, int]] = []
    for _ in range(min(n_buffers, len(fills))):
        ring.append(sink.alloc_staging(size))
    stats.buffers, stats.buffer_bytes, stats.ring_bytes = len(ring), size, n_buffers * buf_bytes
    stats.staging_bytes = len(ring) * size
    return ring


def _run_fills(handles: List[Handle], fills: List[Fill], ring: List[Tuple[Any, int]], sink: Sink,
               tensors: _Destinations, stats: StagingStats, progress: Optional[Progress], total: int) -> None:
    """Reads every fill into its ring buffer (once the copies of the fill that used the buffer
    before are complete) and enqueues its copies; delivers each tensor its last piece completes."""
    in_flight: Dict[int, int] = {}  # fill index -> staging bytes not yet known copied
    done = 0
    for index, fill in enumerate(fills):
        if index >= len(ring):
            previous = index - len(ring)
            sink.wait(previous)
            for j in [j for j in in_flight if j <= previous]:
                del in_flight[j]
        slot = index % len(ring)
        buf, address = ring[slot]
        sink.filling(index, slot)
        read = handles[fill.source].read_ranges(
            [(buf[at:at + length], offset) for offset, length, at in fill.reads])
        stats.add_read(read)
        in_flight[index] = fill.length
        stats.peak_in_flight = max(stats.peak_in_flight, sum(in_flight.values()))
        pairs, finished = tensors.pieces(fill, buf)
        sink.copy_fill(index, pairs)
        tensors.deliver(finished, index)
        done += fill.length
        if progress is not None:
            progress(done, total)


def load_checkpoint_to_device(ckpt: Any, target: Any, *, progress: Optional[Progress] = None,
                              dtype: Any = None) -> Dict[str, Any]:
    """``load_checkpoint`` to a device: every shard of an open ``Checkpoint`` (its backend, threads,
    chunk size, cache and storage options) through one staging ring. ``dtype`` converts the
    floating-point tensors on the device (torch's conversion, which the CPU path's matches bit for
    bit). The reads count in ``ckpt.stats()``."""
    out, _ = load_to_device(ckpt.handles(), target, progress=progress)
    return to_dtype(out, dtype)
