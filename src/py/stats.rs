//! `Stats`: what reads did (`f.stats`, `load_checkpoint(..., return_stats=True)`), made by the
//! reader from its own counts: the core's `ReadStats`, with named fields, that add up.

use pyo3::prelude::*;

use crate::checkpoint::ReadStats;

/// What reads did: `backend` ("pread", "direct", "mmap"), `threads` (the most workers a read
/// used), `chunk_bytes` (the request size), `bytes_read`, `seconds` (time spent reading),
/// `storage` (the filesystem kind: "local", "fuse", "nfs" ...). `a + b`: totals of both.
#[pyclass(frozen, eq, get_all, name = "Stats", module = "safeload._safeload")]
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    backend: String,
    threads: usize,
    chunk_bytes: usize,
    bytes_read: u64,
    seconds: f64,
    storage: String,
}

impl From<ReadStats> for Stats {
    fn from(s: ReadStats) -> Self {
        Stats {
            backend: s.backend.name().to_string(),
            threads: s.threads,
            chunk_bytes: s.chunk_bytes,
            bytes_read: s.bytes,
            seconds: s.seconds,
            storage: s.storage.to_string(),
        }
    }
}

#[pymethods]
impl Stats {
    #[new]
    #[pyo3(signature = (backend, threads=0, chunk_bytes=0, bytes_read=0, seconds=0.0, storage=String::new()))]
    fn new(
        backend: String,
        threads: usize,
        chunk_bytes: usize,
        bytes_read: u64,
        seconds: f64,
        storage: String,
    ) -> Self {
        Stats {
            backend,
            threads,
            chunk_bytes,
            bytes_read,
            seconds,
            storage,
        }
    }

    #[getter]
    fn gib_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes_read as f64 / self.seconds / (1u64 << 30) as f64
        } else {
            0.0
        }
    }

    /// Totals over both: bytes and seconds add up, the most workers either used; the backend,
    /// request size and storage of `other` when it moved bytes (or when `self` moved none).
    fn __add__(&self, other: &Stats) -> Stats {
        let latest = if other.bytes_read > 0 || self.bytes_read == 0 {
            other
        } else {
            self
        };
        Stats {
            backend: latest.backend.clone(),
            threads: self.threads.max(other.threads),
            chunk_bytes: latest.chunk_bytes,
            bytes_read: self.bytes_read + other.bytes_read,
            seconds: self.seconds + other.seconds,
            storage: latest.storage.clone(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Stats(backend='{}', threads={}, chunk_bytes={}, bytes_read={}, seconds={:?}, storage='{}')",
            self.backend,
            self.threads,
            self.chunk_bytes,
            self.bytes_read,
            self.seconds,
            self.storage
        )
    }
}
