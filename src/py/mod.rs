//! The Python binding, `safeload._safeload`: a thin layer that converts arguments, releases the
//! GIL around every read, and hands tensor bytes to Python as writable buffers. Framework
//! adaptation (torch, numpy, ...) lives in `python/safeload/`.

mod args;
mod bytes;
mod checkpoint;
mod digest;
mod dlpack;
mod errors;
mod handle;
mod info;
mod options;
mod prefetch;
mod provided;
mod remote;
mod shares;
mod staging;
mod stats;
mod stream;
#[cfg(feature = "testing")]
mod testing;
mod write;

use crate::read::strategy::Backend;
use pyo3::prelude::*;

pub use errors::SafetensorError;

/// Gives memory kept from freed tensors (for the next load's reuse) back to the OS now; returns
/// the bytes released. It also goes back by itself after `SAFELOAD_POOL_IDLE_S` (10 s) idle.
#[pyfunction]
fn release_memory(py: Python<'_>) -> usize {
    py.detach(crate::read::pool::release)
}

/// Bytes of freed tensor memory kept for reuse right now.
#[pyfunction]
fn pooled_bytes() -> usize {
    crate::read::pool::pooled_bytes()
}

/// What bounds the memory loads may take (see `crate::read::memory`), in bytes: `available` (the
/// smallest of the rest), `host`, `container` (the cgroup's or job object's headroom), `user`
/// (`SAFELOAD_MEMORY_LIMIT` less what
/// safeload holds), `held` (safeload's owned memory, pool included), `pooled`, `pool_limit`;
/// None where unknown.
#[pyfunction]
fn memory_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let budget = crate::read::memory::snapshot();
    let info = pyo3::types::PyDict::new(py);
    info.set_item("available", budget.available())?;
    info.set_item("host", budget.host)?;
    info.set_item("container", budget.container)?;
    info.set_item("user", budget.user)?;
    info.set_item("held", crate::read::memory::held())?;
    info.set_item("pooled", crate::read::pool::pooled_bytes())?;
    info.set_item("pool_limit", crate::read::pool::limit())?;
    Ok(info)
}

/// `text` with every URL in it stripped of its user info and secret query values, as every
/// message of the core is ([`crate::redact::redact`]): for the messages Python words itself
/// (the command line's `OK <url>` / `FAIL <url>` lines).
#[pyfunction]
fn redact(text: &str) -> String {
    crate::redact::redact(text).into_owned()
}

/// `patch(backend=)`: forces `backend` on every load from now on (None: no longer), through
/// the one rule that reads a call's backend ([`Backend::requested`]); a name that is not a
/// backend is a `ValueError`.
#[pyfunction]
fn _force_backend(backend: Option<&str>) -> PyResult<()> {
    let forced = match backend {
        None => None,
        Some(name) => Some(Backend::parse(name).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "backend must be one of {} (or None), not {name:?}",
                Backend::NAMES
            ))
        })?),
    };
    Backend::force(forced);
    Ok(())
}

/// The backend forced on every load (`patch(backend=)`, else `$SAFELOAD_PATCH`'s), or None.
#[pyfunction]
fn _forced_backend() -> Option<&'static str> {
    Backend::forced().map(Backend::name)
}

/// The one dtype table: format code -> (torch dtype name, numpy dtype name, whether that name
/// is ml_dtypes' rather than numpy's, bits per element); None where the framework lacks it.
fn dtypes(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let table = pyo3::types::PyDict::new(py);
    for d in crate::format::dtype::Dtype::ALL {
        let n = d.names();
        table.set_item(d.code(), (n.torch, n.numpy, n.ml_dtypes, d.bits()))?;
    }
    Ok(table)
}

#[pymodule]
fn _safeload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SafetensorError", m.py().get_type::<SafetensorError>())?;
    m.add("SliceIndexError", errors::slice_index_error(m.py())?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "DEFAULT_CHUNK_BYTES",
        crate::read::plan::DEFAULT_CHUNK_BYTES,
    )?;
    m.add("DEFAULT_THREADS", crate::read::strategy::default_threads())?;
    m.add("DTYPES", dtypes(m.py())?)?;
    m.add("STAGING_RING_ENV", crate::read::staging::RING_ENV)?;
    m.add("BACKENDS", Backend::ALL.map(|(name, _)| name))?;
    m.add(
        "CONVERTIBLE",
        crate::format::convert::CONVERTIBLE.map(|d| d.code()),
    )?;
    m.add_class::<bytes::Bytes>()?;
    m.add_class::<bytes::Importer>()?;
    m.add_class::<options::OpenOptions>()?;
    m.add_class::<handle::Handle>()?;
    m.add_class::<prefetch::Prefetch>()?;
    m.add_class::<write::TensorSpec>()?;
    m.add_class::<checkpoint::Checkpoint>()?;
    m.add_class::<shares::Share>()?;
    m.add_class::<stats::Stats>()?;
    m.add_class::<info::Info>()?;
    m.add_class::<stream::Stream>()?;
    m.add_function(wrap_pyfunction!(shares::assign_owners, m)?)?;
    m.add_function(wrap_pyfunction!(staging::staging_ring, m)?)?;
    m.add_function(wrap_pyfunction!(staging::staging_plan, m)?)?;
    m.add_class::<staging::Fill>()?;
    m.add_function(wrap_pyfunction!(release_memory, m)?)?;
    m.add_function(wrap_pyfunction!(pooled_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(memory_info, m)?)?;
    m.add_function(wrap_pyfunction!(redact, m)?)?;
    m.add_function(wrap_pyfunction!(_force_backend, m)?)?;
    m.add_function(wrap_pyfunction!(_forced_backend, m)?)?;
    m.add_function(wrap_pyfunction!(digest::hash_files, m)?)?;
    m.add_function(wrap_pyfunction!(digest::known_digest, m)?)?;
    m.add_function(wrap_pyfunction!(digest::read_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(digest::manifest_line, m)?)?;
    m.add_function(wrap_pyfunction!(digest::parse_digest, m)?)?;
    m.add_function(wrap_pyfunction!(digest::checkpoint_files, m)?)?;
    m.add_function(wrap_pyfunction!(write::serialize, m)?)?;
    m.add_function(wrap_pyfunction!(write::serialize_file, m)?)?;
    m.add_function(wrap_pyfunction!(write::serialize_files, m)?)?;
    m.add_class::<write::Writer>()?;
    m.add_function(wrap_pyfunction!(write::deserialize, m)?)?;
    // Test-only helpers: built with cargo feature `testing` (.ci/run's install), not in wheels.
    #[cfg(feature = "testing")]
    m.setattr("_testing", testing::module(m.py())?)?;
    Ok(())
}
