//! Writing from Python: `TensorSpec`, `serialize`, `serialize_file` / `serialize_files` (one
//! file, or a checkpoint's shards side by side), and `deserialize`.

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use super::errors::detached;
use crate::error::Error;
use crate::format::dtype::Dtype;
use crate::format::serialize::TensorLayout;
use crate::format::serialize::{TensorIn, to_bytes};
use crate::storage::write::{FileOut, Session, WriteOptions, write_files};

/// Framework dtype names (`torch`'s and `numpy`'s, which agree) or format codes to dtypes.
fn parse_dtype_name(name: &str) -> PyResult<Dtype> {
    Dtype::from_torch_name(name)
        .or_else(|| Dtype::from_code(name))
        .ok_or_else(|| {
            let known: Vec<&str> = Dtype::ALL.iter().filter_map(|d| d.names().torch).collect();
            PyErr::from(Error::Serialize(format!(
                "Unknown dtype {name:?}. Supported dtypes: {}",
                known.join(", ")
            )))
        })
}

/// A tensor to write, given by address: the caller keeps the memory alive during the call.
#[pyclass(frozen, module = "safeload._safeload")]
#[derive(Clone, Debug)]
pub struct TensorSpec {
    dtype: Dtype,
    shape: Vec<usize>,
    data_ptr: u64,
    data_len: usize,
}

#[pymethods]
impl TensorSpec {
    #[new]
    #[pyo3(signature = (*, dtype, shape, data_ptr, data_len))]
    fn new(dtype: &str, mut shape: Vec<usize>, data_ptr: u64, data_len: usize) -> PyResult<Self> {
        let dtype = parse_dtype_name(dtype)?;
        // torch's float4_e2m1fn_x2 packs two values per element: the file counts values.
        if dtype == Dtype::F4
            && let Some(last) = shape.last_mut()
        {
            *last = last.checked_mul(2).ok_or_else(|| {
                PyErr::from(Error::Serialize(format!(
                    "F4 last dimension {last} overflows when doubled"
                )))
            })?;
        }
        Ok(TensorSpec {
            dtype,
            shape,
            data_ptr,
            data_len,
        })
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.code()
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    #[getter]
    fn data_ptr(&self) -> u64 {
        self.data_ptr
    }

    #[getter]
    fn data_len(&self) -> usize {
        self.data_len
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorSpec(dtype='{}', shape={:?}, data_ptr={}, data_len={})",
            self.dtype.code(),
            self.shape,
            self.data_ptr,
            self.data_len
        )
    }
}

fn inputs<'a>(specs: &'a [(String, TensorSpec)]) -> PyResult<Vec<TensorIn<'a>>> {
    specs
        .iter()
        .map(|(name, spec)| {
            if name == "__metadata__" {
                return Err(metadata_name());
            }
            let data: &[u8] = if spec.data_len == 0 {
                &[]
            } else {
                // SAFETY: the caller (safeload.torch / safeload.numpy, or a user of TensorSpec)
                // passes the address and length of live memory it keeps alive during the call,
                // as safetensors' TensorSpec contract requires.
                unsafe {
                    std::slice::from_raw_parts(spec.data_ptr as usize as *const u8, spec.data_len)
                }
            };
            Ok(TensorIn {
                name,
                dtype: spec.dtype,
                shape: &spec.shape,
                data,
            })
        })
        .collect()
}

fn collect(tensor_dict: HashMap<String, TensorSpec>) -> Vec<(String, TensorSpec)> {
    tensor_dict.into_iter().collect()
}

fn metadata_vec(metadata: Option<HashMap<String, String>>) -> Option<Vec<(String, String)>> {
    metadata.map(|m| m.into_iter().collect())
}

#[pyfunction]
#[pyo3(signature = (tensor_dict, metadata=None))]
pub fn serialize<'py>(
    py: Python<'py>,
    tensor_dict: HashMap<String, TensorSpec>,
    metadata: Option<HashMap<String, String>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let specs = collect(tensor_dict);
    let metadata = metadata_vec(metadata);
    let mut tensors = inputs(&specs)?;
    let bytes = detached(py, |_| to_bytes(&mut tensors, metadata.as_deref()))?;
    Ok(PyBytes::new(py, &bytes))
}

/// One file to write from Python: its tensors by name, its path, its `__metadata__`.
type SpecFile = (
    HashMap<String, TensorSpec>,
    PathBuf,
    Option<HashMap<String, String>>,
);
/// A [`SpecFile`] with its tensors and metadata as lists.
type Collected = (
    Vec<(String, TensorSpec)>,
    PathBuf,
    Option<Vec<(String, String)>>,
);

/// Writes one file; with `hash`, returns its SHA-256 (hex) computed from the bytes written.
#[pyfunction]
#[pyo3(signature = (tensor_dict, filename, metadata=None, *, fsync=false, hash=false))]
pub fn serialize_file(
    py: Python<'_>,
    tensor_dict: HashMap<String, TensorSpec>,
    filename: PathBuf,
    metadata: Option<HashMap<String, String>>,
    fsync: bool,
    hash: bool,
) -> PyResult<Option<String>> {
    let digests = serialize_files(py, vec![(tensor_dict, filename, metadata)], fsync, hash)?;
    Ok(digests.and_then(|d| d.into_iter().next()))
}

/// Writes several files side by side (a checkpoint's shards): each `(tensor_dict, filename,
/// metadata)`; all are renamed into place once all are written, or none is. With `hash`, returns
/// each file's SHA-256 (hex), in order.
#[pyfunction]
#[pyo3(signature = (files, *, fsync=false, hash=false))]
pub fn serialize_files(
    py: Python<'_>,
    files: Vec<SpecFile>,
    fsync: bool,
    hash: bool,
) -> PyResult<Option<Vec<String>>> {
    let specs: Vec<Collected> = (files.into_iter())
        .map(|(dict, path, metadata)| (collect(dict), path, metadata_vec(metadata)))
        .collect();
    let mut out = (specs.iter())
        .map(|(specs, path, metadata)| {
            Ok(FileOut {
                path: path.clone(),
                tensors: inputs(specs)?,
                metadata: metadata.clone(),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let options = WriteOptions::new(fsync, hash);
    let digests = detached(py, |_| write_files(&mut out, &options))?;
    Ok(hash.then(|| digests.iter().map(ToString::to_string).collect()))
}

/// One file of a staged save: its tensors as `(name, dtype, shape, nbytes)`, its path, metadata.
type StagedFile = (
    Vec<(String, String, Vec<usize>, usize)>,
    PathBuf,
    Option<HashMap<String, String>>,
);

/// A save whose bytes arrive in pieces (a device's tensors staged through host buffers): the
/// files are made and their headers written at construction; `write` puts staged bytes at their
/// offsets (each file's in order when hashed); `finish` syncs, renames and returns the digests;
/// `abort` (or the object's end) removes the temporaries.
#[pyclass(frozen, module = "safeload._safeload")]
pub struct Writer {
    session: std::sync::Mutex<Option<Session>>,
    offsets: Vec<Vec<(String, u64)>>,
}

#[pymethods]
impl Writer {
    #[new]
    #[pyo3(signature = (files, *, fsync=false, hash=false))]
    fn new(py: Python<'_>, files: Vec<StagedFile>, fsync: bool, hash: bool) -> PyResult<Self> {
        let mut layouts = Vec::with_capacity(files.len());
        for (tensors, path, metadata) in files {
            let tensors = (tensors.into_iter())
                .map(|(name, dtype, shape, nbytes)| {
                    if name == "__metadata__" {
                        return Err(metadata_name());
                    }
                    let spec = TensorSpec::new(&dtype, shape, 0, nbytes)?;
                    Ok(TensorLayout {
                        name,
                        dtype: spec.dtype,
                        shape: spec.shape,
                        len: nbytes,
                    })
                })
                .collect::<PyResult<Vec<_>>>()?;
            layouts.push((path, tensors, metadata_vec(metadata)));
        }
        let options = WriteOptions::new(fsync, hash);
        let (session, offsets) = detached(py, |_| Session::start(layouts, options))?;
        Ok(Writer {
            session: std::sync::Mutex::new(Some(session)),
            offsets,
        })
    }

    /// Each file's tensors in file order, with the offset in the file where each one's bytes go.
    #[getter]
    fn offsets(&self) -> Vec<Vec<(String, u64)>> {
        self.offsets.clone()
    }

    /// Writes `data_len` bytes at address `data_ptr` (memory the caller keeps alive and unchanged
    /// during the call) to `offset` of file `file`, the GIL released.
    fn write(
        &self,
        py: Python<'_>,
        file: usize,
        offset: u64,
        data_ptr: u64,
        data_len: usize,
    ) -> PyResult<()> {
        let mut guard = self.session.lock().unwrap_or_else(|p| p.into_inner());
        let session = guard.as_mut().ok_or_else(finished)?;
        let bytes: &[u8] = if data_len == 0 {
            &[]
        } else {
            // SAFETY: as TensorSpec's contract: the caller passes live memory of this length and
            // keeps it alive and unchanged until the call returns.
            unsafe { std::slice::from_raw_parts(data_ptr as usize as *const u8, data_len) }
        };
        detached(py, |_| session.write(file, offset, bytes))
    }

    /// Every file synced (when asked) and renamed into place; their SHA-256 (hex) when hashed.
    fn finish(&self, py: Python<'_>) -> PyResult<Option<Vec<String>>> {
        let session = (self
            .session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take())
        .ok_or_else(finished)?;
        let hashed = session.hashed();
        let digests = detached(py, |_| session.finish())?;
        Ok(hashed.then(|| digests.iter().map(ToString::to_string).collect()))
    }

    /// Gives up: the temporary files are removed, the targets untouched.
    fn abort(&self) {
        drop(
            self.session
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    }
}

fn finished() -> PyErr {
    PyErr::from(Error::Serialize(
        "Error while serializing: this save has already finished".into(),
    ))
}

fn metadata_name() -> PyErr {
    PyErr::from(Error::Serialize(
        "Error while serializing: a tensor cannot be named `__metadata__` (the header's metadata key)".into(),
    ))
}

/// Parses a whole file held in memory: [(name, {"dtype", "shape", "data"})] in file order.
#[pyfunction]
pub fn deserialize<'py>(
    py: Python<'py>,
    bytes: &[u8],
) -> PyResult<Vec<(String, Bound<'py, PyDict>)>> {
    let wrap = |reason| {
        let e = Error::header(None, reason);
        PyErr::from(Error::Serialize(e.to_string().replacen(
            "deserializing header",
            "deserializing",
            1,
        )))
    };
    let n = crate::format::header::header_len(bytes, bytes.len() as u64).map_err(wrap)?;
    let header = crate::format::header::parse(&bytes[8..8 + n as usize], bytes.len() as u64)
        .map_err(wrap)?;
    let data = &bytes[header.data_start() as usize..];
    let mut out = Vec::with_capacity(header.tensors.len());
    for t in &header.tensors {
        let d = PyDict::new(py);
        d.set_item("dtype", t.dtype.code())?;
        d.set_item("shape", t.shape.clone())?;
        d.set_item("data", PyByteArray::new(py, &data[t.begin..t.end]))?;
        out.push((t.name.clone(), d));
    }
    Ok(out)
}
