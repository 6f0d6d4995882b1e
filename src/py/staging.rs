//! Accelerator loads' staging ring as the Python loader (`_staging.py`) drives it: the ring's
//! size, the tensors a load wants, and the fills that bring them through it (`crate::read::staging`).

use std::collections::HashSet;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::info::Info;
use crate::error::Error;
use crate::read::staging;

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
    staging::ring(positive(ring_buffers), positive(buffer_bytes)).map_err(PyErr::from)
}

/// One fill of a staging buffer: `source` (which file), `reads` (data offset, length, offset in
/// the buffer: contiguous spans of the data area), `length` (buffer bytes used), `copies`
/// (tensor name, offset in the tensor's bytes, offset in the buffer, length).
#[pyclass(frozen, eq, get_all, name = "Fill", module = "safeload._safeload")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fill {
    source: usize,
    reads: Vec<(u64, usize, usize)>,
    length: usize,
    copies: Vec<(String, usize, usize, usize)>,
}

#[pymethods]
impl Fill {
    /// Data offset of the first byte read.
    #[getter]
    fn offset(&self) -> u64 {
        self.reads.first().map_or(0, |r| r.0)
    }

    fn __repr__(&self) -> String {
        format!(
            "Fill(source={}, reads={:?}, length={}, copies={:?})",
            self.source, self.reads, self.length, self.copies
        )
    }
}

/// The fills that bring `tensors` (name, begin, end: data-area spans of file `source`) through
/// staging buffers of `buffer_bytes`: offset order, small tensors packed together, large ones
/// split across fills, contiguous ones sharing a read; empty tensors need none.
#[pyfunction]
#[pyo3(signature = (tensors, buffer_bytes, source=0))]
pub fn staging_fills(
    tensors: Vec<(String, usize, usize)>,
    buffer_bytes: usize,
    source: usize,
) -> PyResult<Vec<Fill>> {
    if buffer_bytes < 1 {
        return Err(PyValueError::new_err(format!(
            "buffer_bytes must be positive, got {buffer_bytes}"
        )));
    }
    let spans: Vec<(usize, usize)> = tensors.iter().map(|&(_, b, e)| (b, e)).collect();
    Ok(staging::staging_fills(&spans, buffer_bytes, source)
        .into_iter()
        .map(|f| Fill {
            source: f.source,
            reads: f.reads,
            length: f.length,
            copies: (f.copies.into_iter())
                .map(|(t, at, s_at, n)| (tensors[t].0.clone(), at, s_at, n))
                .collect(),
        })
        .collect())
}

/// What a staged load reads: per file (`files`: each file's header entries, as
/// `Handle.infos()` gives them), the wanted tensors (`names`: one list, or None for all, per file)
/// in offset order, and the fills of `buffer_bytes` that bring them through the ring, file after
/// file (none when `buffer_bytes` is None: loads that need no ring). A name a file lacks is an
/// error before anything is allocated (a name in two shards is one at open).
#[pyfunction]
pub fn staging_plan(
    files: Vec<Vec<PyRef<'_, Info>>>,
    names: Vec<Option<Vec<String>>>,
    buffer_bytes: Option<usize>,
) -> PyResult<(Vec<Vec<Info>>, Vec<Fill>)> {
    if names.len() != files.len() {
        return Err(PyValueError::new_err("names: one entry per source"));
    }
    let mut wanted = Vec::with_capacity(files.len());
    let mut fills = Vec::new();
    for (i, (infos, want)) in files.iter().zip(names).enumerate() {
        let mut picked: Vec<&Info> = match want {
            None => infos.iter().map(|t| &**t).collect(),
            Some(want) => {
                let keep: HashSet<&str> = want.iter().map(String::as_str).collect();
                let have: HashSet<&str> = infos.iter().map(|t| t.name()).collect();
                if let Some(missing) = want.iter().find(|n| !have.contains(n.as_str())) {
                    return Err(Error::TensorNotFound {
                        name: missing.clone(),
                    }
                    .into());
                }
                (infos.iter())
                    .filter(|t| keep.contains(t.name()))
                    .map(|t| &**t)
                    .collect()
            }
        };
        picked.sort_by_key(|t| t.span());
        if let Some(buffer_bytes) = buffer_bytes {
            let spans: Vec<(String, usize, usize)> = (picked.iter())
                .map(|t| (t.name().to_string(), t.span().0, t.span().1))
                .collect();
            fills.extend(staging_fills(spans, buffer_bytes, i)?);
        }
        wanted.push(picked.into_iter().map(|t| t.in_shard(i)).collect());
    }
    Ok((wanted, fills))
}
