//! Whole tensors from a `Handle`: one as `get_tensor` gives it (read-ahead first), many read
//! together, and the data area straight into caller memory.

use std::sync::Arc;

use pyo3::prelude::*;

use super::Handle;
use crate::dtype::Dtype;
use crate::error::Error;
use crate::header::TensorInfo;
use crate::py::args::TensorTuple;
use crate::py::bytes::Bytes;
use crate::py::dlpack::Destinations;
use crate::py::errors::detached;
use crate::readahead::Mode;
use crate::source::{self, Source};
use crate::storage::Strategy;

impl Handle {
    /// Tensor `info` whole, as `get_tensor` gives it: from the read-ahead when it has read it,
    /// else read now (a view of the map under mmap). Starts the read-ahead on first use (parts of
    /// a tensor, in `read_slice`, only use what it already holds).
    pub(super) fn whole(
        &self,
        py: Python<'_>,
        source: &Arc<Source>,
        info: &TensorInfo,
    ) -> PyResult<TensorTuple> {
        let index = source
            .header
            .index_of(&info.name)
            .expect("info comes from this header");
        if let Some(ahead) = self.ahead(source, false)
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
        let (mut out, _) = self.read_infos(py, source, vec![info], None)?;
        Ok(out.pop().expect("one tensor asked, one read"))
    }

    /// Reads (or maps) `infos`; returns their tuples and the strategy that ran (a map cannot
    /// convert dtypes, so `Mmap` with a converting `dtype` runs `Pread`).
    fn read_infos(
        &self,
        py: Python<'_>,
        source: &Arc<Source>,
        infos: Vec<&TensorInfo>,
        dtype: Option<Dtype>,
    ) -> PyResult<(Vec<TensorTuple>, Strategy)> {
        let wanted: Vec<(usize, &TensorInfo)> = infos.iter().map(|t| (0, *t)).collect();
        let (opts, strategy) = (self.opts, self.strategy());
        let s: &Source = source;
        let (buffers, report, ran) = detached(py, |poll| {
            source::read_or_map(&[s], &wanted, strategy, dtype, &opts, poll)
        })?;
        if ran != Strategy::Mmap {
            self.record(&report);
        }
        let tuples = infos
            .into_iter()
            .zip(buffers)
            .map(|(t, (b, d))| (t.name.clone(), d.code(), t.shape.clone(), Bytes::new(b)))
            .collect();
        Ok((tuples, ran))
    }

    /// `read_many`: the named tensors (all when None), in file order, read together.
    pub(super) fn read_named(
        &self,
        py: Python<'_>,
        names: Option<Vec<String>>,
        dtype: Option<Dtype>,
    ) -> PyResult<Vec<TensorTuple>> {
        let source = self.source()?;
        let infos: Vec<&TensorInfo> = match &names {
            None => source.header.tensors.iter().collect(),
            Some(names) => {
                let mut infos = names
                    .iter()
                    .map(|n| source.tensor(n))
                    .collect::<Result<Vec<_>, Error>>()?;
                infos.sort_by_key(|t| t.begin);
                infos
            }
        };
        let (out, ran) = self.read_infos(py, &source, infos, dtype)?;
        // Views of a map: its pages are made resident ahead of the caller's touches, in file
        // order (not when the tensors were read into memory, converting).
        if names.is_none()
            && ran == Strategy::Mmap
            && let Some(ahead) = self.ahead(&source, false)
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
    ) -> PyResult<u64> {
        let source = self.source()?;
        let opts = self.opts;
        let s: &Source = &source;
        let (dests, offsets): (Vec<_>, Vec<u64>) = ranges.into_iter().unzip();
        let labels = vec!["<range>"; dests.len()];
        let mut held = Destinations::borrow(&dests, &labels)?;
        let ranges: Vec<(u64, &mut [u8])> = offsets.into_iter().zip(held.slices()).collect();
        let report = detached(py, |poll| source::read_data_ranges(s, ranges, &opts, poll))?;
        self.record(&report);
        Ok(report.bytes)
    }
}
