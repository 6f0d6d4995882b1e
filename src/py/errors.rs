//! The single conversion from the core's [`Error`] to Python exceptions.

use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyIsADirectoryError, PyMemoryError, PyOSError,
    PyPermissionError,
};
use pyo3::prelude::*;

use crate::error::Error;

pyo3::create_exception!(
    safeload._safeload,
    SafetensorError,
    PyException,
    "Raised for any file safeload cannot read or write as the format requires."
);

pub fn to_py(err: Error) -> PyErr {
    let message = err.to_string();
    match err.io_kind() {
        Some(std::io::ErrorKind::NotFound) => PyFileNotFoundError::new_err(message),
        Some(std::io::ErrorKind::PermissionDenied) => PyPermissionError::new_err(message),
        Some(std::io::ErrorKind::IsADirectory) => PyIsADirectoryError::new_err(message),
        Some(_) if matches!(err, Error::Open { .. }) => PyOSError::new_err(message),
        _ if matches!(err, Error::Memory(_)) => PyMemoryError::new_err(message),
        _ => SafetensorError::new_err(message),
    }
}

/// Runs `f` with the GIL released, giving it a `poll` that checks for Ctrl-C. A pending signal's
/// exception (KeyboardInterrupt) is what the caller gets back if the read was cancelled.
pub fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce(&mut dyn FnMut() -> bool) -> crate::error::Result<T> + Send,
) -> PyResult<T> {
    let mut signal: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut poll = || match Python::attach(|py| py.check_signals()) {
            Ok(()) => false,
            Err(e) => {
                signal = Some(e);
                true
            }
        };
        f(&mut poll)
    });
    match (result, signal) {
        (Ok(value), None) => Ok(value),
        (Ok(_), Some(e)) => Err(e),
        (Err(Error::Cancelled), Some(e)) => Err(e),
        (Err(e), _) => Err(to_py(e)),
    }
}
