//! `TensorInfo`: a header entry as `Handle.infos()` and `Checkpoint.infos()` return it.

use pyo3::prelude::*;

use crate::format::header::TensorInfo;

/// A tensor's header entry: `name`, `dtype` (format code), `shape`, `begin` and `end` (offsets
/// in the data area of its file), `shard` (which file of a checkpoint; 0 for a handle's).
#[pyclass(
    frozen,
    eq,
    get_all,
    name = "TensorInfo",
    module = "safeload._safeload"
)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
    shard: usize,
}

impl Info {
    pub(super) fn new(shard: usize, t: &TensorInfo) -> Info {
        Info {
            name: t.name.clone(),
            dtype: t.dtype.code(),
            shape: t.shape.clone(),
            begin: t.begin,
            end: t.end,
            shard,
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// (begin, end) in the data area.
    pub(super) fn span(&self) -> (usize, usize) {
        (self.begin, self.end)
    }

    /// The same entry as file `shard` of a load.
    pub(super) fn in_shard(&self, shard: usize) -> Info {
        Info {
            shard,
            ..self.clone()
        }
    }
}

#[pymethods]
impl Info {
    /// Bytes of the tensor's data.
    #[getter]
    fn nbytes(&self) -> usize {
        self.end - self.begin
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorInfo(name={:?}, dtype={}, shape={:?}, begin={}, end={}, shard={})",
            self.name, self.dtype, self.shape, self.begin, self.end, self.shard
        )
    }
}
