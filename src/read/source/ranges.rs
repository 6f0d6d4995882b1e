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

/// Slices with runs at least this long are read straight into the output; shorter runs are
/// gathered from one read of the span around them.
const IN_PLACE_RUN_BYTES: usize = 64 << 10;
/// Small runs closer than this are read together.
const GATHER_GAP_BYTES: usize = 16 << 10;

impl Source {
    /// The rows of `plan` (a slice of tensor `info`) in a new buffer: cut out of the map under
    /// `Mmap` (nothing read), else read, the long ones with `strategy` (Pread or Direct); returns
    /// it and the read's report (the bytes read from the file, gathered spans included).
    pub fn read_slice(
        &self,
        info: &TensorInfo,
        plan: &SlicePlan,
        strategy: Strategy,
        opts: &ReadOptions,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(TensorBytes, ReadCounts)> {
        if strategy == Strategy::Mmap {
            let part = buffer::cut(plan, &self.map_tensor(info)?)?;
            return Ok((part, ReadCounts::default()));
        }
        let mut out = buffer::allocate(&[plan.nbytes])
            .map_err(|e| self.read_err(info, e))?
            .pop()
            .expect("one size, one buffer");
        let base = self.header.data_start() + info.begin as u64;
        let mut in_place = Plan::new(chunk_bytes(&[self], opts));
        // Small runs: (file offset, destination), gathered by span below.
        let mut small: Vec<(u64, &mut [u8])> = Vec::new();
        let mut rest: &mut [u8] = out.as_mut_slice();
        for row in &plan.rows {
            for r in 0..row.count {
                let at = base + (row.offset + r * row.stride_bytes) as u64;
                let (dest, tail) = std::mem::take(&mut rest).split_at_mut(row.run_bytes);
                rest = tail;
                if row.run_bytes >= IN_PLACE_RUN_BYTES || (row.count == 1 && row.run_bytes >= 4096)
                {
                    in_place.add(0, at, dest, &info.name);
                } else {
                    small.push((at, dest));
                }
            }
        }
        let gathered = self.gather_small(info, &mut small)?;
        drop(small);
        let mut report = execute(&[self], &in_place, &[strategy], opts, poll)?;
        drop(in_place);
        report.bytes += gathered;
        Ok((out.into_shared(), report))
    }

    /// Reads small runs (file offset, destination), in file order, a span of neighbours at a
    /// time into a scratch buffer, and copies each run out; returns the bytes read.
    fn gather_small(&self, info: &TensorInfo, runs: &mut [(u64, &mut [u8])]) -> Result<u64> {
        let mut read = 0u64;
        let mut scratch = Vec::new();
        let mut i = 0;
        while i < runs.len() {
            let start = runs[i].0;
            let mut end_run = i;
            let mut span_end = start + runs[i].1.len() as u64;
            while end_run + 1 < runs.len() {
                let (next_at, ref next) = runs[end_run + 1];
                let next_end = next_at + next.len() as u64;
                if next_at < span_end
                    || next_at - span_end > GATHER_GAP_BYTES as u64
                    || next_end - start > (4 << 20)
                {
                    break;
                }
                end_run += 1;
                span_end = next_end;
            }
            scratch.resize((span_end - start) as usize, 0);
            (self.backing.read_exact_at(&mut scratch, start)).map_err(|(kept, source)| {
                Error::Read {
                    path: self.path.clone(),
                    tensor: info.name.clone(),
                    offset: start + kept as u64,
                    source,
                }
            })?;
            for (at, dest) in runs[i..=end_run].iter_mut() {
                let from = (*at - start) as usize;
                dest.copy_from_slice(&scratch[from..from + dest.len()]);
            }
            read += scratch.len() as u64;
            i = end_run + 1;
        }
        Ok(read)
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
