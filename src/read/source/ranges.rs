//! Byte ranges of the data area read into memory: the rows of a slice (short ones gathered from
//! one read of the span around them), and a span into the caller's memory.

use crate::error::{Error, Result};
use crate::format::header::TensorInfo;
use crate::format::slice::SlicePlan;
use crate::read::buffer::{self, TensorBytes};
use crate::read::engine::ReadCounts;
use crate::read::plan::Plan;
use crate::read::strategy::Strategy;

use super::{ReadOptions, Source, chunk_bytes, execute};
use crate::platform;

/// Runs at least this long are read straight into the slice; shorter ones are gathered from one
/// read of the span around them.
const IN_PLACE_RUN_BYTES: usize = 64 << 10;
/// A gathered span reads across gaps no longer than this...
const GATHER_GAP_BYTES: usize = 16 << 10;
/// ...and only while the gaps it reads add at most 1/16 of the bytes it wants (a part of a
/// file never reads more than 6.25% beyond its bytes for its gaps), where they are not inside
/// pages the span touches anyway.
const GATHER_GAP_SHARE: usize = 16;
/// The longest gathered span.
const GATHER_SPAN_BYTES: u64 = 4 << 20;

/// What a slice read gives.
pub enum Part {
    /// The slice's bytes, in its shape.
    Bytes(TensorBytes),
    /// The whole tensor, a view of the map, for the caller to index into a view of its own (as
    /// 0.8's slices of a map are): only when asked for (`views`) and the slice is not one run.
    Whole(TensorBytes),
}

impl Source {
    /// The rows of `plan` (a slice of tensor `info`): under `Mmap` a view of the map (nothing
    /// read) when the slice is one run, else the whole tensor's view where the caller indexes
    /// views (`views`), else cut out of the map; under `Pread` / `Direct` exactly the ranges it
    /// needs, read by the worker pool in file order (see [`gather`]), with the kernel told not to
    /// read around them (`platform::advise_random`). Returns it and the read's report (the bytes
    /// read from the file, gaps read across included).
    pub fn read_slice(
        &self,
        info: &TensorInfo,
        plan: &SlicePlan,
        strategy: Strategy,
        views: bool,
        opts: &ReadOptions,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Part, ReadCounts)> {
        if strategy == Strategy::Mmap {
            let whole = self.map_tensor(info)?;
            let part = match one_run(plan) {
                Some(at) => Part::Bytes(whole.sub(at, plan.nbytes)),
                None if views => Part::Whole(whole),
                None => Part::Bytes(buffer::cut(plan, &whole)?),
            };
            return Ok((part, ReadCounts::default()));
        }
        if let Some(file) = self.backing.file() {
            self.exact.call_once(|| platform::advise_random(file));
        }
        let mut out = buffer::allocate(&[plan.nbytes])
            .map_err(|e| self.read_err(info, e))?
            .pop()
            .expect("one size, one buffer");
        let base = self.header.data_start() + info.begin as u64;
        // Every run, in file order: (file offset, destination).
        let mut runs: Vec<(u64, &mut [u8])> = Vec::new();
        let mut rest: &mut [u8] = out.as_mut_slice();
        for row in &plan.rows {
            for r in 0..row.count {
                let (dest, tail) = std::mem::take(&mut rest).split_at_mut(row.run_bytes);
                rest = tail;
                runs.push((base + (row.offset + r * row.stride_bytes) as u64, dest));
            }
        }
        let page = self.backing.file().map_or(0, |_| platform::page_size() as u64);
        let spans = gather(&runs, page);
        let mut scratch = vec![0u8; spans.iter().filter(|s| s.gathers()).map(|s| s.len).sum()];
        let mut read = Plan::new(chunk_bytes(&[self], opts));
        let mut free: &mut [u8] = &mut scratch;
        let mut gathered: Vec<(&Span, &[u8])> = Vec::new();
        let mut runs = runs.into_iter();
        let mut held = Vec::new();
        for span in &spans {
            if span.gathers() {
                let (into, tail) = std::mem::take(&mut free).split_at_mut(span.len);
                free = tail;
                read.add(0, span.at, into, &info.name);
                held.push(span);
                for _ in span.runs.clone() {
                    runs.next(); // its runs are copied out of `into` below
                }
            } else {
                let (at, dest) = runs.next().expect("a span per run or more");
                read.add(0, at, dest, &info.name);
            }
        }
        drop(runs);
        let report = execute(&[self], &read, &[strategy], opts, poll)?;
        drop(read);
        let mut at = 0;
        for span in held {
            gathered.push((span, &scratch[at..at + span.len]));
            at += span.len;
        }
        scatter(&gathered, plan, out.as_mut_slice(), base);
        Ok((Part::Bytes(out.into_shared()), report))
    }
}

/// Where a slice that is one run of its tensor's bytes starts (None: several runs).
fn one_run(plan: &SlicePlan) -> Option<usize> {
    match plan.rows.as_slice() {
        [row] if row.count <= 1 || row.stride_bytes == row.run_bytes => Some(row.offset),
        [] => Some(0),
        _ => None,
    }
}

/// One read of a slice: `len` bytes at `at`, holding `runs` (indices into the slice's runs, in
/// file order).
#[derive(Debug, PartialEq, Eq)]
struct Span {
    at: u64,
    len: usize,
    runs: std::ops::Range<usize>,
}

impl Span {
    /// Whether it is read into scratch memory and its runs copied out (several runs, or a short
    /// one); else its one run is read straight into the slice.
    fn gathers(&self) -> bool {
        self.runs.len() > 1 || self.len < IN_PLACE_RUN_BYTES
    }
}

/// The reads of a slice's `runs` (file offset, destination; in file order): long runs alone,
/// short neighbours in one span across the gaps between them, where a gap lies in pages the
/// span touches anyway (`page`, 0 where reads are not of pages: an object in a store) or the
/// gaps it reads stay short and under 1/16 of the bytes it wants (never more than
/// [`GATHER_SPAN_BYTES`]). So a part of a file never costs the disk or the wire pages beyond
/// those its runs touch, or 6.25% beyond its bytes.
fn gather(runs: &[(u64, &mut [u8])], page: u64) -> Vec<Span> {
    let mut spans: Vec<Span> = Vec::new();
    let mut gaps = 0u64;
    let mut wanted = 0u64;
    for (i, (at, dest)) in runs.iter().enumerate() {
        let len = dest.len() as u64;
        if let Some(span) = spans.last_mut() {
            let end = span.at + span.len as u64;
            let gap = at.checked_sub(end);
            let in_touched_pages = page > 0 && gap.is_some() && at / page <= end.div_ceil(page);
            let small = gap.is_some_and(|g| {
                g <= GATHER_GAP_BYTES as u64 && (gaps + g) * GATHER_GAP_SHARE as u64 <= wanted + len
            });
            let short = (len as usize) < IN_PLACE_RUN_BYTES && span.gathers();
            let fits = at + len - span.at <= GATHER_SPAN_BYTES;
            if let Some(gap) = gap
                && short
                && fits
                && (in_touched_pages || small)
            {
                if !in_touched_pages {
                    gaps += gap;
                }
                wanted += len;
                span.len = (at + len - span.at) as usize;
                span.runs.end = i + 1;
                continue;
            }
        }
        (gaps, wanted) = (0, len);
        spans.push(Span {
            at: *at,
            len: len as usize,
            runs: i..i + 1,
        });
    }
    spans
}

/// Copies each gathered span's runs (`spans`, with the bytes read for them) into `out`, the
/// slice laid out by `plan` (whose runs start `base` bytes into the file).
fn scatter(spans: &[(&Span, &[u8])], plan: &SlicePlan, out: &mut [u8], base: u64) {
    // The k-th run of the slice: where it is in the file and in `out`.
    let mut index = Vec::new();
    let mut into = 0usize;
    for row in &plan.rows {
        for r in 0..row.count {
            index.push((base + (row.offset + r * row.stride_bytes) as u64, into, row.run_bytes));
            into += row.run_bytes;
        }
    }
    for (span, bytes) in spans {
        for k in span.runs.clone() {
            let (at, into, len) = index[k];
            let from = (at - span.at) as usize;
            out[into..into + len].copy_from_slice(&bytes[from..from + len]);
        }
    }
}

/// Reads data-area ranges into the caller's memory (accelerator staging buffers, MPS memory):
/// each `(offset, dest)` takes `dest.len()` bytes from `offset` bytes into the data area. All of
/// them are one plan, read by one worker pool in file order with `strategy` (Pread or Direct).
/// Every range must lie within the data area; nothing is read when one does not.
pub fn read_data_ranges(
    source: &Source,
    ranges: Vec<(u64, &mut [u8])>,
    strategy: Strategy,
    opts: &ReadOptions,
    poll: &mut dyn FnMut() -> bool,
) -> Result<ReadCounts> {
    let data_len = source.header.data_len();
    for (offset, dest) in &ranges {
        let len = dest.len();
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > data_len)
        {
            return Err(Error::Slice(format!(
                "byte range {offset}+{len} is outside the data area ({data_len} bytes) of {}",
                source.path.display()
            )));
        }
    }
    // The tensor a range starts in names it in errors.
    let mut spans: Vec<(u64, u64, &str)> = (source.header.tensors.iter())
        .map(|t| (t.begin as u64, t.end as u64, t.name.as_str()))
        .collect();
    spans.sort_unstable();
    let name_at = |offset: u64| {
        let i = spans.partition_point(|&(begin, _, _)| begin <= offset);
        (i > 0 && offset < spans[i - 1].1).then(|| spans[i - 1].2)
    };
    let mut ranges = ranges;
    ranges.sort_by_key(|(offset, _)| *offset);
    let mut plan = Plan::new(chunk_bytes(&[source], opts));
    for (offset, dest) in ranges {
        let name = name_at(offset).unwrap_or("<data>");
        plan.add(0, source.header.data_start() + offset, dest, name);
    }
    execute(&[source], &plan, &[strategy], opts, poll)
}
