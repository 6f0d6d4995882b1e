//! Destinations Python provides for the read-ahead ([`Mode::Provided`](crate::read::readahead::Mode)):
//! device memory the host can write (an MPS tensor's CPU alias) or pinned staging memory, made by
//! a Python `allocate` callable on the calling thread, read into by the Rust workers.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::dlpack::Destinations;
use crate::format::header::TensorInfo;
use crate::read::buffer::{Fresh, TensorBytes};
use crate::read::readahead::ReadAhead;

/// What keeps a provided destination alive: the tensor handed back once it is read, and the
/// DLPack capsule of its host-writable view.
struct Provided {
    tensor: Py<PyAny>,
    _capsule: Py<PyAny>,
}

/// Gives `ahead` the destinations it needs now for a request of item `index`: `allocate(items)`
/// gets (name, dtype code, shape, bytes) of each and returns one (tensor, host view) pair per
/// item, the view a contiguous host tensor of exactly that many bytes exporting DLPack, or None
/// when it cannot (those items are then not read ahead). Whatever happens, the items named go
/// back to the read-ahead.
pub(super) fn provide(
    py: Python<'_>,
    ahead: &ReadAhead,
    index: usize,
    allocate: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let wanted = ahead.wanted(index);
    if wanted.is_empty() {
        return Ok(());
    }
    let infos: Vec<&TensorInfo> = wanted.iter().map(|&i| &ahead.items()[i]).collect();
    let made = destinations(&infos, allocate);
    let failed = made.as_ref().err().map(|e| e.clone_ref(py));
    let provided = ahead
        .provide(&wanted, made.ok().flatten())
        .map_err(PyErr::from);
    match failed {
        Some(e) => Err(e),
        None => provided,
    }
}

/// The tensor a provided destination was made for, once the read-ahead has read it.
pub(super) fn tensor(py: Python<'_>, bytes: &TensorBytes) -> Option<Py<PyAny>> {
    let keep = bytes.keep()?.downcast_ref::<Provided>()?;
    Some(keep.tensor.clone_ref(py))
}

fn destinations(
    infos: &[&TensorInfo],
    allocate: &Bound<'_, PyAny>,
) -> PyResult<Option<Vec<Fresh>>> {
    let items: Vec<(&str, &'static str, Vec<usize>, usize)> = infos
        .iter()
        .map(|t| (t.name.as_str(), t.dtype.code(), t.shape.clone(), t.nbytes()))
        .collect();
    let made = allocate.call1((items,))?;
    if made.is_none() {
        return Ok(None);
    }
    let pairs: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = made.extract()?;
    if pairs.len() != infos.len() {
        return Err(PyTypeError::new_err(format!(
            "allocate returned {} destinations for {} tensors",
            pairs.len(),
            infos.len()
        )));
    }
    let names: Vec<&str> = infos.iter().map(|t| t.name.as_str()).collect();
    let (results, views): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
    let held = Destinations::borrow(&views, &names)?.into_owned();
    let fresh = results
        .into_iter()
        .zip(held)
        .map(|(tensor, (capsule, ptr, len))| {
            let keep = Provided {
                tensor: tensor.unbind(),
                _capsule: capsule,
            };
            // SAFETY: `capsule` (kept with the bytes) keeps the `len` host-writable bytes at
            // `ptr` alive; `borrow` checked them contiguous and disjoint from the others here;
            // `allocate` made them for this read alone, and the tensor over them is not handed
            // out before they are read (the read-ahead checks each one's size).
            unsafe { Fresh::external(ptr, len, Box::new(keep)) }
        })
        .collect();
    Ok(Some(fresh))
}
