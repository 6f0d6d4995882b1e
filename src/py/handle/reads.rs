//! Tensors from a `Handle`: one whole as `get_tensor` gives it (read-ahead first), a part of one
//! (`tensor[key]`: cut from the read-ahead's bytes, a view of the map, or read), many read
//! together, and the data area straight into caller memory.

use pyo3::prelude::*;

use super::Handle;
use super::slices::covers;
use crate::checkpoint::{Checkpoint, Entry, ReadStats};
use crate::format::dtype::Dtype;
use crate::format::header::TensorInfo;
use crate::format::slice;
use crate::py::bytes::{Bytes, TensorTuple};
use crate::py::dlpack::Destinations;
use crate::py::errors::detached;
use crate::py::stats::Stats;
use crate::read::readahead::Mode;
use crate::read::source::Part;

impl Handle {
    /// Tensor `info` whole, as `get_tensor` gives it: from the read-ahead when it has read it,
    /// else read now (a view of the map under mmap). Starts the read-ahead on first use (parts of
    /// a tensor, in `read_slice`, only use what it already holds).
    pub(super) fn whole(
        &self,
        py: Python<'_>,
        ckpt: &Checkpoint,
        info: &TensorInfo,
    ) -> PyResult<TensorTuple> {
        let index = ckpt.shards[self.shard]
            .header
            .index_of(&info.name)
            .expect("info comes from this header");
        if let Some(ahead) = self.ahead(ckpt, false)
            && ahead.mode() != Mode::Provided
        {
            let taken = detached(py, |poll| ahead.take(index, true, poll))?;
            if let Some(bytes) = taken {
                return Ok((
                    info.name.clone(),
                    info.dtype.code(),
                    info.shape.clone(),
                    Bytes::new(bytes),
                ));
            }
        }
        let (mut out, _) = read_entries(py, ckpt, &[(self.shard, info)], None)?;
        Ok(out.pop().expect("one tensor asked, one read"))
    }

    /// `read_many`: the named tensors (all when None), in file order, read together.
    pub(super) fn read_named(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        dtype: Option<Dtype>,
    ) -> PyResult<Vec<TensorTuple>> {
        let ckpt = self.ckpt()?;
        let entries = ckpt.select_in(self.shard, names.as_deref())?;
        let (out, read) = read_entries(py, &ckpt, &entries, dtype)?;
        // What the read's plan leaves to read ahead (the pages of a map of every tensor), by the
        // handle's read-ahead.
        if read.ahead.is_some()
            && let Some(ahead) = self.ahead(&ckpt, false)
        {
            ahead.want_all();
        }
        Ok(out)
    }

    /// Reads data-area ranges `(dest, offset)` in one plan (see `Handle.read_ranges`).
    pub(super) fn read_data_ranges(
        &self,
        py: Python<'_>,
        ranges: Vec<(Bound<'_, PyAny>, u64)>,
    ) -> PyResult<Stats> {
        let ckpt = self.ckpt()?;
        let (dests, offsets): (Vec<_>, Vec<u64>) = ranges.into_iter().unzip();
        let labels = vec!["<range>"; dests.len()];
        let mut held = Destinations::borrow(&dests, &labels)?;
        let ranges: Vec<(u64, &mut [u8])> = offsets.into_iter().zip(held.slices()).collect();
        let c: &Checkpoint = &ckpt;
        let stats = detached(py, |poll| c.read_ranges(self.shard, ranges, poll))?;
        Ok(Stats::from(stats))
    }

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

/// Reads (or maps) `entries` by the checkpoint's plan; returns their tuples and what the read
/// did.
fn read_entries(
    py: Python<'_>,
    ckpt: &Checkpoint,
    entries: &[Entry<'_>],
    dtype: Option<Dtype>,
) -> PyResult<(Vec<TensorTuple>, ReadStats)> {
    let (buffers, stats) = detached(py, |poll| ckpt.read(entries, dtype, poll))?;
    let tuples = entries
        .iter()
        .zip(buffers)
        .map(|((_, t), (b, d))| (t.name.clone(), d.code(), t.shape.clone(), Bytes::new(b)))
        .collect();
    Ok((tuples, stats))
}
