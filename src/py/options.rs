//! `OpenOptions`: what every open takes (backend, threads, chunk_bytes, drop_cache,
//! storage_options, verify, verify_cache), parsed and checked once, with its defaults here. Every
//! loader in Python builds one and hands it to `Checkpoint` or `Handle`; a new option touches this
//! file (and the Python `Options` type that documents it), not every signature.

use std::path::PathBuf;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{BackendArg, VerifyArg, options, verify_record};
use super::remote::StorageOptions;
use crate::checkpoint::Opening;
use crate::read::source::ReadOptions;
use crate::read::strategy::Backend;

/// The options of one open, as given: a backend (not given: "auto" or `$SAFELOAD_BACKEND`), the
/// reader's tuning, the store's settings, and what to verify (not given: `$SAFELOAD_VERIFY`,
/// `$SAFELOAD_VERIFY_CACHE`, read at open: [`OpenOptions::resolve`]).
#[pyclass(frozen, module = "safeload._safeload")]
pub struct OpenOptions {
    backend: Backend,
    read: ReadOptions,
    store: Vec<(String, String)>,
    verify: Option<VerifyArg>,
    verify_cache: Option<PathBuf>,
}

impl OpenOptions {
    /// The options a `Checkpoint` or `Handle` was given: one `OpenOptions` as it is, else
    /// `OpenOptions(backend=options, **keywords)` (a backend's name, or None, and keywords: what
    /// tests and tools pass), so one constructor parses them either way.
    pub(super) fn given<'py>(
        py: Python<'py>,
        options: Option<&Bound<'py, PyAny>>,
        keywords: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, OpenOptions>> {
        let keywords = keywords.filter(|k| !k.is_empty());
        if let Some(given) = options.and_then(|o| o.cast::<OpenOptions>().ok()) {
            return match keywords {
                None => Ok(given.clone()),
                Some(_) => Err(PyTypeError::new_err(
                    "options are given as one OpenOptions or as keywords, not both",
                )),
            };
        }
        let all = match keywords {
            Some(k) => k.copy()?,
            None => PyDict::new(py),
        };
        if let Some(backend) = options.filter(|o| !o.is_none()) {
            if all.contains("backend")? {
                return Err(PyTypeError::new_err(
                    "got multiple values for argument 'backend'",
                ));
            }
            all.set_item("backend", backend)?;
        }
        Ok(py
            .get_type::<OpenOptions>()
            .call((), Some(&all))?
            .cast_into::<OpenOptions>()?)
    }

    /// What an open uses: `verify` (not given: `$SAFELOAD_VERIFY`), the backend it leaves (see
    /// [`VerifyArg::pin`]) and the verified record (`verify_cache`, else
    /// `$SAFELOAD_VERIFY_CACHE`), read now, as each open reads them.
    pub(super) fn resolve(&self) -> PyResult<Opening> {
        let (pin, backend) = VerifyArg::pin(self.verify.clone(), self.backend)?;
        let record = verify_record(self.verify_cache.clone(), pin.as_ref())?;
        Ok(Opening {
            backend,
            read: self.read,
            store: self.store.clone(),
            pin,
            record,
        })
    }
}

#[pymethods]
impl OpenOptions {
    /// Every argument is checked here, with the message it had as a loader's argument; what is
    /// not given is the reader's default.
    #[new]
    #[pyo3(signature = (*, backend=None, threads=None, chunk_bytes=None, drop_cache=false, storage_options=None, verify=None, verify_cache=None))]
    fn new(
        backend: Option<BackendArg>,
        threads: Option<usize>,
        chunk_bytes: Option<usize>,
        drop_cache: bool,
        storage_options: Option<StorageOptions>,
        verify: Option<VerifyArg>,
        verify_cache: Option<PathBuf>,
    ) -> PyResult<Self> {
        Ok(OpenOptions {
            backend: BackendArg::or_default(backend)?,
            read: options(threads, chunk_bytes, drop_cache),
            store: storage_options.unwrap_or_default().0,
            verify,
            verify_cache,
        })
    }

    /// The backend asked for, after the process's overrides (`Backend::requested`: a forced
    /// backend, `$SAFELOAD_BACKEND`; "auto" when none was), before a `verify` from the
    /// environment turns "mmap" into "auto" at open.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend.name()
    }
}
