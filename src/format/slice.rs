//! Slicing: turns Python-style indices over a tensor's shape into the byte rows to read.
//!
//! Semantics are those of torch/numpy indexing. Two bounds rules, as safetensors 0.8 has them
//! ([`Bounds`]): its numpy-strict one, pinned by its own tests, where a stop past the end of a
//! dimension is an error (with 0.8's message), and torch's, where starts and stops are clamped to
//! the dimension. Either way an index out of range is an error, negative starts and start > stop
//! behave as in Python, and a step larger than the dimension selects what it would in Python.

use std::fmt;

use crate::error::{Error, Result};
use crate::format::dtype::Dtype;

/// One index of a `[...]` expression, after `...` has been expanded by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Index {
    Select(i64),
    Range {
        start: Option<i64>,
        stop: Option<i64>,
        step: i64,
    },
}

impl fmt::Display for Index {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn opt(v: Option<i64>) -> String {
            v.map(|v| v.to_string()).unwrap_or_default()
        }
        match self {
            Index::Select(i) => write!(f, "{i}"),
            Index::Range {
                start,
                stop,
                step: 1,
            } => write!(f, "{}:{}", opt(*start), opt(*stop)),
            Index::Range { start, stop, step } => {
                write!(f, "{}:{}:{step}", opt(*start), opt(*stop))
            }
        }
    }
}

/// How far a slice may reach past a dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bounds {
    /// 0.8's `backend="pread"` rule (and numpy's own tests of it): a stop past the end is an
    /// error. Errors are [`Error::Slice`].
    Strict,
    /// torch indexing (0.8's default mmap backend with `framework="pt"`): starts and stops are
    /// clamped to the dimension. An int out of range or more indices than dimensions is
    /// [`Error::SliceIndex`] (torch raises `IndexError` for those).
    Clamp,
}

/// A selection along one dimension: `count` elements from `start`, `step` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DimSel {
    start: usize,
    count: usize,
    step: usize,
    keep: bool,
}

/// The rows of bytes a slice needs, relative to the tensor's first byte, in output order.
/// Each row is `count` runs of `run_bytes` bytes, `stride_bytes` apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePlan {
    pub shape: Vec<usize>,
    pub rows: Vec<Row>,
    pub nbytes: usize,
}

impl SlicePlan {
    /// Whether the slice is every byte of a tensor of `len` bytes, in order (`t[...]`, `t[:]`,
    /// a shape change only): gathering it would copy the tensor as it is.
    pub fn is_whole(&self, len: usize) -> bool {
        let mut pos = 0;
        for row in &self.rows {
            for r in 0..row.count {
                if row.offset + r * row.stride_bytes != pos {
                    return false;
                }
                pos += row.run_bytes;
            }
        }
        len > 0 && pos == len && self.nbytes == len
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub offset: usize,
    pub count: usize,
    pub stride_bytes: usize,
    pub run_bytes: usize,
}

impl Row {
    pub fn nbytes(&self) -> usize {
        self.count * self.run_bytes
    }
}

fn describe(indices: &[Index], shape: &[usize]) -> String {
    let parts: Vec<String> = indices.iter().map(Index::to_string).collect();
    format!(
        "Error during slicing [{}] with shape {shape:?}",
        parts.join(", ")
    )
}

impl Bounds {
    /// An index out of range, or too many of them: `IndexError` under torch's rule.
    fn error(self, message: String) -> Error {
        match self {
            Bounds::Strict => Error::Slice(message),
            Bounds::Clamp => Error::SliceIndex(message),
        }
    }
}

fn out_of_bounds(
    indices: &[Index],
    shape: &[usize],
    dim: usize,
    asked: i64,
    bounds: Bounds,
) -> Error {
    bounds.error(format!(
        "{}: index {asked} out of bounds for tensor dimension #{dim} of size {}",
        describe(indices, shape),
        shape[dim]
    ))
}

fn select_dim(indices: &[Index], shape: &[usize], dim: usize, bounds: Bounds) -> Result<DimSel> {
    let size = shape[dim];
    let n = size as i64;
    let index = indices.get(dim).cloned().unwrap_or(Index::Range {
        start: None,
        stop: None,
        step: 1,
    });
    match index {
        Index::Select(i) => {
            let pos = if i < 0 { i + n } else { i };
            if i < 0 && pos < 0 {
                return Err(bounds.error(format!(
                    "Invalid index {i} for dimension {dim} of size {size}"
                )));
            }
            if pos >= n {
                return Err(out_of_bounds(indices, shape, dim, pos, bounds));
            }
            Ok(DimSel {
                start: pos as usize,
                count: 1,
                step: 1,
                keep: false,
            })
        }
        Index::Range { start, stop, step } => {
            if step <= 0 {
                return Err(Error::Slice(format!(
                    "{}: slice step must be positive, got {step}",
                    describe(indices, shape)
                )));
            }
            if let Some(stop) = stop
                && stop > n
                && bounds == Bounds::Strict
            {
                return Err(out_of_bounds(indices, shape, dim, stop - 1, bounds));
            }
            let step = step.min(n.max(1)); // the same elements, and no overflow below
            let clamp = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
            let begin = start.map_or(0, clamp);
            let end = stop.map_or(n, clamp);
            let count = if end > begin {
                ((end - begin + step - 1) / step) as usize
            } else {
                0
            };
            Ok(DimSel {
                start: begin as usize,
                count,
                step: step as usize,
                keep: true,
            })
        }
    }
}

/// Plans the bytes of `tensor[indices]` for a tensor of `dtype` and `shape`.
pub fn plan(dtype: Dtype, shape: &[usize], indices: &[Index], bounds: Bounds) -> Result<SlicePlan> {
    if indices.len() > shape.len() {
        return Err(bounds.error(format!(
            "{}: more slicing indexes than dimensions in tensor",
            describe(indices, shape)
        )));
    }
    let sels = (0..shape.len())
        .map(|d| select_dim(indices, shape, d, bounds))
        .collect::<Result<Vec<_>>>()?;
    let out_shape: Vec<usize> = sels.iter().filter(|s| s.keep).map(|s| s.count).collect();
    let (k, block_elems) = whole_trailing_dims(&sels, shape);
    let bits = dtype.bits();
    let to_bytes = |elems: usize| -> Result<usize> {
        let b = elems * bits;
        if !b.is_multiple_of(8) {
            Err(misaligned(indices, shape))
        } else {
            Ok(b / 8)
        }
    };
    let total_elems: usize = sels.iter().map(|s| s.count).product();
    let nbytes = to_bytes(total_elems)?;
    if total_elems == 0 {
        return Ok(SlicePlan {
            shape: out_shape,
            rows: Vec::new(),
            nbytes: 0,
        });
    }
    if k == 0 {
        return Ok(SlicePlan {
            shape: out_shape,
            rows: vec![Row {
                offset: 0,
                count: 1,
                stride_bytes: nbytes,
                run_bytes: nbytes,
            }],
            nbytes,
        });
    }
    Ok(SlicePlan {
        shape: out_shape,
        rows: strided_rows(&sels[..k], shape, block_elems, to_bytes)?,
        nbytes,
    })
}

/// A sub-byte dtype's slice that does not start or end on a byte boundary.
fn misaligned(indices: &[Index], shape: &[usize]) -> Error {
    Error::Slice(format!(
        "{}: The slice is slicing for subbytes dtypes, and the slice does not end up at a \
         byte boundary, this is invalid.",
        describe(indices, shape)
    ))
}

/// Trailing dimensions taken whole form one contiguous block per element of the dim before:
/// returns how many dimensions come before them (`k`) and the elements of one block.
fn whole_trailing_dims(sels: &[DimSel], shape: &[usize]) -> (usize, usize) {
    let mut block_elems = 1usize;
    let mut k = shape.len();
    while k > 0 {
        let s = sels[k - 1];
        if s.start == 0 && s.count == shape[k - 1] && s.step == 1 {
            block_elems *= shape[k - 1];
            k -= 1;
        } else {
            break;
        }
    }
    (k, block_elems)
}

/// The rows of a slice whose first `sels.len()` dimensions are not taken whole (`block_elems`:
/// the elements of the whole dimensions after them): the last of them gives each row's runs,
/// every combination of the ones before it one row, in C order. `to_bytes`: elements to bytes,
/// refusing a count that is not a whole number of bytes.
fn strided_rows(
    sels: &[DimSel],
    shape: &[usize],
    block_elems: usize,
    to_bytes: impl Fn(usize) -> Result<usize>,
) -> Result<Vec<Row>> {
    // Element strides of every dimension (C order).
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let k = sels.len();
    let inner = sels[k - 1];
    let (run_elems, count, stride_elems) = if inner.step == 1 {
        (inner.count * block_elems, 1, inner.count * block_elems)
    } else {
        (block_elems, inner.count, inner.step * strides[k - 1])
    };
    let row_template = Row {
        offset: 0,
        count,
        stride_bytes: to_bytes(stride_elems)?,
        run_bytes: to_bytes(run_elems)?,
    };
    let inner_start = inner.start * strides[k - 1];

    // Enumerate every combination of the outer (k-1) dimensions in C order.
    let outer = &sels[..k - 1];
    let n_rows: usize = outer.iter().map(|s| s.count).product();
    let mut rows = Vec::with_capacity(n_rows);
    let mut counters = vec![0usize; outer.len()];
    for _ in 0..n_rows {
        let mut elem = inner_start;
        for (d, s) in outer.iter().enumerate() {
            elem += (s.start + counters[d] * s.step) * strides[d];
        }
        rows.push(Row {
            offset: to_bytes(elem)?,
            ..row_template
        });
        for d in (0..outer.len()).rev() {
            counters[d] += 1;
            if counters[d] < outer[d].count {
                break;
            }
            counters[d] = 0;
        }
    }
    Ok(rows)
}

/// Copies the planned rows out of the tensor's whole bytes (used by the mmap backend and tests).
pub fn gather(plan: &SlicePlan, source: &[u8], out: &mut [u8]) {
    let mut pos = 0;
    for row in &plan.rows {
        for r in 0..row.count {
            let from = row.offset + r * row.stride_bytes;
            out[pos..pos + row.run_bytes].copy_from_slice(&source[from..from + row.run_bytes]);
            pos += row.run_bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_is_whole_only_when_it_takes_every_byte_in_order() {
        let all = |idx: &[Index]| strict(Dtype::U16, &[4, 3], idx).unwrap().is_whole(24);
        assert!(all(&[]));
        assert!(all(&[r(None, None, 1)]));
        assert!(all(&[r(Some(0), Some(4), 1), r(None, None, 1)]));
        assert!(!all(&[r(Some(0), Some(3), 1)]));
        assert!(!all(&[r(None, None, 1), r(Some(0), Some(2), 1)]));
        assert!(!all(&[r(None, None, 2)]));
    }

    fn r(start: Option<i64>, stop: Option<i64>, step: i64) -> Index {
        Index::Range { start, stop, step }
    }

    fn strict(dtype: Dtype, shape: &[usize], idx: &[Index]) -> Result<SlicePlan> {
        plan(dtype, shape, idx, Bounds::Strict)
    }

    /// Reference: index a u16 tensor holding 0..n element by element.
    fn reference(shape: &[usize], idx: &[Index]) -> Vec<u16> {
        let plan = strict(Dtype::U16, shape, idx).unwrap();
        let n: usize = shape.iter().product();
        let src: Vec<u8> = (0..n as u16).flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; plan.nbytes];
        gather(&plan, &src, &mut out);
        out.chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    #[test]
    fn matches_python_indexing() {
        // A = arange(24).reshape(2, 3, 4)
        assert_eq!(
            reference(&[2, 3, 4], &[Index::Select(1)]),
            (12..24).collect::<Vec<_>>()
        );
        assert_eq!(
            reference(
                &[2, 3, 4],
                &[r(None, None, 1), Index::Select(-1), r(Some(1), Some(3), 1)]
            ),
            vec![9, 10, 21, 22]
        );
        assert_eq!(
            reference(
                &[2, 3, 4],
                &[r(None, None, 1), r(None, None, 2), r(None, None, 3)]
            ),
            vec![0, 3, 8, 11, 12, 15, 20, 23]
        );
        assert_eq!(
            reference(&[2, 3, 4], &[r(Some(-1), None, 1)]),
            (12..24).collect::<Vec<_>>()
        );
        assert_eq!(
            reference(&[2, 3, 4], &[r(Some(2), Some(1), 1)]),
            Vec::<u16>::new()
        );
    }

    #[test]
    fn upstream_messages() {
        let e = strict(Dtype::F32, &[10, 5], &[r(None, Some(20), 1)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Error during slicing [:20] with shape [10, 5]: index 19 out of bounds for tensor dimension #0 of size 10"
        );
        let e = strict(
            Dtype::F32,
            &[10, 5],
            &[r(Some(2), None, 1), Index::Select(-6)],
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "Invalid index -6 for dimension 1 of size 5");
        let e = strict(
            Dtype::F32,
            &[10, 5],
            &[r(Some(2), None, 1), Index::Select(20)],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Error during slicing [2:, 20] with shape [10, 5]: index 20 out of bounds for tensor dimension #1 of size 5"
        );
    }

    #[test]
    fn packed_dtype_needs_byte_boundaries() {
        assert!(strict(Dtype::F4, &[4, 4], &[Index::Select(1)]).is_ok());
        assert!(strict(Dtype::F4, &[4, 4], &[r(None, None, 1), r(Some(1), None, 1)]).is_err());
    }

    #[test]
    fn torch_bounds_clamp_and_raise_index_errors() {
        let clamp = |idx: &[Index]| plan(Dtype::U16, &[10, 5], idx, Bounds::Clamp);
        // A stop past the end is the whole dimension, a start past it an empty one.
        assert_eq!(
            clamp(&[r(None, Some(20), 1)]).unwrap(),
            strict(Dtype::U16, &[10, 5], &[]).unwrap()
        );
        assert_eq!(
            clamp(&[r(Some(-30), Some(30), 1)]).unwrap().shape,
            vec![10, 5]
        );
        assert_eq!(clamp(&[r(Some(12), None, 1)]).unwrap().shape, vec![0, 5]);
        // Ints out of range and too many indices: the variant that is also an IndexError.
        let e = clamp(&[r(None, Some(20), 1), Index::Select(7)]).unwrap_err();
        assert!(matches!(e, Error::SliceIndex(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            "Error during slicing [:20, 7] with shape [10, 5]: index 7 out of bounds for tensor dimension #1 of size 5"
        );
        assert!(matches!(
            clamp(&[Index::Select(-11)]),
            Err(Error::SliceIndex(_))
        ));
        let three = [Index::Select(0), Index::Select(0), Index::Select(0)];
        assert!(matches!(clamp(&three), Err(Error::SliceIndex(_))));
        assert!(matches!(
            strict(Dtype::U16, &[10, 5], &three),
            Err(Error::Slice(_))
        ));
        assert!(matches!(
            strict(Dtype::U16, &[10, 5], &[Index::Select(10)]),
            Err(Error::Slice(_))
        ));
        // A step bigger than the dimension (even i64::MAX) takes the first element.
        for bounds in [Bounds::Strict, Bounds::Clamp] {
            let p = plan(Dtype::U16, &[10, 5], &[r(None, None, i64::MAX)], bounds).unwrap();
            assert_eq!(p.shape, vec![1, 5]);
        }
        assert_eq!(reference(&[6], &[r(Some(1), None, i64::MAX)]), vec![1]);
    }
}
