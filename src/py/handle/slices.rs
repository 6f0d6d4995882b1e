//! Parts of a tensor from a `Handle` (`tensor[key]`): the key's plan, whether it covers the
//! whole tensor, and the bytes cut from the read-ahead's, from the map, or read.

use pyo3::prelude::*;

use super::Handle;
use crate::checkpoint::Checkpoint;
use crate::format::header::TensorInfo;
use crate::format::slice;
use crate::py::args::{parse_bounds, parse_key};
use crate::py::bytes::Bytes;
use crate::py::errors::detached;
use crate::read::readahead::Mode;

impl Handle {
    /// `read_slice`: (dtype, shape, bytes) of `plan` in tensor `info`, only the needed byte
    /// ranges read.
    pub(super) fn read_part(
        &self,
        py: Python<'_>,
        ckpt: &Checkpoint,
        info: &TensorInfo,
        plan: slice::SlicePlan,
    ) -> PyResult<(&'static str, Vec<usize>, Bytes)> {
        if covers(&plan, info) {
            // The whole tensor (`[...]`, `[:]`): what get_tensor gives, a view of the map
            // under mmap (zero copy, as safetensors' default), the read-ahead's bytes otherwise.
            let (_, code, shape, bytes) = self.whole(py, ckpt, info)?;
            return Ok((code, shape, bytes));
        }
        // Part of a tensor the read-ahead already holds: cut from its bytes.
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
        let bytes = match held {
            Some(whole) => crate::read::buffer::cut(&plan, &whole)?,
            None => detached(py, |poll| ckpt.read_slice(self.shard, info, &plan, poll))?.0,
        };
        Ok((info.dtype.code(), plan.shape, Bytes::new(bytes)))
    }
}

/// Whether a slice plan takes the whole tensor (`[...]`, `[:]`, ranges covering every dimension).
pub(super) fn slice_plan(
    info: &TensorInfo,
    key: &Bound<'_, PyAny>,
    bounds: &str,
) -> PyResult<slice::SlicePlan> {
    let indices = parse_key(key, info.shape.len())?;
    slice::plan(info.dtype, &info.shape, &indices, parse_bounds(bounds)?).map_err(PyErr::from)
}

pub(super) fn covers(plan: &slice::SlicePlan, info: &TensorInfo) -> bool {
    plan.shape == info.shape && plan.nbytes == info.nbytes()
}
