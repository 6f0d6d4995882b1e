//! `Handle`: one open file, as the Python `safe_open` uses it.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::bytes::Bytes;
use super::errors::{SafetensorError, detached, to_py};
use crate::error::Error;
use crate::header::TensorInfo;
use crate::slice::{self, Index};
use crate::source::{self, ReadOptions, Source};

/// How tensor bytes are obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// Zero-copy views of a private map, faulted in on first touch (safetensors' default).
    Mmap,
    /// The parallel pread engine into owned, aligned buffers.
    Pread,
}

const BACKENDS: &str = "\"auto\", \"mmap\", \"pread\"";

fn parse_backend(name: &str) -> PyResult<Backend> {
    match name {
        "mmap" => Ok(Backend::Mmap),
        "pread" | "auto" => Ok(Backend::Pread),
        other => Err(SafetensorError::new_err(format!(
            "backend {other:?} is invalid (expected one of: {BACKENDS})"
        ))),
    }
}

fn options(threads: Option<usize>, chunk_bytes: Option<usize>) -> ReadOptions {
    let defaults = ReadOptions::default();
    ReadOptions {
        threads: threads.unwrap_or(defaults.threads).max(1),
        chunk_bytes: chunk_bytes.unwrap_or(defaults.chunk_bytes),
    }
}

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Handle {
    source: RwLock<Option<Arc<Source>>>,
    backend: Backend,
    opts: ReadOptions,
}

/// (name, dtype code, shape, bytes): what Python turns into a tensor.
type TensorTuple = (String, &'static str, Vec<usize>, Bytes);
/// (name, dtype code, shape, begin, end): a header entry.
type InfoTuple = (String, &'static str, Vec<usize>, usize, usize);

impl Handle {
    fn source(&self) -> PyResult<Arc<Source>> {
        self.source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| SafetensorError::new_err("File is closed"))
    }

    fn read_infos(
        &self,
        py: Python<'_>,
        source: &Arc<Source>,
        infos: Vec<&TensorInfo>,
    ) -> PyResult<Vec<TensorTuple>> {
        let buffers = match self.backend {
            Backend::Mmap => infos
                .iter()
                .map(|t| source.map_tensor(t))
                .collect::<Result<Vec<_>, Error>>()
                .map_err(to_py)?,
            Backend::Pread => {
                let wanted: Vec<(usize, &TensorInfo)> = infos.iter().map(|t| (0, *t)).collect();
                let opts = self.opts;
                let s: &Source = source;
                detached(py, |poll| source::read_tensors(&[s], &wanted, &opts, poll))?
            }
        };
        Ok(infos
            .into_iter()
            .zip(buffers)
            .map(|(t, b)| {
                (
                    t.name.clone(),
                    t.dtype.code(),
                    t.shape.clone(),
                    Bytes::new(b),
                )
            })
            .collect())
    }
}

fn parse_indices(indices: &Bound<'_, PyAny>) -> PyResult<Vec<Index>> {
    let mut out = Vec::new();
    for item in indices.try_iter()? {
        let item = item?;
        if let Ok(i) = item.extract::<i64>() {
            out.push(Index::Select(i));
        } else if let Ok(t) = item.cast::<PyTuple>() {
            let (start, stop, step): (Option<i64>, Option<i64>, Option<i64>) = t.extract()?;
            out.push(Index::Range {
                start,
                stop,
                step: step.unwrap_or(1),
            });
        } else {
            return Err(PyTypeError::new_err(
                "indices must be ints or (start, stop, step) tuples",
            ));
        }
    }
    Ok(out)
}

#[pymethods]
impl Handle {
    #[new]
    #[pyo3(signature = (path, backend="auto", *, threads=None, chunk_bytes=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        threads: Option<usize>,
        chunk_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let backend = parse_backend(backend)?;
        let source = py.detach(|| Source::open(&path)).map_err(to_py)?;
        Ok(Handle {
            source: RwLock::new(Some(Arc::new(source))),
            backend,
            opts: options(threads, chunk_bytes),
        })
    }

    #[getter]
    fn backend(&self) -> &'static str {
        match self.backend {
            Backend::Mmap => "mmap",
            Backend::Pread => "pread",
        }
    }

    #[getter]
    fn threads(&self) -> usize {
        self.opts.threads
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.opts.chunk_bytes
    }

    #[getter]
    fn closed(&self) -> bool {
        self.source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    fn close(&self) {
        *self.source.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        let source = self.source()?;
        Ok(source
            .header
            .sorted_names()
            .into_iter()
            .map(String::from)
            .collect())
    }

    fn offset_keys(&self) -> PyResult<Vec<String>> {
        Ok(self
            .source()?
            .header
            .tensors
            .iter()
            .map(|t| t.name.clone())
            .collect())
    }

    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let source = self.source()?;
        let Some(entries) = &source.header.metadata else {
            return Ok(None);
        };
        let dict = PyDict::new(py);
        for (k, v) in entries {
            dict.set_item(k, v)?;
        }
        Ok(Some(dict))
    }

    /// (dtype code, shape) of one tensor.
    fn info(&self, name: &str) -> PyResult<(&'static str, Vec<usize>)> {
        let source = self.source()?;
        let t = source.tensor(name).map_err(to_py)?;
        Ok((t.dtype.code(), t.shape.clone()))
    }

    /// (name, dtype, shape, begin, end) of every tensor, in file order.
    fn infos(&self) -> PyResult<Vec<InfoTuple>> {
        let source = self.source()?;
        Ok(source
            .header
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.code(),
                    t.shape.clone(),
                    t.begin,
                    t.end,
                )
            })
            .collect())
    }

    #[getter]
    fn data_start(&self) -> PyResult<u64> {
        Ok(self.source()?.header.data_start())
    }

    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        Ok(self.source()?.path.clone())
    }

    /// Bytes of one tensor.
    fn read(&self, py: Python<'_>, name: &str) -> PyResult<TensorTuple> {
        let source = self.source()?;
        let info = source.tensor(name).map_err(to_py)?;
        let mut out = self.read_infos(py, &source, vec![info])?;
        Ok(out.pop().expect("one tensor asked, one read"))
    }

    /// Bytes of the named tensors (all when `names` is None), in file order, read together.
    #[pyo3(signature = (names=None))]
    fn read_many(&self, py: Python<'_>, names: Option<Vec<String>>) -> PyResult<Vec<TensorTuple>> {
        let source = self.source()?;
        let infos: Vec<&TensorInfo> = match &names {
            None => source.header.tensors.iter().collect(),
            Some(names) => {
                let mut infos = names
                    .iter()
                    .map(|n| source.tensor(n))
                    .collect::<Result<Vec<_>, Error>>()
                    .map_err(to_py)?;
                infos.sort_by_key(|t| t.begin);
                infos
            }
        };
        self.read_infos(py, &source, infos)
    }

    /// `tensor[indices]`: indices are ints and (start, stop, step) tuples, `...` already expanded.
    /// Returns (dtype, shape, bytes); only the needed byte ranges are read.
    fn read_slice(
        &self,
        py: Python<'_>,
        name: &str,
        indices: &Bound<'_, PyAny>,
    ) -> PyResult<(&'static str, Vec<usize>, Bytes)> {
        let source = self.source()?;
        let info = source.tensor(name).map_err(to_py)?;
        let indices = parse_indices(indices)?;
        let plan = slice::plan(info.dtype, &info.shape, &indices).map_err(to_py)?;
        let bytes = match self.backend {
            Backend::Mmap => {
                let whole = source.map_tensor(info).map_err(to_py)?;
                let out = crate::buffer::allocate(&[plan.nbytes])
                    .map_err(|e| to_py(Error::Serialize(format!("out of memory: {e}"))))?
                    .pop()
                    .expect("one size, one buffer");
                // SAFETY: `out` is a fresh allocation of plan.nbytes bytes, not yet shared.
                let dest = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr(), plan.nbytes) };
                slice::gather(&plan, whole.as_slice(), dest);
                out
            }
            Backend::Pread => {
                let opts = self.opts;
                let s: &Source = &source;
                detached(py, |poll| s.read_slice(info, &plan, &opts, poll))?
            }
        };
        Ok((info.dtype.code(), plan.shape, Bytes::new(bytes)))
    }
}

/// Reads every tensor of several files through one worker pool (shards overlap).
/// `selection` optionally limits each file to some names. Returns one list per file.
#[pyfunction]
#[pyo3(signature = (paths, selection=None, *, threads=None, chunk_bytes=None))]
pub fn read_checkpoint(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    selection: Option<Vec<Option<Vec<String>>>>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
) -> PyResult<Vec<Vec<TensorTuple>>> {
    let sources = py
        .detach(|| {
            paths
                .iter()
                .map(|p| Source::open(p))
                .collect::<Result<Vec<_>, Error>>()
        })
        .map_err(to_py)?;
    let mut wanted: Vec<(usize, &TensorInfo)> = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        match selection
            .as_ref()
            .and_then(|sel| sel.get(i))
            .and_then(|names| names.as_ref())
        {
            None => wanted.extend(s.header.tensors.iter().map(|t| (i, t))),
            Some(names) => {
                let mut infos = names
                    .iter()
                    .map(|n| s.tensor(n).map(|t| (i, t)))
                    .collect::<Result<Vec<_>, Error>>()
                    .map_err(to_py)?;
                infos.sort_by_key(|(_, t)| t.begin);
                wanted.extend(infos);
            }
        }
    }
    let opts = options(threads, chunk_bytes);
    let refs: Vec<&Source> = sources.iter().collect();
    let buffers = detached(py, |poll| source::read_tensors(&refs, &wanted, &opts, poll))?;
    let mut out: Vec<Vec<TensorTuple>> = (0..sources.len()).map(|_| Vec::new()).collect();
    for ((file, t), b) in wanted.into_iter().zip(buffers) {
        out[file].push((
            t.name.clone(),
            t.dtype.code(),
            t.shape.clone(),
            Bytes::new(b),
        ));
    }
    Ok(out)
}
