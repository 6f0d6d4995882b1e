//! Byte ranges of the data area read into memory: the rows of a slice (short ones gathered from
//! one read of the span around them), and a span into the caller's memory.

use crate::error::{Error, Result};
use crate::format::header::TensorInfo;
use crate::format::slice::SlicePlan;
use crate::read::buffer::{self, TensorBytes};
use crate::read::counts::ReadCounts;
use crate::read::plan::ChunkPlan;
use crate::read::strategy::{Mode, Plan, Strategy};

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
    /// The rows of `plan` (a slice of tensor `info`) as the read plan `how` says (see
    /// `strategy::plan`, `Purpose::Parts`):
    ///
    /// - `Mmap`: a view of the map when the slice is one run, else the whole tensor's view where
    ///   the caller indexes views (`views`), else cut out of the map. Where the plan reads ahead
    ///   (`Mode::PageCache`: the file is not resident), the kernel is first asked for exactly the
    ///   pages the slice touches, all at once (`gather`'s spans), and told not to read around
    ///   them when they are touched: the caller's touches then wait on the disk's full queue, and
    ///   nothing another rank needs is read. Those bytes count as read.
    /// - `Pread` / `Direct`: exactly the ranges it needs, asked of the kernel at once, read by the
    ///   worker pool in file order into the slice (short runs through a span around them).
    ///
    /// Returns it and the read's report (the bytes read, gaps read across included).
    pub fn read_slice(
        &self,
        info: &TensorInfo,
        plan: &SlicePlan,
        how: Plan,
        views: bool,
        opts: &ReadOptions,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Part, ReadCounts)> {
        let base = self.header.data_start() + info.begin as u64;
        let page = self
            .backing
            .file()
            .map_or(0, |_| platform::page_size() as u64);
        if how.strategy == Strategy::Mmap {
            let whole = self.map_tensor(info)?;
            let mut report = ReadCounts::default();
            // A resident map's part is a view and nothing more: its runs are not worked out.
            if how.ahead == Some(Mode::PageCache) {
                self.read_exactly(whole.region());
                report.bytes = self.prefetch_spans(&gather(&runs(plan, base), page));
            }
            let part = match one_run(plan) {
                Some(at) => Part::Bytes(whole.sub(at, plan.nbytes)),
                None if views => Part::Whole(whole),
                None => Part::Bytes(buffer::cut(plan, &whole)?),
            };
            return Ok((part, report));
        }
        let runs = runs(plan, base);
        let spans = gather(&runs, page);
        self.read_exactly(None);
        if how.strategy == Strategy::Pread {
            self.prefetch_spans(&spans);
        }
        let mut out = buffer::allocate(&[plan.nbytes])
            .map_err(|e| self.read_err(info, e))?
            .pop()
            .expect("one size, one buffer");
        let mut scratch = vec![0u8; spans.iter().filter(|s| s.gathers()).map(|s| s.len).sum()];
        let mut read = ChunkPlan::new(chunk_bytes(&[self], opts));
        let (mut free, mut rest): (&mut [u8], &mut [u8]) = (&mut scratch, out.as_mut_slice());
        for span in &spans {
            let len = runs[span.runs.clone()].iter().map(|r| r.1).sum();
            let (dest, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            if span.gathers() {
                let (into, tail) = std::mem::take(&mut free).split_at_mut(span.len);
                free = tail;
                read.add(0, span.at, into, &info.name);
            } else {
                read.add(0, span.at, dest, &info.name);
            }
        }
        let report = execute(&[self], &read, &[how.strategy], opts, poll)?;
        drop(read);
        scatter(&spans, &runs, &scratch, out.as_mut_slice());
        Ok((Part::Bytes(out.into_shared()), report))
    }

    /// From the first part read by range on: the kernel reads what is asked, nothing around it,
    /// for this file's reads and for faults in its map (`region`, when the part is a view).
    fn read_exactly(&self, region: Option<&std::sync::Arc<buffer::Region>>) {
        let Some(file) = self.backing.file() else {
            return;
        };
        self.exact.call_once(|| {
            platform::advise_random(file);
            if let Some(region) = region {
                region.advise_random();
            }
        });
    }

    /// Asks the kernel for every span now, in file order, without waiting
    /// (`platform::prefetch_all`: exactly their pages, since the file reads at random); the
    /// bytes asked.
    fn prefetch_spans(&self, spans: &[Span]) -> u64 {
        let Some(file) = self.backing.file() else {
            return 0;
        };
        for span in spans {
            platform::prefetch_all(file, span.at, span.len as u64);
        }
        spans.iter().map(|s| s.len as u64).sum()
    }
}

/// Every run of a slice, in output (and file) order: (file offset, bytes); the tensor's data
/// starts `base` bytes into the file.
fn runs(plan: &SlicePlan, base: u64) -> Vec<(u64, usize)> {
    let mut runs = Vec::new();
    for row in &plan.rows {
        for r in 0..row.count {
            runs.push((
                base + (row.offset + r * row.stride_bytes) as u64,
                row.run_bytes,
            ));
        }
    }
    runs
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
fn gather(runs: &[(u64, usize)], page: u64) -> Vec<Span> {
    let mut spans: Vec<Span> = Vec::new();
    let mut gaps = 0u64;
    let mut wanted = 0u64;
    for (i, &(at, len)) in runs.iter().enumerate() {
        let len = len as u64;
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
            at,
            len: len as usize,
            runs: i..i + 1,
        });
    }
    spans
}

/// Copies the runs of the gathered spans (read one after another into `scratch`) into `out`,
/// the slice: its runs (`runs`, in order) laid end to end.
fn scatter(spans: &[Span], runs: &[(u64, usize)], scratch: &[u8], out: &mut [u8]) {
    let (mut from, mut into) = (0usize, 0usize);
    for span in spans {
        let wanted: usize = runs[span.runs.clone()].iter().map(|r| r.1).sum();
        if span.gathers() {
            for &(at, len) in &runs[span.runs.clone()] {
                let k = from + (at - span.at) as usize;
                out[into..into + len].copy_from_slice(&scratch[k..k + len]);
                into += len;
            }
            from += span.len;
        } else {
            into += wanted;
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
    let mut plan = ChunkPlan::new(chunk_bytes(&[source], opts));
    for (offset, dest) in ranges {
        let name = name_at(offset).unwrap_or("<data>");
        plan.add(0, source.header.data_start() + offset, dest, name);
    }
    execute(&[source], &plan, &[strategy], opts, poll)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    /// (first run, last run + 1, span start, span length) of each span.
    fn spans(runs: &[(u64, usize)], page: u64) -> Vec<(usize, usize, u64, usize)> {
        gather(runs, page)
            .into_iter()
            .map(|s| (s.runs.start, s.runs.end, s.at, s.len))
            .collect()
    }

    #[test]
    fn gaps_inside_touched_pages_are_read_across_and_whole_pages_are_not() {
        // A column half of rows of 8 KiB from an unaligned start: every gap lies in pages the
        // runs touch, so one span reads them all.
        let half: Vec<(u64, usize)> = (0..8).map(|r| (100 + r * 8192, 4096)).collect();
        assert_eq!(spans(&half, PAGE), [(0, 8, 100, 7 * 8192 + 4096)]);
        // Rows of 22016 bytes, half of each: 11008-byte gaps span whole pages no run touches.
        let wide: Vec<(u64, usize)> = (0..4).map(|r| (r * 22016, 11008)).collect();
        let got = spans(&wide, PAGE);
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got.iter().all(|&(a, b, _, len)| b == a + 1 && len == 11008));
    }

    #[test]
    fn an_object_reads_a_gap_only_when_small_beside_what_it_wants() {
        // No pages (a store): 64-byte gaps beside 4 KiB runs (1/64) are read across...
        let close: Vec<(u64, usize)> = (0..4).map(|r| (r * (4096 + 64), 4096)).collect();
        assert_eq!(spans(&close, 0), [(0, 4, 0, 3 * (4096 + 64) + 4096)]);
        // ...a gap as long as the runs is not (it would double what is fetched).
        let half: Vec<(u64, usize)> = (0..4).map(|r| (r * 256, 128)).collect();
        assert_eq!(spans(&half, 0).len(), 4);
        // Nor across a gap longer than GATHER_GAP_BYTES, however much is wanted.
        let far = [(0, 60_000), (60_000 + 20_000, 100)];
        assert_eq!(spans(&far, 0).len(), 2);
    }

    #[test]
    fn long_runs_are_read_alone_and_spans_stop_at_their_limit() {
        let long = [
            (0u64, IN_PLACE_RUN_BYTES),
            (IN_PLACE_RUN_BYTES as u64 + 8, 100),
        ];
        let got = gather(&long, PAGE);
        assert_eq!(got.len(), 2);
        assert!(!got[0].gathers() && got[1].gathers());
        // Short runs back to back: spans no longer than GATHER_SPAN_BYTES.
        let many: Vec<(u64, usize)> = (0..1024).map(|r| (r * 8192, 8192)).collect();
        let got = gather(&many, PAGE);
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|s| s.len as u64 <= GATHER_SPAN_BYTES));
        assert_eq!(got.iter().map(|s| s.runs.len()).sum::<usize>(), 1024);
    }

    #[test]
    fn scattered_runs_land_in_slice_order() {
        // Two gathered spans around a run read in place: the slice gets each run's bytes.
        let file: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let runs = [
            (10u64, 5),
            (20, 5),
            (1000, IN_PLACE_RUN_BYTES),
            (150_000, 7),
        ];
        let spans = gather(&runs, PAGE);
        assert_eq!(spans.len(), 3);
        let mut scratch = Vec::new();
        for s in spans.iter().filter(|s| s.gathers()) {
            scratch.extend_from_slice(&file[s.at as usize..s.at as usize + s.len]);
        }
        let total: usize = runs.iter().map(|r| r.1).sum();
        let mut out = vec![0u8; total];
        scatter(&spans, &runs, &scratch, &mut out);
        let want: Vec<u8> = runs
            .iter()
            .flat_map(|&(at, len)| file[at as usize..at as usize + len].to_vec())
            .collect();
        // The in-place run is the reader's to fill: zero here.
        assert_eq!(out[..10], want[..10]);
        assert!(out[10..10 + IN_PLACE_RUN_BYTES].iter().all(|&b| b == 0));
        assert_eq!(
            out[10 + IN_PLACE_RUN_BYTES..],
            want[10 + IN_PLACE_RUN_BYTES..]
        );
    }
}
