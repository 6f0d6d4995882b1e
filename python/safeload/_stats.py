"""What reads did. ``Stats`` is the Rust reader's own (``_safeload.Stats``: backend, workers,
request size, bytes, seconds, storage; ``a + b`` adds up); ``StagingStats`` is what a staged
accelerator load did with its ring. Its own module so that every reader (``_open``,
``_checkpoint``, ``_staging``, ``distributed``) imports them without importing each other."""

from __future__ import annotations

from typing import Any, Optional

from ._safeload import Stats

__all__ = ["Stats", "StagingStats"]


class StagingStats:
    """What a staged load did. ``staging_bytes``: host staging memory allocated (pinned for CUDA);
    ``peak_in_flight``: most staging bytes filled and not yet known copied; both are bounded by
    the ring (``ring_buffers * buffer_bytes``)."""

    __slots__ = ("bytes", "tensors", "fills", "buffers", "buffer_bytes", "ring_bytes",
                 "staging_bytes", "peak_in_flight", "pinned", "seconds", "read")

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self.fills = 0
        self.buffers = 0
        self.buffer_bytes = 0
        self.ring_bytes = 0
        self.staging_bytes = 0
        self.peak_in_flight = 0
        self.pinned = False
        self.seconds = 0.0
        #: the reader's own stats of this load's reads (bytes, workers, backend, storage); None
        #: when it read nothing (empty tensors only)
        self.read: Optional[Any] = None

    def add_read(self, read: Any) -> None:
        """Counts one read of this load (a reader ``Stats``) into :attr:`read`."""
        self.read = read if self.read is None else self.read + read

    @property
    def pinned_bytes(self) -> int:
        return self.staging_bytes if self.pinned else 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.seconds / 2**30 if self.seconds else 0.0

    def __repr__(self) -> str:
        return "StagingStats(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"
