//! Writing from Python: `TensorSpec`, `serialize`, `serialize_file` / `serialize_files` (one
//! file, or a checkpoint's shards side by side), and `deserialize`.

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

use super::errors::detached;
use crate::error::Error;
use crate::format::dtype::Dtype;
use crate::format::serialize::{TensorIn, to_bytes};
use crate::storage::write::{FileOut, WriteOptions, write_files};

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
                return Err(PyErr::from(Error::Serialize(
                    "Error while serializing: a tensor cannot be named `__metadata__` (the header's metadata key)".into(),
                )));
            }
            let data: &[u8] = if spec.data_len == 0 {
                &[]
            } else {
                // SAFETY: the caller (safeload.torch / safeload.numpy, or a user of TensorSpec)
                // passes the address and length of live memory it keeps alive during the call,
                // as safetensors' TensorSpec contract requires.
                unsafe { std::slice::from_raw_parts(spec.data_ptr as usize as *const u8, spec.data_len) }
            };
            Ok(TensorIn { name, dtype: spec.dtype, shape: &spec.shape, data })
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
    files: Vec<(
        HashMap<String, TensorSpec>,
        PathBuf,
        Option<HashMap<String, String>>,
    )>,
    fsync: bool,
    hash: bool,
) -> PyResult<Option<Vec<String>>> {
    let specs: Vec<(
        Vec<(String, TensorSpec)>,
        PathBuf,
        Option<Vec<(String, String)>>,
    )> = (files.into_iter())
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
