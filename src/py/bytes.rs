//! Tensor bytes as a Python object with the buffer protocol: `torch.frombuffer` and
//! `numpy.frombuffer` wrap it without a copy and keep it (and its allocation) alive.

use std::os::raw::c_int;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer::TensorBytes;

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Bytes {
    inner: TensorBytes,
}

impl Bytes {
    pub fn new(inner: TensorBytes) -> Self {
        Bytes { inner }
    }
}

#[pymethods]
impl Bytes {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Address of the first byte (for tests of alignment and ownership).
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_mut_ptr() as usize
    }

    /// # Safety
    /// Called by CPython with a valid `view`.
    unsafe fn __getbuffer__(
        slf: PyRef<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let len = slf.inner.len() as ffi::Py_ssize_t;
        let ptr = slf.inner.as_mut_ptr().cast();
        // SAFETY: `view` comes from CPython; FillInfo takes a new reference to the object, which
        // keeps the bytes alive for as long as the view exists. The memory is private and
        // writable (readonly = 0).
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 0, flags) };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Nothing to release: the reference FillInfo took is dropped by CPython.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
