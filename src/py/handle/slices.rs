//! Parts of a tensor from a `Handle` (`tensor[key]`): the key's plan, whether it covers the
//! whole tensor, and the part: cut from the read-ahead's bytes, a view of the map, or read.

use pyo3::prelude::*;

use super::Handle;
use crate::checkpoint::Checkpoint;
use crate::format::header::TensorInfo;
use crate::format::slice;
use crate::py::args::{parse_bounds, parse_key};
use crate::py::bytes::{Bytes, Importer};
use crate::py::errors::detached;
use crate::read::readahead::Mode;
use crate::read::source::Part;

impl Handle {
    /// `read_slice`: `plan` of tensor `info`, by the plan for parts: only the needed byte
    /// ranges read, or the map's view (`views`: see `Checkpoint::read_slice`). A slice never
    /// starts the read-ahead (a caller reading by slices, a tensor-parallel rank, asks for
    /// exactly what it needs, whole tensors `[...]` included); one the read-ahead already holds
    /// is cut from its bytes.
    pub(super) fn read_part(
        &self,
        py: Python<'_>,
        ckpt: &Checkpoint,
        info: &TensorInfo,
        plan: &slice::SlicePlan,
        views: bool,
    ) -> PyResult<Part> {
        let held = match self.ahead.get() {
            Some(Some(ahead)) if matches!(ahead.mode(), Mode::Owned(_)) => {
                let index = ckpt.shards[self.shard]
                    .header
                    .index_of(&info.name)
                    .expect("info comes from this header");
                detached(py, |poll| ahead.take(index, false, poll))?
            }
            _ => None,
        };
        Ok(match held {
            Some(whole) if covers(plan, info) => Part::Bytes(whole),
            Some(whole) => Part::Bytes(crate::read::buffer::cut(plan, &whole)?),
            None => {
                detached(py, |poll| {
                    ckpt.read_slice(self.shard, info, plan, views, poll)
                })?
                .0
            }
        })
    }
}

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
