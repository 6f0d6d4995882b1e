//! `Checkpoint`: one or many shards opened once, read into new memory or into the caller's
//! tensors (handed over as DLPack), converting dtypes on the way. Every multi-shard consumer
//! (load_checkpoint, iter_checkpoint, load_model, distributed shares) reads through it.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use pyo3::prelude::*;

use super::args::{TensorTuple, options, parse_backend, parse_dtype};
use super::bytes::Bytes;
use super::dlpack::Destinations;
use super::errors::{SafetensorError, detached, to_py};
use super::remote::StorageOptions;
use crate::checkpoint::{self, Entry, ReadStats};
use crate::dtype::Dtype;
use crate::error::Error;
use crate::source::Target;

/// (backend, threads, chunk_bytes, bytes, seconds, storage): one read, as Python's `Stats`.
type StatsTuple = (&'static str, usize, usize, u64, f64, &'static str);
/// (name, dtype code, shape, begin, end, shard index).
type InfoTuple = (String, &'static str, Vec<usize>, usize, usize, usize);

fn stats(s: ReadStats) -> StatsTuple {
    (
        s.backend.name(),
        s.threads,
        s.chunk_bytes,
        s.bytes,
        s.seconds,
        s.storage,
    )
}

fn tuples(entries: &[Entry<'_>], read: crate::source::Tensors) -> Vec<TensorTuple> {
    entries
        .iter()
        .zip(read)
        .map(|((_, t), (bytes, dtype))| {
            (
                t.name.clone(),
                dtype.code(),
                t.shape.clone(),
                Bytes::new(bytes),
            )
        })
        .collect()
}

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Checkpoint {
    inner: RwLock<Option<Arc<checkpoint::Checkpoint>>>,
}

impl Checkpoint {
    fn get(&self) -> PyResult<Arc<checkpoint::Checkpoint>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| SafetensorError::new_err("Checkpoint is closed"))
    }
}

#[pymethods]
impl Checkpoint {
    #[new]
    #[pyo3(signature = (paths, backend="auto", *, threads=None, chunk_bytes=None, drop_cache=false, storage_options=None))]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        backend: &str,
        threads: Option<usize>,
        chunk_bytes: Option<usize>,
        drop_cache: bool,
        storage_options: Option<StorageOptions>,
    ) -> PyResult<Self> {
        let backend = parse_backend(backend)?;
        let opts = options(threads, chunk_bytes, drop_cache);
        let store = storage_options.unwrap_or_default().0;
        let inner = py
            .detach(|| checkpoint::Checkpoint::open_with(&paths, backend, opts, &store))
            .map_err(to_py)?;
        Ok(Checkpoint {
            inner: RwLock::new(Some(Arc::new(inner))),
        })
    }

    /// The backend reads will use ("mmap", "pread" or "direct"; "auto" resolved).
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.get()?.strategy().name())
    }

    /// Every tensor as (name, dtype, shape, begin, end, shard), in (shard, offset) order.
    fn infos(&self) -> PyResult<Vec<InfoTuple>> {
        Ok(self
            .get()?
            .entries()
            .map(|(s, t)| {
                (
                    t.name.clone(),
                    t.dtype.code(),
                    t.shape.clone(),
                    t.begin,
                    t.end,
                    s,
                )
            })
            .collect())
    }

    /// The named tensors (all when None) in file order, cut into batches of at most
    /// `max_bytes` (a larger tensor is a batch of its own).
    #[pyo3(signature = (names=None, *, max_bytes))]
    fn batches(&self, names: Option<Vec<String>>, max_bytes: u64) -> PyResult<Vec<Vec<String>>> {
        let ckpt = self.get()?;
        let picked = ckpt.select(names.as_deref()).map_err(to_py)?;
        Ok(checkpoint::Checkpoint::batches(&picked, max_bytes)
            .into_iter()
            .map(|b| b.into_iter().map(|(_, t)| t.name.clone()).collect())
            .collect())
    }

    /// Reads the named tensors (all when None) into new memory, in file order, with one worker
    /// pool; `dtype` ("F32", "F16", "BF16") converts the floating-point ones on the way.
    #[pyo3(signature = (names=None, dtype=None))]
    fn read(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        dtype: Option<&str>,
    ) -> PyResult<(Vec<TensorTuple>, StatsTuple)> {
        let dtype = parse_dtype(dtype)?;
        let ckpt = self.get()?;
        let picked = ckpt.select(names.as_deref()).map_err(to_py)?;
        let c: &checkpoint::Checkpoint = &ckpt;
        let (read, s) = detached(py, |poll| c.read(&picked, dtype, poll))?;
        Ok((tuples(&picked, read), stats(s)))
    }

    /// Reads each named tensor straight into the matching destination: a host tensor or array
    /// exporting DLPack, contiguous, of the tensor's shape; its dtype may differ where a
    /// converter exists (F32/F16/BF16), or be uint8 bytes of the tensor's exact size.
    fn read_into(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        dests: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<StatsTuple> {
        if names.len() != dests.len() {
            return Err(SafetensorError::new_err(format!(
                "{} names for {} destinations",
                names.len(),
                dests.len()
            )));
        }
        let ckpt = self.get()?;
        let labels: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut held = Destinations::borrow(&dests, &labels)?;
        let dtypes = held.dtypes();
        let mut targets = Vec::with_capacity(names.len());
        for ((name, dest), dtype) in names.iter().zip(held.slices()).zip(dtypes) {
            let (source, info) = ckpt.get(name).map_err(to_py)?;
            // A uint8 view of the tensor's own size takes its bytes as they are.
            let dtype = match dtype {
                Some(Dtype::U8) if dest.len() == info.nbytes() => info.dtype,
                Some(d) => d,
                None => {
                    return Err(to_py(Error::Destination(format!(
                        "the destination of tensor {name} has an element type the format lacks"
                    ))));
                }
            };
            targets.push(Target {
                source,
                info,
                dtype,
                dest,
            });
        }
        let c: &checkpoint::Checkpoint = &ckpt;
        let s = detached(py, |poll| c.read_into(targets, poll))?;
        Ok(stats(s))
    }

    fn close(&self) {
        *self.inner.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// (source, reads, length, copies) of one staging fill, copies naming tensors by index.
type FillTuple = (
    usize,
    Vec<(u64, usize, usize)>,
    usize,
    Vec<(usize, usize, usize, usize)>,
);

/// The staging fills for tensors' data-area spans `(begin, end)` of one source (see
/// `plan::staging_fills`): where accelerator loads plan their reads.
#[pyfunction]
pub fn staging_fills(
    spans: Vec<(usize, usize)>,
    buffer_bytes: usize,
    source: usize,
) -> PyResult<Vec<FillTuple>> {
    if buffer_bytes < 1 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "buffer_bytes must be positive, got {buffer_bytes}"
        )));
    }
    Ok(crate::plan::staging_fills(&spans, buffer_bytes, source)
        .into_iter()
        .map(|f| (f.source, f.reads, f.length, f.copies))
        .collect())
}
