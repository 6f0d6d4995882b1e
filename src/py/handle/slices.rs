//! What a key asks of a tensor (`tensor[key]`): the key's plan, whether it covers the whole
//! tensor, and the tensor made of the part read (`Handle::read_part`, in `reads`, reads it).

use pyo3::prelude::*;

use crate::format::header::TensorInfo;
use crate::format::slice;
use crate::py::args::{parse_bounds, parse_key};
use crate::py::bytes::{Bytes, Importer};
use crate::read::source::Part;

/// What `Handle.read_slice` returns for `part` (`plan` of tensor `info`, asked as `key`): the
/// tensor `importer` makes (of a map's whole view, its view `[key]`: nothing copied), else
/// `(dtype, shape, bytes)`.
pub(super) fn part_made(
    py: Python<'_>,
    part: Part,
    info: &TensorInfo,
    plan: &slice::SlicePlan,
    key: &Bound<'_, PyAny>,
    importer: Option<&Importer>,
) -> PyResult<Py<PyAny>> {
    let code = info.dtype.code();
    let bytes = match part {
        Part::Bytes(bytes) => bytes,
        Part::Whole(whole) => {
            let tensor = match importer {
                Some(importer) => {
                    importer.import(py, &Bytes::new(whole.clone()), code, &info.shape)?
                }
                None => None,
            };
            match tensor {
                Some(tensor) => return Ok(tensor.get_item(key)?.unbind()),
                None => crate::read::buffer::cut(plan, &whole)?,
            }
        }
    };
    let bytes = Bytes::new(bytes);
    if let Some(importer) = importer
        && let Some(tensor) = importer.import(py, &bytes, code, &plan.shape)?
    {
        return Ok(tensor.unbind());
    }
    let tuple = (code, plan.shape.clone(), bytes);
    Ok(tuple.into_pyobject(py)?.into_any().unbind())
}

/// The slice plan of `tensor[key]` (see `Handle.read_slice`).
pub(super) fn slice_plan(
    info: &TensorInfo,
    key: &Bound<'_, PyAny>,
    bounds: &str,
) -> PyResult<slice::SlicePlan> {
    let indices = parse_key(key, info.shape.len())?;
    slice::plan(info.dtype, &info.shape, &indices, parse_bounds(bounds)?).map_err(PyErr::from)
}

/// Whether a slice plan takes the whole tensor (`[...]`, `[:]`, ranges covering every dimension).
pub(super) fn covers(plan: &slice::SlicePlan, info: &TensorInfo) -> bool {
    plan.shape == info.shape && plan.nbytes == info.nbytes()
}
