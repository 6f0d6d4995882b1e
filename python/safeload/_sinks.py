"""Where an accelerator load's staged bytes go (:mod:`safeload._staging` runs the ring through
one): a :class:`Sink` allocates the staging buffers and the destinations, copies each filled
buffer's pieces into their tensors and says when they are complete. :class:`CudaSink` (pinned
buffers, ``non_blocking`` copies on a dedicated stream, an event per fill) and
:class:`HostThenToSink` (plain host memory, then ``.to(device)``); the tests' plain-memory double
is ``tests/support/cpu_sink.py``."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple


class Sink:
    """Where staged bytes go. The loader calls, in order: ``alloc_dest`` (for every tensor when
    ``eager_dest``, else when its first piece comes), ``alloc_staging`` (once per ring buffer),
    ``start``, then per fill: ``wait`` (for the fill that last used the buffer, before it is
    refilled), ``filling``, ``copy_fill`` (enqueue the fill's copies), ``deliver`` (each tensor
    whose last piece was in that fill); then ``finish`` (all copies complete), or ``abort`` on an error."""

    #: allocate every destination before any read (device OOM fails before reading).
    eager_dest = True
    #: staging buffers are page-locked (counted as pinned bytes).
    pinned = False

    def alloc_staging(self, nbytes: int) -> Tuple[Any, int]:
        """A 1-D uint8 tensor of ``nbytes`` host bytes and its address."""
        raise NotImplementedError

    def alloc_dest(self, nbytes: int) -> Any:
        """A fresh 1-D uint8 tensor of ``nbytes`` (its own storage) for one tensor's bytes."""
        raise NotImplementedError

    def start(self) -> None:
        """Every eager destination is allocated; copies begin."""

    def filling(self, index: int, slot: int) -> None:
        """Fill ``index`` is about to be read into ring buffer ``slot``."""

    def copy_fill(self, index: int, pairs: List[Tuple[Any, Any]]) -> None:
        """Copies ``(dest bytes view, staging bytes view)`` pairs of fill ``index`` (may be
        asynchronous: the staging buffer stays untouched until ``wait(index)`` returns)."""
        raise NotImplementedError

    def wait(self, index: int) -> None:
        """Blocks until fill ``index``'s copies are complete."""

    def deliver(self, tensor: Any, index: int) -> Any:
        """The tensor to return, given its typed view once its last piece was enqueued in fill
        ``index`` (its copy may still be running until ``wait(index)`` / ``finish``)."""
        return tensor

    def finish(self) -> None:
        """Blocks until every copy is complete."""

    def abort(self) -> None:
        """After an error: let in-flight copies end before buffers are released."""
        self.finish()


class CudaSink(Sink):
    """Pinned staging buffers, ``non_blocking`` copies on a dedicated stream, one event per fill."""

    pinned = True

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._events: Dict[int, Any] = {}

    def alloc_staging(self, nbytes: int) -> Tuple[Any, int]:
        buf = self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)
        return buf, buf.data_ptr()

    def alloc_dest(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def start(self) -> None:
        # Destinations were allocated on the current stream: the copy stream must not write them
        # before earlier work there (that may still use the recycled memory) is done.
        self.stream.wait_stream(self._torch.cuda.current_stream(self.device))

    def copy_fill(self, index: int, pairs: List[Tuple[Any, Any]]) -> None:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            for dest, src in pairs:
                dest.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[index] = event

    def wait(self, index: int) -> None:
        for i in [i for i in self._events if i <= index]:
            self._events.pop(i).synchronize()

    def finish(self) -> None:
        self.stream.synchronize()
        self._events.clear()


class HostThenToSink(Sink):
    """MPS and other devices: tensors gathered into host memory they own (plain staging ring),
    then ``.to(device)`` once complete; host memory is the ring plus the tensors in progress."""

    eager_dest = False

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        module = getattr(torch, self.device.type, None)
        self._sync = getattr(module, "synchronize", None)

    def alloc_staging(self, nbytes: int) -> Tuple[Any, int]:
        buf = self._torch.empty(nbytes, dtype=self._torch.uint8)
        return buf, buf.data_ptr()

    def alloc_dest(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)

    def copy_fill(self, index: int, pairs: List[Tuple[Any, Any]]) -> None:
        for dest, src in pairs:
            dest.copy_(src)

    def deliver(self, tensor: Any, index: int) -> Any:
        return tensor.to(self.device)

    def finish(self) -> None:
        if self._sync is not None and self.device.type != "cpu":
            self._sync()


def make_sink(device: Any) -> Sink:
    """The sink for a torch device: CUDA -> :class:`CudaSink`, others -> :class:`HostThenToSink`."""
    if device.type == "cuda":
        return CudaSink(device)
    return HostThenToSink(device)
