//! Object storage for Python: `storage_options` dicts as the stores take them.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

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
