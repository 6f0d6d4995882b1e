//! safetensors 0.9's prefetch plans: which tensors, or which rows of them, a `prefetch()` reads.
//!
//! A plan maps names to `None` (the whole tensor) or a step-1 slice of the first dimension
//! (negative bounds count from the end, an empty range is allowed, a range past the end is not).
//! It becomes the read-ahead's items ([`crate::read::readahead::ReadAhead::eager`]): one
//! [`TensorInfo`] per entry with the shape and data offsets of the rows taken, in file order, so
//! the bytes between them are neither read nor allocated.

use crate::error::{Error, Result};
use crate::format::dtype::Dtype;
use crate::format::header::{Header, TensorInfo};

/// What a plan takes of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// The whole tensor.
    All,
    /// `start:stop:step` of the first dimension, as Python's slice holds them.
    Slice {
        start: Option<i64>,
        stop: Option<i64>,
        step: Option<i64>,
    },
}

/// The items of `plan` (every tensor whole when None), in file order. An empty plan is an
/// error; no plan on a file without tensors is no items.
pub fn items(header: &Header, plan: Option<&[(String, Rows)]>) -> Result<Vec<TensorInfo>> {
    let mut items = match plan {
        None => header
            .tensors
            .iter()
            .map(|t| item(t, Rows::All))
            .collect::<Result<Vec<_>>>()?,
        Some(plan) => plan
            .iter()
            .map(|(name, rows)| {
                let info = header
                    .get(name)
                    .ok_or_else(|| Error::TensorNotFound { name: name.clone() })?;
                item(info, *rows)
            })
            .collect::<Result<Vec<_>>>()?,
    };
    if items.is_empty() && plan.is_some() {
        return Err(Error::Prefetch(
            "the prefetch plan selects no tensors".into(),
        ));
    }
    items.sort_by_key(|t| t.begin);
    Ok(items)
}

/// What `rows` takes of `info`.
fn item(info: &TensorInfo, rows: Rows) -> Result<TensorInfo> {
    let bad = |why: String| Error::Prefetch(format!("prefetch plan entry {}: {why}", info.name));
    if matches!(info.dtype, Dtype::F6_E2M3 | Dtype::F6_E3M2) {
        return Err(bad(format!(
            "{} tensors cannot be prefetched (no framework has the dtype)",
            info.dtype.code()
        )));
    }
    let Rows::Slice { start, stop, step } = rows else {
        return Ok(info.clone());
    };
    if step.is_some_and(|s| s != 1) {
        return Err(bad("only slices with step 1 are supported".into()));
    }
    let Some(&dim) = info.shape.first() else {
        return Err(bad("a 0-d tensor cannot be sliced (use None)".into()));
    };
    let dim = dim as i64;
    let from_end = |v: i64| if v < 0 { v + dim } else { v };
    let (begin, end) = (from_end(start.unwrap_or(0)), from_end(stop.unwrap_or(dim)));
    if begin < 0 || end < 0 || begin > dim || end > dim {
        let show = |v: Option<i64>| v.map_or(String::new(), |v| v.to_string());
        return Err(bad(format!(
            "slice {}:{} is out of range for dimension 0 of size {dim}",
            show(start),
            show(stop)
        )));
    }
    let (begin, end) = (begin as usize, end.max(begin) as usize);
    let row_elements: usize = info.shape[1..].iter().product();
    let row_bits = row_elements * info.dtype.bits();
    if !row_bits.is_multiple_of(8) && end > begin {
        return Err(bad(format!(
            "rows of {row_elements} {} elements do not end on a byte",
            info.dtype.code()
        )));
    }
    let row_bytes = row_bits / 8;
    let mut shape = info.shape.clone();
    shape[0] = end - begin;
    Ok(TensorInfo {
        name: info.name.clone(),
        dtype: info.dtype,
        shape,
        begin: info.begin + begin * row_bytes,
        end: info.begin + end * row_bytes,
    })
}

/// Which of a loader's items were handed over (each is, once), and where the first one not
/// handed over may be: iteration asks for it once a tensor, and finds it without scanning the
/// items before it again.
pub struct Handovers {
    done: Vec<bool>,
    /// No item before this one is pending.
    first: usize,
}

impl Handovers {
    pub fn new(n: usize) -> Handovers {
        Handovers {
            done: vec![false; n],
            first: 0,
        }
    }

    /// Marks item `i` handed over; false when it already was.
    pub fn claim(&mut self, i: usize) -> bool {
        !std::mem::replace(&mut self.done[i], true)
    }

    /// Item `i` was not handed over after all (its take failed).
    pub fn release(&mut self, i: usize) {
        self.done[i] = false;
        self.first = self.first.min(i);
    }

    /// The first item in file order not handed over yet.
    pub fn first_pending(&mut self) -> Option<usize> {
        while self.done.get(self.first) == Some(&true) {
            self.first += 1;
        }
        (self.first < self.done.len()).then_some(self.first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        let json = br#"{"w":{"dtype":"F32","shape":[4,3],"data_offsets":[0,48]},"s":{"dtype":"I64","shape":[],"data_offsets":[48,56]},"q":{"dtype":"F4","shape":[6,4],"data_offsets":[56,68]},"e":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[68,71]}}"#;
        crate::format::header::parse(json, 8 + json.len() as u64 + 71).unwrap()
    }

    fn slice(start: Option<i64>, stop: Option<i64>) -> Rows {
        Rows::Slice {
            start,
            stop,
            step: None,
        }
    }

    fn one(name: &str, rows: Rows) -> Result<TensorInfo> {
        items(&header(), Some(&[(name.to_string(), rows)])).map(|mut v| v.remove(0))
    }

    #[test]
    fn rows_become_byte_ranges() {
        let w = one("w", slice(Some(1), Some(3))).unwrap();
        assert_eq!((w.shape.clone(), w.begin, w.end), (vec![2, 3], 12, 36));
        let w = one("w", slice(Some(-1), None)).unwrap();
        assert_eq!((w.shape.clone(), w.begin, w.end), (vec![1, 3], 36, 48));
        let w = one("w", slice(Some(2), Some(2))).unwrap();
        assert_eq!((w.shape.clone(), w.begin, w.end), (vec![0, 3], 24, 24));
        let w = one("w", slice(Some(3), Some(1))).unwrap();
        assert_eq!(w.shape, vec![0, 3]);
        // F4 rows in logical shape: 4 elements a row, 2 bytes.
        let q = one("q", slice(Some(2), Some(5))).unwrap();
        assert_eq!((q.shape.clone(), q.begin, q.end), (vec![3, 4], 60, 66));
        assert_eq!(one("s", Rows::All).unwrap().nbytes(), 8);
    }

    #[test]
    fn plans_come_out_in_file_order() {
        // The sample holds an F6 tensor: a whole plan refuses it.
        let err = items(&header(), None).unwrap_err().to_string();
        assert!(err.contains("F6_E2M3"), "{err}");
        let plan: Vec<(String, Rows)> = ["q", "s", "w"]
            .iter()
            .map(|n| (n.to_string(), Rows::All))
            .collect();
        let some = items(&header(), Some(&plan)).unwrap();
        let names: Vec<&str> = some.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["w", "s", "q"]);
    }

    #[test]
    fn bad_plans_are_refused() {
        let message = |r: Result<TensorInfo>| r.unwrap_err().to_string();
        assert!(message(one("nope", Rows::All)).contains("does not contain"));
        let step = Rows::Slice {
            start: None,
            stop: None,
            step: Some(2),
        };
        assert!(message(one("w", step)).contains("step 1"));
        assert!(message(one("s", slice(None, Some(1)))).contains("0-d"));
        assert!(message(one("w", slice(Some(0), Some(5)))).contains("out of range"));
        assert!(message(one("w", slice(Some(-5), None))).contains("out of range"));
        assert!(message(one("e", Rows::All)).contains("F6"));
        let empty: [(String, Rows); 0] = [];
        let err = items(&header(), Some(&empty)).unwrap_err().to_string();
        assert!(err.contains("selects no tensors"), "{err}");
    }

    #[test]
    fn handovers_are_once_each_and_iteration_resumes_at_a_release() {
        let mut h = Handovers::new(4);
        assert!(h.claim(1));
        assert!(!h.claim(1));
        assert_eq!(h.first_pending(), Some(0));
        assert!(h.claim(0));
        assert_eq!(h.first_pending(), Some(2));
        assert!(h.claim(2) && h.claim(3));
        assert_eq!(h.first_pending(), None);
        // A take that failed: the item is pending again, though iteration had passed it.
        h.release(1);
        assert_eq!(h.first_pending(), Some(1));
        assert!(h.claim(1));
        assert_eq!(h.first_pending(), None);
    }
}
