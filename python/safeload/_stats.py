"""``Stats``: what a read did, as the Rust reader reports it (``ReadStats``): backend, workers,
request size, bytes, seconds, storage. Its own module so that every reader (``_open``,
``_checkpoint``, ``_staging``, ``distributed``) imports it without importing each other."""

from __future__ import annotations

from typing import Tuple


class Stats:
    """What a handle's reads did: ``backend``, ``threads``, ``chunk_bytes``, ``bytes_read``,
    ``seconds`` (time spent reading), ``storage`` (filesystem kind)."""

    __slots__ = ("backend", "threads", "chunk_bytes", "bytes_read", "seconds", "storage")

    def __init__(self, backend: str, threads: int, chunk_bytes: int, bytes_read: int, seconds: float, storage: str) -> None:
        self.backend = backend
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.bytes_read = bytes_read
        self.seconds = seconds
        self.storage = storage

    @property
    def gib_per_s(self) -> float:
        return self.bytes_read / self.seconds / 2**30 if self.seconds else 0.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"Stats({fields})"

    @classmethod
    def from_rust(cls, t: Tuple[str, int, int, int, float, str]) -> "Stats":
        """From a ``Checkpoint`` read's (backend, threads, chunk_bytes, bytes, seconds, storage)."""
        return cls(*t)

    def add(self, other: "Stats") -> "Stats":
        """Totals over several reads: bytes and seconds add up; the most workers any read used;
        the backend, request size and storage of the latest read that moved bytes."""
        if other.bytes_read or not self.bytes_read:
            self.backend, self.chunk_bytes, self.storage = other.backend, other.chunk_bytes, other.storage
        self.bytes_read += other.bytes_read
        self.seconds += other.seconds
        self.threads = max(self.threads, other.threads)
        return self


class StagingStats:
    """What a staged load did. ``staging_bytes``: host staging memory allocated (pinned for CUDA);
    ``peak_in_flight``: most staging bytes filled and not yet known copied; both are bounded by
    the ring (``ring_buffers * buffer_bytes``)."""

    __slots__ = ("bytes", "tensors", "fills", "buffers", "buffer_bytes", "ring_bytes",
                 "staging_bytes", "peak_in_flight", "pinned", "seconds")

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

    @property
    def pinned_bytes(self) -> int:
        return self.staging_bytes if self.pinned else 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.seconds / 2**30 if self.seconds else 0.0

    def __repr__(self) -> str:
        return "StagingStats(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"
