//! Tensor bytes as a Python object that frameworks wrap without a copy, through calls of the
//! stable ABI (the module is built `abi3-py39`, where the buffer protocol is not available):
//!
//! - DLPack: [`Bytes::dlpack`] returns a `"dltensor"` capsule of the tensor's dtype and shape
//!   (what `torch.from_dlpack` takes in one call); `__dlpack__` / `__dlpack_device__` give the
//!   bytes as a 1-D `uint8` tensor to any DLPack consumer. The capsule's tensor holds its own
//!   reference to the bytes: the consumer frees it through the deleter, from any thread.
//! - `__array_struct__` (what numpy reads first; `__array_interface__` says the same as a dict):
//!   a 1-D writable `uint8` array, which keeps this object alive as its base.
//! - `__bytes__`: a copy.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use pyo3::exceptions::{PyBufferError, PyMemoryError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::read::buffer::{Region, TensorBytes};

#[pyclass(frozen, module = "safeload._safeload")]
pub struct Bytes {
    inner: TensorBytes,
}

/// (name, dtype code, shape, bytes): what Python turns into a tensor.
pub(super) type TensorTuple = (String, &'static str, Vec<usize>, Bytes);

impl Bytes {
    pub fn new(inner: TensorBytes) -> Self {
        Bytes { inner }
    }
}

use super::dlpack::{CAPSULE_NAME, DL_CPU, DLDataType, DLDevice, DLManagedTensor, DLTensor};

/// What a capsule owns: the DLPack struct (first, so the two pointers are one), its shape and
/// strides, and a reference to the bytes.
#[repr(C)]
struct Managed {
    tensor: DLManagedTensor,
    dims: Vec<i64>,
    _bytes: TensorBytes,
}

/// The DLPack type of a format code whose elements DLPack describes exactly: (code, bits).
/// Others (fp8, packed fp4) go through `U8` and a view in the framework.
fn dl_type(code: &str) -> Option<(u8, u8)> {
    crate::format::dtype::Dtype::from_code(code).and_then(|d| d.names().dlpack)
}

/// The DLPack deleter: drops what [`capsule`] boxed. Called once, by the consumer (any thread,
/// GIL or not: it only drops Rust memory) or by the capsule if never consumed.
unsafe extern "C" fn delete_managed(tensor: *mut DLManagedTensor) {
    if !tensor.is_null() {
        // SAFETY: `tensor` is the first field of a `Managed` boxed by `capsule`, and DLPack
        // consumers call the deleter exactly once.
        drop(unsafe { Box::from_raw(tensor.cast::<Managed>()) });
    }
}

/// The capsule's destructor: frees the tensor unless a consumer took it (and renamed the
/// capsule to "used_dltensor").
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython passes the capsule being destroyed; IsValid sets no error.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) == 1 {
            let tensor = ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr());
            delete_managed(tensor.cast());
        }
    }
}

/// A `"dltensor"` capsule over `bytes` as a C-contiguous tensor of `shape` elements of
/// `(code, bits)`.
fn capsule<'py>(
    py: Python<'py>,
    bytes: &TensorBytes,
    (code, bits): (u8, u8),
    shape: &[i64],
) -> PyResult<Bound<'py, PyAny>> {
    let ndim = shape.len();
    // shape then C-contiguous strides, in elements.
    let mut dims = Vec::with_capacity(2 * ndim);
    dims.extend_from_slice(shape);
    let mut stride = 1i64;
    dims.resize(2 * ndim, 0);
    for i in (0..ndim).rev() {
        dims[ndim + i] = stride;
        stride = stride.saturating_mul(shape[i]);
    }
    let mut managed = Box::new(Managed {
        tensor: DLManagedTensor {
            dl_tensor: DLTensor {
                data: bytes.as_mut_ptr().cast(),
                device: DLDevice {
                    device_type: DL_CPU,
                    device_id: 0,
                },
                ndim: ndim as i32,
                dtype: DLDataType {
                    code,
                    bits,
                    lanes: 1,
                },
                shape: ptr::null_mut(),
                strides: ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: ptr::null_mut(),
            deleter: Some(delete_managed),
        },
        dims,
        _bytes: bytes.clone(),
    });
    let dims = managed.dims.as_mut_ptr();
    managed.tensor.dl_tensor.shape = dims;
    // SAFETY: `dims` holds 2 * ndim values; the strides are the second half.
    managed.tensor.dl_tensor.strides = unsafe { dims.add(ndim) };
    let raw = Box::into_raw(managed);
    // SAFETY: `raw` is live and exclusively ours until the capsule takes it.
    unsafe { (*raw).tensor.manager_ctx = raw.cast() };
    // SAFETY: a valid pointer and a static name; on failure the capsule does not exist, so the
    // box is still ours to free.
    unsafe {
        let cap = ffi::PyCapsule_New(raw.cast(), CAPSULE_NAME.as_ptr(), Some(drop_capsule));
        if cap.is_null() {
            delete_managed(raw.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap))
    }
}

/// A framework's DLPack import (`torch._C._from_dlpack`) and the dtypes it makes exactly (the
/// caller probes them once, with [`Bytes::zeroed`]): tensors made in Rust, one call each, with
/// no tuple, shape list, `Bytes` object or Python frame per tensor. For thousands of small
/// tensors that is what a load's Python side costs, and fewer objects mean fewer runs of
/// Python's cyclic collector.
#[pyclass(frozen, module = "safeload._safeload")]
pub struct Importer {
    call: Py<PyAny>,
    /// The dtypes it makes, with their DLPack types (found here once, not per tensor).
    codes: Vec<(&'static str, (u8, u8))>,
}

#[pymethods]
impl Importer {
    #[new]
    fn new(call: Py<PyAny>, codes: Vec<String>) -> PyResult<Self> {
        let mut known = Vec::with_capacity(codes.len());
        for c in &codes {
            let dtype = crate::format::dtype::Dtype::from_code(c)
                .ok_or_else(|| PyValueError::new_err(format!("unknown dtype code {c}")))?;
            // A dtype DLPack cannot describe (F4, F6) is never handed to the import.
            if let Some(ty) = dtype.names().dlpack {
                known.push((dtype.code(), ty));
            }
        }
        Ok(Importer { call, codes: known })
    }
}

impl Importer {
    /// `bytes` as the framework's tensor of dtype `code` and `shape`; None for an empty tensor
    /// or a dtype the import does not make exactly (the caller converts those its own way).
    pub(super) fn import<'py>(
        &self,
        py: Python<'py>,
        bytes: &Bytes,
        code: &str,
        shape: &[usize],
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(&(_, ty)) = self.codes.iter().find(|(c, _)| *c == code) else {
            return Ok(None);
        };
        if bytes.inner.is_empty() {
            return Ok(None);
        }
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let capsule = capsule(py, &bytes.inner, ty, &dims)?;
        self.call.bind(py).call1((capsule,)).map(Some)
    }

    /// One tensor's bytes as the tensor `importer` makes of them where it makes that dtype, else
    /// as `convert(name, dtype code, shape, bytes)`, else as that tuple.
    pub(super) fn made(
        py: Python<'_>,
        importer: Option<&Importer>,
        convert: Option<&Bound<'_, PyAny>>,
        (name, code, shape, bytes): TensorTuple,
    ) -> PyResult<Py<PyAny>> {
        if let Some(importer) = importer
            && let Some(tensor) = importer.import(py, &bytes, code, &shape)?
        {
            return Ok(tensor.unbind());
        }
        let tuple = (name, code, shape, bytes);
        match convert {
            Some(convert) => Ok(convert.call1(tuple)?.unbind()),
            None => Ok(tuple.into_pyobject(py)?.into_any().unbind()),
        }
    }

    /// `{name: tensor}` in the order of `items`; a tensor [`Importer::import`] leaves maps to its
    /// `(code, shape, bytes)`, and its name is returned, in order, for the caller to convert.
    pub(super) fn import_all<'py>(
        &self,
        py: Python<'py>,
        items: Vec<TensorTuple>,
    ) -> PyResult<(Bound<'py, PyDict>, Vec<String>)> {
        let out = PyDict::new(py);
        let mut rest = Vec::new();
        for (name, code, shape, bytes) in items {
            match self.import(py, &bytes, code, &shape)? {
                Some(tensor) => out.set_item(name, tensor)?,
                None => {
                    out.set_item(&name, (code, shape, bytes))?;
                    rest.push(name);
                }
            }
        }
        Ok((out, rest))
    }
}

/// numpy's `PyArrayInterface` (the `__array_struct__` capsule's struct), with room for the one
/// dimension and stride it points to.
#[repr(C)]
struct ArrayStruct {
    two: c_int,
    nd: c_int,
    typekind: c_char,
    itemsize: c_int,
    flags: c_int,
    shape: *mut isize,
    strides: *mut isize,
    data: *mut c_void,
    descr: *mut ffi::PyObject,
    dims: [isize; 2],
}

// numpy's NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS | NPY_ARRAY_ALIGNED |
// NPY_ARRAY_NOTSWAPPED | NPY_ARRAY_WRITEABLE.
const ARRAY_FLAGS: c_int = 0x1 | 0x2 | 0x100 | 0x200 | 0x400;

unsafe extern "C" fn drop_array_struct(capsule: *mut ffi::PyObject) {
    // SAFETY: the capsule made by `__array_struct__`, nameless, holding a boxed ArrayStruct.
    unsafe {
        let p = ffi::PyCapsule_GetPointer(capsule, ptr::null());
        if !p.is_null() {
            drop(Box::from_raw(p.cast::<ArrayStruct>()));
        }
    }
}

#[pymethods]
impl Bytes {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Byte-for-byte equality with other tensor bytes (`safeload verify`'s pread/mmap check).
    fn __eq__(&self, other: &Bytes) -> bool {
        self.inner.as_slice() == other.inner.as_slice()
    }

    /// `len` zero bytes of their own: what a framework's DLPack import is probed with, once per
    /// dtype, before an [`Importer`] is handed capsules of that dtype.
    #[staticmethod]
    fn zeroed(len: usize) -> PyResult<Self> {
        let region = Region::alloc(len).map_err(|e| PyMemoryError::new_err(e.to_string()))?;
        Ok(Bytes::new(TensorBytes::new(
            std::sync::Arc::new(region),
            0,
            len,
        )))
    }

    /// A DLPack capsule of the bytes as a C-contiguous tensor of format dtype `code` (one DLPack
    /// describes exactly: not F4 / F6; fp8 for consumers that know DLPack 1.1's codes) and
    /// `shape`, which must cover the bytes exactly.
    fn dlpack<'py>(
        &self,
        py: Python<'py>,
        code: &str,
        shape: Vec<i64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ty = dl_type(code)
            .ok_or_else(|| PyValueError::new_err(format!("no DLPack type for dtype {code}")))?;
        let elements = shape.iter().try_fold(1u64, |n, &d| {
            u64::try_from(d).ok().and_then(|d| n.checked_mul(d))
        });
        if elements.and_then(|n| n.checked_mul(u64::from(ty.1 / 8)))
            != Some(self.inner.len() as u64)
        {
            return Err(PyValueError::new_err(format!(
                "shape {shape:?} of {code} does not cover {} bytes",
                self.inner.len()
            )));
        }
        capsule(py, &self.inner, ty, &shape)
    }

    /// The DLPack protocol: the bytes as a 1-D uint8 CPU tensor (an unversioned capsule, which
    /// consumers asking for `max_version` accept).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version);
        if dl_device.is_some_and(|d| d != (DL_CPU, 0)) {
            return Err(PyBufferError::new_err("safeload bytes are on the CPU"));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "safeload bytes are exported without a copy",
            ));
        }
        capsule(py, &self.inner, (1, 8), &[self.inner.len() as i64]) // kDLUInt, 8 bits
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    /// numpy's array struct: a writable 1-D uint8 array over the bytes (numpy copies the struct
    /// and keeps this object as the array's base; the capsule frees the struct).
    #[getter]
    fn __array_struct__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut s = Box::new(ArrayStruct {
            two: 2,
            nd: 1,
            typekind: b'u' as c_char,
            itemsize: 1,
            flags: ARRAY_FLAGS,
            shape: ptr::null_mut(),
            strides: ptr::null_mut(),
            data: self.inner.as_mut_ptr().cast(),
            descr: ptr::null_mut(),
            dims: [self.inner.len() as isize, 1],
        });
        s.shape = s.dims.as_mut_ptr();
        // SAFETY: `dims` has two entries.
        s.strides = unsafe { s.dims.as_mut_ptr().add(1) };
        let raw = Box::into_raw(s);
        // SAFETY: a valid pointer, no name; on failure the box is still ours.
        unsafe {
            let cap = ffi::PyCapsule_New(raw.cast(), ptr::null(), Some(drop_array_struct));
            if cap.is_null() {
                drop(Box::from_raw(raw));
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, cap))
        }
    }

    /// numpy's array interface, as a dict: a writable 1-D uint8 array over the bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.inner.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.inner.as_mut_ptr() as usize, false))?;
        Ok(d)
    }

    /// A copy of the bytes.
    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_slice())
    }
}
