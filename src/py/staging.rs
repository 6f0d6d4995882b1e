//! Accelerator loads' staging ring as the Python loader (`_staging.py`) drives it: the ring's
//! size and the fills that bring tensors through it (`crate::staging`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors::to_py;
use crate::staging;

/// The ring to use, (buffers, bytes each): the arguments, else `$SAFELOAD_STAGING_RING`, else
/// 4 x 64 MiB, the default buffers smaller where a quarter of what the process may still take is
/// less (8 MiB at least).
#[pyfunction]
#[pyo3(signature = (ring_buffers=None, buffer_bytes=None))]
pub fn staging_ring(
    ring_buffers: Option<i64>,
    buffer_bytes: Option<i64>,
) -> PyResult<(usize, usize)> {
    let positive = |v: Option<i64>| v.map(|v| usize::try_from(v).unwrap_or(0));
    staging::ring(positive(ring_buffers), positive(buffer_bytes)).map_err(to_py)
}

/// `"4x64MiB"` -> (4, 67108864); ValueError for anything else.
#[pyfunction]
pub fn parse_ring(text: &str) -> PyResult<(usize, usize)> {
    staging::parse_ring(text).ok_or_else(|| {
        PyValueError::new_err(format!("ring {text:?}: expected COUNTxSIZE, e.g. 4x64MiB"))
    })
}

/// (source, reads, length, copies) of one staging fill, copies naming tensors by index.
type FillTuple = (
    usize,
    Vec<(u64, usize, usize)>,
    usize,
    Vec<(usize, usize, usize, usize)>,
);

/// The staging fills for tensors' data-area spans `(begin, end)` of one source (see
/// `staging::staging_fills`): where accelerator loads plan their reads.
#[pyfunction]
pub fn staging_fills(
    spans: Vec<(usize, usize)>,
    buffer_bytes: usize,
    source: usize,
) -> PyResult<Vec<FillTuple>> {
    if buffer_bytes < 1 {
        return Err(PyValueError::new_err(format!(
            "buffer_bytes must be positive, got {buffer_bytes}"
        )));
    }
    Ok(staging::staging_fills(&spans, buffer_bytes, source)
        .into_iter()
        .map(|f| (f.source, f.reads, f.length, f.copies))
        .collect())
}
