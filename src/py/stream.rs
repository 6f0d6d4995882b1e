//! `Stream`: a checkpoint's tensors in batches, the next one read ahead on a thread of the
//! reader's own (`crate::checkpoint::stream`), for `iter_checkpoint` and progress-reporting loads.

use std::sync::Mutex;

use pyo3::prelude::*;

use super::bytes::{Bytes, TensorTuple};
use super::errors::detached;

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Stream {
    inner: Mutex<Option<crate::checkpoint::stream::Stream>>,
}

impl Stream {
    pub(super) fn new(stream: crate::checkpoint::stream::Stream) -> Stream {
        Stream {
            inner: Mutex::new(Some(stream)),
        }
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// (bytes of the tensors handed over so far, bytes of every tensor), for progress; None
    /// once the stream has ended or closed.
    fn progress(&self) -> Option<(u64, u64)> {
        let guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().map(|s| (s.done(), s.total))
    }

    /// The next batch: a list of (name, dtype code, shape, bytes) in file order, the GIL
    /// released while waiting for it; StopIteration after the last.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Vec<TensorTuple>>> {
        let inner = &self.inner;
        let batch = detached(py, |poll| {
            let guard = inner.lock().unwrap_or_else(|p| p.into_inner());
            match guard.as_ref().map(|s| s.next(poll)) {
                Some(Some(batch)) => batch.map(Some),
                _ => Ok(None),
            }
        });
        match batch {
            Ok(Some(items)) => Ok(Some(
                (items.into_iter())
                    .map(|(name, dtype, shape, bytes)| {
                        (name, dtype.code(), shape, Bytes::new(bytes))
                    })
                    .collect(),
            )),
            Ok(None) => {
                self.close();
                Ok(None)
            }
            Err(e) => {
                self.close();
                Err(e)
            }
        }
    }

    /// Stops the reader and frees the batch it was reading ahead.
    fn close(&self) {
        let stream = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(stream);
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(&self, _exc: Bound<'_, PyAny>, _value: Bound<'_, PyAny>, _tb: Bound<'_, PyAny>) {
        self.close();
    }
}
