"""The staging ring's test double (``safeload._staging.load_to_device(..., sink=CpuSink())``):
plain host memory, so the ring's scheduling is checked byte for byte without a device
(tests/test_staging.py, tests/test_mps.py, benches/gpu_check.py's self-check)."""

from __future__ import annotations

from typing import Any, List, Tuple

from safeload._sinks import Sink


class CpuSink(Sink):
    """Plain host memory, for tests and self-checks. With ``defer=True`` copies are queued and
    run only at ``wait``/``finish`` (an asynchronous device, slowed down), so refilling a buffer
    too early corrupts the result. ``log`` records ("staging", nbytes), ("fill", index, slot),
    ("copy", index), ("complete", index), ("finish",)."""

    def __init__(self, defer: bool = False, pinned: bool = False) -> None:
        self.defer = defer
        self.pinned = pinned
        self.log: List[Tuple[Any, ...]] = []
        self._pending: List[Tuple[int, List[Tuple[Any, Any]]]] = []

    def alloc_staging(self, nbytes: int) -> Tuple[Any, int]:
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.log.append(("staging", nbytes))
        return buf, buf.data_ptr()

    def alloc_dest(self, nbytes: int) -> Any:
        import torch

        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # poisoned: a missed copy shows

    def filling(self, index: int, slot: int) -> None:
        self.log.append(("fill", index, slot))

    def copy_fill(self, index: int, pairs: List[Tuple[Any, Any]]) -> None:
        self.log.append(("copy", index))
        if self.defer:
            self._pending.append((index, pairs))
        else:
            for dest, src in pairs:
                dest.copy_(src)
            self.log.append(("complete", index))

    def wait(self, index: int) -> None:
        self._complete(index)

    def finish(self) -> None:
        if self._pending:
            self._complete(self._pending[-1][0])
        self.log.append(("finish",))

    def _complete(self, index: int) -> None:
        while self._pending and self._pending[0][0] <= index:
            i, pairs = self._pending.pop(0)
            for dest, src in pairs:
                dest.copy_(src)
            self.log.append(("complete", i))
