//! `safeload._safeload._testing`: the core's parts one at a time, for tests and benches (a
//! conversion on a bytes object to compare with torch bit for bit, staging plans, ring sizes,
//! page-cache residency, cgroup limits read from a fixture tree, what a handle's read-ahead
//! holds). The package does not use them and they are not its API: built only with cargo
//! feature `testing` (`.ci/run` installs so for the tests), never into the wheels, since
//! `set_cgroup_root` changes what every later load in the process sees.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::handle::Handle;
use crate::error::Error;
use crate::format::convert;
use crate::format::dtype::Dtype;

/// The `_testing` submodule.
pub fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(convert_bytes, &m)?)?;
    m.add_function(wrap_pyfunction!(parse_ring, &m)?)?;
    m.add_function(wrap_pyfunction!(residency, &m)?)?;
    m.add_function(wrap_pyfunction!(set_cgroup_root, &m)?)?;
    m.add_function(wrap_pyfunction!(readahead_bytes, &m)?)?;
    m.add_function(wrap_pyfunction!(super::staging::staging_fills, &m)?)?;
    Ok(m)
}

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
fn convert_bytes<'py>(
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

/// `"4x64MiB"` -> (4, 67108864); ValueError for anything else.
#[pyfunction]
fn parse_ring(text: &str) -> PyResult<(usize, usize)> {
    crate::read::staging::parse_ring(text).ok_or_else(|| {
        PyValueError::new_err(format!("ring {text:?}: expected COUNTxSIZE, e.g. 4x64MiB"))
    })
}

/// Fraction of a file's bytes in the page cache (sampled with mincore), and its filesystem kind.
#[pyfunction]
fn residency(path: PathBuf) -> PyResult<(Option<f64>, &'static str)> {
    let open_err = |source| {
        PyErr::from(Error::Open {
            path: path.clone(),
            source,
        })
    };
    let file = std::fs::File::open(&path).map_err(open_err)?;
    let len = file.metadata().map_err(open_err)?.len();
    Ok((
        crate::read::strategy::cached_fraction(&file, 0, len),
        crate::platform::fs_kind(&file, &path).name(),
    ))
}

/// Read cgroup files under `root` (a fixture tree) instead of `/`.
#[pyfunction]
fn set_cgroup_root(root: PathBuf) {
    crate::read::memory::set_cgroup_root(&root);
}

/// Bytes `handle`'s read-ahead holds for tensors not asked for yet (owned memory, or page cache
/// under mmap).
#[pyfunction]
fn readahead_bytes(handle: &Handle) -> u64 {
    handle.readahead_bytes()
}
