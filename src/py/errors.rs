//! The single conversion from the core's [`Error`] to Python exceptions (`impl From<Error> for
//! PyErr`), the exception classes it raises, and [`detached`] (reads with the GIL released).

use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyIndexError, PyIsADirectoryError, PyMemoryError, PyOSError,
    PyPermissionError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::Error;

pyo3::create_exception!(
    safeload._safeload,
    SafetensorError,
    PyException,
    "Raised for any file safeload cannot read or write as the format requires."
);

static SLICE_INDEX_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `SliceIndexError(SafetensorError, IndexError)`: an index out of range in
/// `get_slice(name)[...]` under torch's bounds ([`Error::SliceIndex`]), which `except
/// SafetensorError` (0.8's `backend="pread"`) and `except IndexError` (torch indexing, 0.8's
/// default mmap) both catch. Made at import: `create_exception!` takes one base.
pub fn slice_index_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    SLICE_INDEX_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<SafetensorError>(),
                    py.get_type::<PyIndexError>(),
                ],
            )?;
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "safeload._safeload")?;
            namespace.set_item(
                "__doc__",
                "An index out of range in get_slice(name)[...] with framework=\"pt\": a \
                 SafetensorError with 0.8's backend=\"pread\" message that is also the IndexError \
                 torch indexing (0.8's default, mmap) raises.",
            )?;
            let class = py
                .get_type::<PyType>()
                .call1(("SliceIndexError", bases, namespace))?;
            Ok(class.cast_into::<PyType>()?.unbind())
        })
        .map(|class| class.bind(py))
}

/// The one conversion: each error kind to the exception Python users expect for it, the
/// message as the core words it (0.8's where 0.8 has one). `?` applies it in the binding.
impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        to_py(err)
    }
}

fn to_py(err: Error) -> PyErr {
    if let Error::SliceIndex(message) = err {
        return Python::attach(|py| match slice_index_error(py) {
            Ok(class) => PyErr::from_type(class.clone(), message),
            Err(e) => e,
        });
    }
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

/// Runs `f` with the GIL released, giving it a `poll` that checks for Ctrl-C (also installed for
/// the waits `f` blocks in on this thread: [`crate::storage::cancel`]). A pending signal's exception
/// (KeyboardInterrupt) is what the caller gets back if it arrived during the call, whatever `f`
/// made of the stop (a cancelled read, a request cut off); a panic in `f` (or a worker it joined)
/// is a `SafetensorError`.
pub fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce(&mut dyn FnMut() -> bool) -> crate::error::Result<T> + Send,
) -> PyResult<T> {
    let result = py.detach(|| {
        crate::storage::cancel::with_poll(signalled, || {
            let mut poll = signalled;
            crate::error::catch_panic("a read", || f(&mut poll))
        })
    });
    match (result, PENDING.with(|p| p.take())) {
        (_, Some(signal)) => Err(signal),
        (Ok(value), None) => Ok(value),
        (Err(e), None) => Err(e.into()),
    }
}

thread_local! {
    /// The exception a signal handler raised during [`detached`]'s call on this thread.
    static PENDING: std::cell::Cell<Option<PyErr>> = const { std::cell::Cell::new(None) };
}

/// Runs Python's signal handlers (with the GIL, briefly); true when one raised (Ctrl-C), its
/// exception kept for [`detached`] to raise.
fn signalled() -> bool {
    match Python::attach(|py| py.check_signals()) {
        Ok(()) => false,
        Err(e) => {
            PENDING.with(|p| p.set(Some(e)));
            true
        }
    }
}
