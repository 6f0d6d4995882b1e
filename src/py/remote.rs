//! Object storage for Python: `storage_options` dicts as the stores take them, which paths are
//! URLs, and the shard URLs of a checkpoint named by URL (index.json fetched, prefixes listed).

use std::path::PathBuf;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::error::Error;

/// `storage_options` (fsspec / obstore style): string keys; values str, bool or int (passed on
/// as strings: `True` -> "true").
#[derive(Default)]
pub struct StorageOptions(pub Vec<(String, String)>);

impl<'py> FromPyObject<'_, 'py> for StorageOptions {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let dict = obj
            .cast::<PyDict>()
            .map_err(|_| PyTypeError::new_err("storage_options must be a dict of str to str"))?;
        let mut pairs = Vec::with_capacity(dict.len());
        for (key, value) in dict.iter() {
            let key: String = key
                .extract()
                .map_err(|_| PyTypeError::new_err("storage_options keys must be str"))?;
            let value = match value.cast::<PyBool>() {
                Ok(b) => b.is_true().to_string(),
                Err(_) => value.str()?.to_string(),
            };
            pairs.push((key, value));
        }
        pairs.sort();
        Ok(StorageOptions(pairs))
    }
}

/// Whether `path` is read from object storage (`s3://`, `gs://`, `az://`, `abfs://`, `http(s)://`).
#[pyfunction]
pub fn is_url(path: PathBuf) -> bool {
    crate::remote::is_url(&path)
}

/// The shard URLs of the checkpoint at `url` (a file, an index.json, or a prefix listed).
#[pyfunction]
#[pyo3(signature = (url, storage_options=None))]
pub fn checkpoint_urls(
    py: Python<'_>,
    url: &str,
    storage_options: Option<StorageOptions>,
) -> PyResult<Vec<String>> {
    let store = storage_options.unwrap_or_default().0;
    py.detach(|| crate::remote::checkpoint_urls(url, &store))
        .map_err(|e| PyErr::from(Error::remote(url.as_ref(), e)))
}
