//! `convert_bytes`: the core's dtype conversion on a bytes object, so Python tests can compare
//! it with torch bit for bit.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert;
use crate::dtype::Dtype;

fn float_dtype(code: &str) -> PyResult<Dtype> {
    Dtype::from_code(code)
        .filter(|&d| convert::supported(d, d))
        .ok_or_else(|| {
            PyValueError::new_err(format!("unknown dtype {code:?}: expected F32, F16 or BF16"))
        })
}

/// Converts little-endian `from_dtype` elements to `to_dtype` ("F32", "F16", "BF16") as
/// torch's `Tensor.to` does; the GIL is released while converting.
#[pyfunction]
pub fn convert_bytes<'py>(
    py: Python<'py>,
    data: &[u8],
    from_dtype: &str,
    to_dtype: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let (from, to) = (float_dtype(from_dtype)?, float_dtype(to_dtype)?);
    let len = convert::converted_len(from, to, data.len())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    PyBytes::new_with(py, len, |out| {
        py.detach(|| convert::convert(from, to, data, out))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    })
}
