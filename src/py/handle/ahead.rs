//! A `Handle`'s read-ahead: made at the first read that wants it, tensors taken into
//! destinations the caller provides (MPS), and safetensors 0.9's prefetch loaders.

use std::sync::Arc;

use pyo3::prelude::*;

use super::Handle;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::format::header::TensorInfo;
use crate::py::errors::detached;
use crate::py::prefetch::{Makers, Prefetch};
use crate::py::provided;
use crate::read::prefetch::Rows;
use crate::read::readahead::{self, Mode, ReadAhead};
use crate::read::strategy::Purpose;

impl Handle {
    /// The handle's read-ahead, made at the first call: into `provided` destinations (see
    /// `take_into`), or the handle's own memory or page cache.
    pub(super) fn ahead(&self, ckpt: &Checkpoint, provided: bool) -> Option<&ReadAhead> {
        self.ahead
            .get_or_init(|| {
                let budget = readahead::budget_from_env();
                let purpose = if provided {
                    Purpose::Provided
                } else {
                    Purpose::Pulls
                };
                let mode = ckpt.plan(purpose, self.shard).ahead?;
                let (source, tally) = (ckpt.shards[self.shard].clone(), ckpt.tally());
                (budget > 0).then(|| ReadAhead::new(source, tally, mode, ckpt.options(), budget))
            })
            .as_ref()
    }

    /// `take_into`: tensor `info` (whole) read ahead into memory `allocate` makes, or None.
    pub(super) fn take_provided(
        &self,
        py: Python<'_>,
        ckpt: &Checkpoint,
        info: &TensorInfo,
        allocate: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let Some(ahead) = self.ahead(ckpt, true) else {
            return Ok(None);
        };
        if ahead.mode() != Mode::Provided {
            return Ok(None);
        }
        let index = ckpt.shards[self.shard]
            .header
            .index_of(&info.name)
            .expect("info comes from this header");
        provided::provide(py, ahead, index, allocate)?;
        let taken = detached(py, |poll| ahead.take(index, true, poll))?;
        Ok(taken.and_then(|bytes| provided::tensor(py, &bytes)))
    }

    /// `prefetch`: a loader reading `plan` (every tensor when None) in the background, started now.
    pub(super) fn start_prefetch(
        &self,
        py: Python<'_>,
        ckpt: &Arc<Checkpoint>,
        plan: Option<Vec<(String, Rows)>>,
        threads: Option<usize>,
        budget: u64,
        makers: Makers,
    ) -> PyResult<Prefetch> {
        let mut opts = ckpt.options();
        if let Some(t) = threads {
            opts.threads = Some(t.max(1));
        }
        if ckpt.pinned_shard(self.shard) {
            return Err(Error::Argument(
                "verify=: prefetch reads the file in the background, and a verified handle \
                 serves its tensors only from the bytes it hashed at open: use get_tensor / \
                 get_slice"
                    .into(),
            )
            .into());
        }
        let purpose = match makers.allocate {
            Some(_) => Purpose::Provided,
            None => Purpose::Prefetch,
        };
        let mode = ckpt.plan(purpose, self.shard).ahead;
        let at = (ckpt.clone(), self.shard);
        detached(py, |_| {
            Prefetch::start(at, plan, mode, makers, opts, budget)
        })
    }
}
