//! DLPack, both ways: the ABI (dlpack.h's unversioned `DLManagedTensor`, which every consumer
//! accepts; `bytes.rs` exports tensor bytes with it), and memory the caller hands over to be read
//! into (`obj.__dlpack__()`, or a capsule exported already): CPU or pinned host tensors and
//! arrays, contiguous. Python never names an address: the capsule describes the memory and keeps
//! it alive while it is held here.

use std::ffi::{CStr, c_void};

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::format::dtype::Dtype;

pub(super) const CAPSULE_NAME: &CStr = c"dltensor";
/// kDLCPU.
pub(super) const DL_CPU: i32 = 1;
/// kDLCUDAHost: pinned host memory.
const DL_CUDA_HOST: i32 = 3;

#[repr(C)]
pub(super) struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
pub(super) struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub(super) struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub(super) struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// One destination: the capsule that keeps it alive, and what it describes.
struct Held<'py> {
    _capsule: Bound<'py, PyAny>,
    ptr: *mut u8,
    len: usize,
    dtype: Option<Dtype>,
}

/// Destinations borrowed from Python objects for one read, checked to be host memory,
/// contiguous and pairwise disjoint, so handing out `&mut [u8]` for each is sound.
pub struct Destinations<'py> {
    held: Vec<Held<'py>>,
}

impl<'py> Destinations<'py> {
    /// Takes `__dlpack__()` of every object (an unconsumed DLPack capsule is taken as it is);
    /// `names` label errors.
    pub fn borrow(objects: &[Bound<'py, PyAny>], names: &[&str]) -> PyResult<Self> {
        let held = objects
            .iter()
            .zip(names)
            .map(|(obj, name)| hold(obj, name))
            .collect::<PyResult<Vec<_>>>()?;
        if let Some(&(a, b)) = overlapping(&held).first() {
            return Err(PyValueError::new_err(format!(
                "destinations of {} and {} share memory",
                names[a], names[b]
            )));
        }
        Ok(Destinations { held })
    }

    /// [`Destinations::borrow`] of the objects that can be read into, the others left out: no
    /// DLPack export, not host memory, not contiguous, or sharing memory with another object
    /// (tied weights, views of one buffer). Returns them and each one's index in `objects`.
    pub fn borrow_eligible(objects: &[Bound<'py, PyAny>]) -> (Self, Vec<usize>) {
        let (mut kept, mut held) = (Vec::new(), Vec::new());
        for (i, obj) in objects.iter().enumerate() {
            if let Ok(h) = hold(obj, "") {
                kept.push(i);
                held.push(h);
            }
        }
        let shared: std::collections::HashSet<usize> = overlapping(&held)
            .into_iter()
            .flat_map(|(a, b)| [a, b])
            .collect();
        let (mut out, mut index) = (Vec::new(), Vec::new());
        for (j, h) in held.into_iter().enumerate() {
            if !shared.contains(&j) {
                out.push(h);
                index.push(kept[j]);
            }
        }
        (Destinations { held: out }, index)
    }

    /// Every destination as memory that outlives this borrow: (capsule, first byte, length).
    /// The capsule keeps the memory alive; whoever holds it must not let anything else touch
    /// the bytes while they are read into.
    pub fn into_owned(self) -> Vec<(Py<PyAny>, *mut u8, usize)> {
        self.held
            .into_iter()
            .map(|h| (h._capsule.unbind(), h.ptr, h.len))
            .collect()
    }

    /// The dtype of each destination (None: an element type the format does not have).
    pub fn dtypes(&self) -> Vec<Option<Dtype>> {
        self.held.iter().map(|h| h.dtype).collect()
    }

    /// Every destination's bytes, borrowed for as long as `self` is.
    pub fn slices(&mut self) -> Vec<&mut [u8]> {
        self.held
            .iter_mut()
            .map(|h| {
                if h.len == 0 {
                    return &mut [][..];
                }
                // SAFETY: the capsule (held in `h`, alive as long as `self`) describes `len`
                // bytes of host memory at `ptr` that its producer keeps alive; `borrow` checked
                // the spans are pairwise disjoint, and `&mut self` makes these the only borrows
                // made here. The caller must not touch the objects from other threads meanwhile
                // (the documented contract of reading into a caller's tensors).
                unsafe { std::slice::from_raw_parts_mut(h.ptr, h.len) }
            })
            .collect()
    }
}

/// Every pair (by index) of destinations whose bytes overlap: spans sorted by start, each
/// checked against the furthest end so far.
fn overlapping(held: &[Held<'_>]) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize, usize)> = held
        .iter()
        .enumerate()
        .filter(|(_, h)| h.len > 0)
        .map(|(i, h)| (h.ptr as usize, h.ptr as usize + h.len, i))
        .collect();
    spans.sort_unstable();
    let mut pairs = Vec::new();
    let mut reach: Option<(usize, usize)> = None; // (furthest end, whose)
    for (start, end, i) in spans {
        if let Some((far, j)) = reach {
            if start < far {
                pairs.push((j, i));
            }
            if end <= far {
                continue;
            }
        }
        reach = Some((end, i));
    }
    pairs
}

/// Whether `obj` is an unconsumed DLPack capsule.
fn is_dltensor(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: PyCapsule_IsValid accepts any object pointer.
    unsafe { ffi::PyCapsule_IsValid(obj.as_ptr(), CAPSULE_NAME.as_ptr()) == 1 }
}

fn hold<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Held<'py>> {
    let bad =
        |why: &str| PyValueError::new_err(format!("cannot read tensor {name} into it: {why}"));
    // A capsule exported already (torch's `to_dlpack`: torch's Python `__dlpack__` costs 2.6 us
    // of checks a tensor), else the object's own export.
    let capsule = if is_dltensor(obj) {
        obj.clone()
    } else {
        obj.call_method0("__dlpack__")
            .map_err(|e| bad(&format!("no DLPack export ({e})")))?
    };
    if !is_dltensor(&capsule) {
        return Err(bad("__dlpack__ did not return a \"dltensor\" capsule"));
    }
    // SAFETY: a valid "dltensor" capsule holds a DLManagedTensor, whose first member is the
    // DLTensor; the capsule (kept in `Held`) keeps it alive, and we never consume it, so its own
    // destructor releases it later.
    let t = unsafe {
        &*(ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) as *const DLTensor)
    };
    if ![DL_CPU, DL_CUDA_HOST].contains(&t.device.device_type) {
        return Err(bad(
            "not host memory (move it to the CPU, or load to the device)",
        ));
    }
    if t.dtype.lanes != 1 || t.dtype.bits % 8 != 0 {
        return Err(bad("vector or sub-byte element type"));
    }
    let ndim = usize::try_from(t.ndim).map_err(|_| bad("negative ndim"))?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: DLPack gives `ndim` shape entries.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let item = (t.dtype.bits / 8) as usize;
    let mut len = item;
    for &d in shape {
        let d = usize::try_from(d).map_err(|_| bad("negative dimension"))?;
        len = len.checked_mul(d).ok_or_else(|| bad("size overflows"))?;
    }
    if !t.strides.is_null() && len > 0 {
        // SAFETY: DLPack gives `ndim` stride entries when `strides` is not null.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expect = 1i64;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            if d != 1 && s != expect {
                return Err(bad("not contiguous"));
            }
            expect *= d;
        }
    }
    let ptr = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
    if ptr.is_null() && len > 0 {
        return Err(bad("null data pointer"));
    }
    Ok(Held {
        _capsule: capsule,
        ptr,
        len,
        dtype: Dtype::from_dlpack(t.dtype.code, t.dtype.bits),
    })
}
