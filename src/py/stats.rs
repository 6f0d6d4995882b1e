//! `Stats`: what reads did (`f.stats`, `load_checkpoint(..., return_stats=True)`), made by the
//! reader from its own counts: the core's `ReadStats`, with named fields, that add up.

use pyo3::prelude::*;

use crate::checkpoint::ReadStats;

/// What reads did: `backend` ("pread", "direct", "mmap"), `threads` (the most workers a read
/// used), `chunk_bytes` (the request size), `bytes_read`, `seconds` (time spent reading),
/// `storage` (the filesystem kind: "local", "fuse", "nfs" ...); `verified_files` and
/// `verified_bytes` (files whose SHA-256 matched under `verify=`), `recorded_files` (files the
/// verified record vouched for, not hashed), `unverified_files` (files
/// loaded with no digest known, under `SAFELOAD_VERIFY=1`). `a + b`: totals of both.
#[pyclass(frozen, eq, get_all, name = "Stats", module = "safeload._safeload")]
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    backend: String,
    threads: usize,
    chunk_bytes: usize,
    bytes_read: u64,
    seconds: f64,
    storage: String,
    verified_files: usize,
    verified_bytes: u64,
    recorded_files: usize,
    unverified_files: usize,
}

impl From<ReadStats> for Stats {
    fn from(s: ReadStats) -> Self {
        Stats {
            backend: s.strategy.name().to_string(),
            threads: s.threads,
            chunk_bytes: s.chunk_bytes,
            bytes_read: s.bytes,
            seconds: s.seconds,
            storage: s.storage.to_string(),
            verified_files: s.verified.files,
            verified_bytes: s.verified.bytes,
            recorded_files: s.verified.recorded,
            unverified_files: s.verified.unverified,
        }
    }
}

#[pymethods]
impl Stats {
    #[new]
    #[pyo3(signature = (backend, threads=0, chunk_bytes=0, bytes_read=0, seconds=0.0, storage=String::new(), verified_files=0, verified_bytes=0, recorded_files=0, unverified_files=0))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per field
    fn new(
        backend: String,
        threads: usize,
        chunk_bytes: usize,
        bytes_read: u64,
        seconds: f64,
        storage: String,
        verified_files: usize,
        verified_bytes: u64,
        recorded_files: usize,
        unverified_files: usize,
    ) -> Self {
        Stats {
            backend,
            threads,
            chunk_bytes,
            bytes_read,
            seconds,
            storage,
            verified_files,
            verified_bytes,
            recorded_files,
            unverified_files,
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
            verified_files: self.verified_files + other.verified_files,
            verified_bytes: self.verified_bytes + other.verified_bytes,
            recorded_files: self.recorded_files + other.recorded_files,
            unverified_files: self.unverified_files + other.unverified_files,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Stats(backend='{}', threads={}, chunk_bytes={}, bytes_read={}, seconds={:?}, storage='{}', \
             verified_files={}, verified_bytes={}, recorded_files={}, unverified_files={})",
            self.backend,
            self.threads,
            self.chunk_bytes,
            self.bytes_read,
            self.seconds,
            self.storage,
            self.verified_files,
            self.verified_bytes,
            self.recorded_files,
            self.unverified_files
        )
    }
}
