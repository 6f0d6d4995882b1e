//! Read planning: wanted byte ranges, in file-offset order, cut and coalesced into chunks.
//!
//! A chunk is one contiguous span of one file read with a single vectored read into one or more
//! destination segments. Small neighbouring tensors share a chunk; a large tensor is split across
//! several, so every worker issues large, sequential reads.
//!
//! Destinations are borrowed `&'d mut [u8]` for the plan's lifetime `'d`: the borrow checker
//! proves they are in bounds, alive and disjoint until the read ends. A segment may convert its
//! bytes on the way (F32/F16/BF16, see [`crate::format::convert`]); such segments are cut on element
//! boundaries.

use std::marker::PhantomData;

use crate::format::dtype::Dtype;

/// Default chunk size, chosen by measurement (see docs/backends.md, "Tuning").
pub const DEFAULT_CHUNK_BYTES: usize = 8 << 20;
/// At most this many destinations in one vectored read (Linux's IOV_MAX).
pub const MAX_SEGMENTS: usize = 1024;

/// What happens to a segment's bytes on the way from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// Read straight into the destination.
    Copy,
    /// Read into the worker's scratch buffer, then converted from the file's dtype into the
    /// destination's.
    Convert { from: Dtype, to: Dtype },
}

/// A destination for `len` file bytes. Private: only [`ChunkPlan::add`] makes them, from a borrow.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    dest: *mut u8,
    /// Bytes read from the file.
    pub len: usize,
    /// Bytes written at `dest` (`len` unless converting).
    pub dest_len: usize,
    pub transform: Transform,
    /// Index into [`ChunkPlan::tensors`], for error messages.
    pub tensor: usize,
}

impl Segment {
    /// The destination, for the engine's writes while the plan is alive.
    ///
    /// # Safety
    /// Only one writer at a time may use the segment (the engine hands each chunk to one worker),
    /// and only while the [`ChunkPlan`] holding it is alive.
    #[allow(clippy::mut_from_ref)] // the exclusivity is the caller's contract, checked by the engine
    pub unsafe fn dest_mut(&self) -> &mut [u8] {
        // SAFETY: made from a `&'d mut [u8]` borrowed for the plan's lifetime (ChunkPlan::add); the
        // caller's contract gives exclusive use.
        unsafe { std::slice::from_raw_parts_mut(self.dest, self.dest_len) }
    }

    /// The destination's bytes once its chunk is read, for hashing them (`crate::read::filehash`).
    ///
    /// # Safety
    /// Nothing may write the segment meanwhile (its chunk is finished: the engine hands each
    /// chunk to one worker, once), and only while the [`ChunkPlan`] holding it is alive.
    pub unsafe fn dest(&self) -> &[u8] {
        // SAFETY: as `dest_mut`; the caller's contract rules out a writer.
        unsafe { std::slice::from_raw_parts(self.dest, self.dest_len) }
    }
}

/// Copies or converts a chunk's bytes (`bytes`, read from the file), in order, into its
/// segments; an error says where in `bytes` a conversion failed.
///
/// # Safety
/// As [`Segment::dest_mut`]: the caller is the only writer of these segments (the engine hands
/// each chunk to one worker), and the [`ChunkPlan`] holding them is alive.
pub unsafe fn distribute(
    bytes: &[u8],
    segments: &[Segment],
) -> Result<(), (usize, std::io::Error)> {
    let mut from = 0usize;
    for s in segments {
        let src = &bytes[from..from + s.len];
        // SAFETY: the caller's contract (one writer, the plan alive).
        let dest = unsafe { s.dest_mut() };
        match s.transform {
            Transform::Copy => dest.copy_from_slice(src),
            Transform::Convert { from: a, to: b } => {
                crate::format::convert::convert(a, b, src, dest).map_err(|e| {
                    let kind = std::io::ErrorKind::InvalidData;
                    (from, std::io::Error::new(kind, e.to_string()))
                })?
            }
        }
        from += s.len;
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct Chunk {
    /// Index into the caller's list of files.
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    pub len: usize,
    /// Range of [`ChunkPlan::segments`].
    pub segments: std::ops::Range<usize>,
}

/// Chunks in the order workers claim them (file order, then offset order), writing into
/// destinations borrowed for `'d`.
#[derive(Debug, Default)]
pub struct ChunkPlan<'d> {
    pub chunks: Vec<Chunk>,
    pub segments: Vec<Segment>,
    /// Tensor names, for error messages.
    pub tensors: Vec<String>,
    chunk_bytes: usize,
    _dest: PhantomData<&'d mut [u8]>,
}

// SAFETY: segments point into `&'d mut [u8]` borrows that the plan holds exclusively; workers
// only write through the segments of the chunks they claim, each chunk claimed once.
unsafe impl Send for ChunkPlan<'_> {}
// SAFETY: as above.
unsafe impl Sync for ChunkPlan<'_> {}

impl<'d> ChunkPlan<'d> {
    pub fn new(chunk_bytes: usize) -> Self {
        ChunkPlan {
            chunk_bytes: chunk_bytes.max(4096),
            chunks: Vec::new(),
            segments: Vec::new(),
            tensors: Vec::new(),
            _dest: PhantomData,
        }
    }

    /// Reorders the chunks so that the files take turns, `at_once` files at a time (in the order
    /// they first appear), each file's chunks still in offset order: a read that hashes starts
    /// that many files' hashes at once, so several files hash on several cores (one file's
    /// SHA-256 is serial) instead of one after the other, and no more than the cores can run
    /// beside the readers ([`crate::read::strategy::files_hashed_at_once`]).
    pub fn take_turns(&mut self, at_once: usize) {
        let files = self.chunks.iter().map(|c| c.file + 1).max().unwrap_or(0);
        if files < 2 {
            return;
        }
        let mut queues = vec![std::collections::VecDeque::new(); files];
        let mut order = Vec::new();
        for chunk in self.chunks.drain(..) {
            if queues[chunk.file].is_empty() {
                order.push(chunk.file); // queues only grow here: empty means not seen yet
            }
            queues[chunk.file].push_back(chunk);
        }
        for group in order.chunks(at_once.max(1)) {
            while group.iter().any(|&f| !queues[f].is_empty()) {
                (self.chunks).extend(group.iter().filter_map(|&f| queues[f].pop_front()));
            }
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len as u64).sum()
    }

    /// Adds `dest.len()` bytes at `offset` of `file` to be read into `dest`, for tensor `name`.
    /// Calls should come in (file, offset) order for reads to be sequential.
    pub fn add(&mut self, file: usize, offset: u64, dest: &'d mut [u8], name: &str) {
        let len = dest.len();
        self.push(file, offset, dest, len, Transform::Copy, name);
    }

    /// Adds the `elements` elements of dtype `from` at `offset` of `file`, to be converted into
    /// dtype `to` in `dest`, which must hold exactly `elements` elements of `to`.
    ///
    /// # Panics
    /// When `dest`'s length is not `elements` times the size of `to`, or the pair has no
    /// converter (`convert::supported`): callers check both first.
    pub fn add_converting(
        &mut self,
        file: usize,
        offset: u64,
        dest: &'d mut [u8],
        from: Dtype,
        to: Dtype,
        name: &str,
    ) {
        // The file bytes behind `dest`: the conversion's size rule run backwards.
        let len = crate::format::convert::converted_len(to, from, dest.len())
            .unwrap_or_else(|e| panic!("destination of tensor {name}: {e}"));
        let transform = if from == to {
            Transform::Copy
        } else {
            Transform::Convert { from, to }
        };
        self.push(file, offset, dest, len, transform, name);
    }

    fn push(
        &mut self,
        file: usize,
        offset: u64,
        dest: &'d mut [u8],
        len: usize,
        transform: Transform,
        name: &str,
    ) {
        if len == 0 {
            return;
        }
        // Converting segments are cut on element boundaries (of both dtypes).
        let (unit, dst_unit) = match transform {
            Transform::Copy => (1, 1),
            Transform::Convert { from, to } => (from.bits() / 8, to.bits() / 8),
        };
        let tensor = self.tensors.len();
        self.tensors.push(name.to_string());
        let mut rest: &'d mut [u8] = dest;
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            let room = match self.chunks.last() {
                Some(c)
                    if c.file == file
                        && c.offset + c.len as u64 == at
                        && self.chunk_bytes - c.len.min(self.chunk_bytes) >= unit
                        && c.segments.len() < MAX_SEGMENTS =>
                {
                    self.chunk_bytes - c.len
                }
                _ => {
                    let first = self.segments.len();
                    self.chunks.push(Chunk {
                        file,
                        offset: at,
                        len: 0,
                        segments: first..first,
                    });
                    self.chunk_bytes.max(unit)
                }
            };
            let take = (room.min(len - done) / unit) * unit;
            let (here, tail) = std::mem::take(&mut rest).split_at_mut(take / unit * dst_unit);
            rest = tail;
            self.segments.push(Segment {
                dest: here.as_mut_ptr(),
                len: take,
                dest_len: here.len(),
                transform,
                tensor,
            });
            let chunk = self.chunks.last_mut().expect("pushed above");
            chunk.len += take;
            chunk.segments.end = self.segments.len();
            done += take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_small_and_splits_large() {
        let mut a = [0u8; 10];
        let mut b = [0u8; 10];
        let mut big = vec![0u8; 10_000];
        let mut gap = [0u8; 5];
        let mut other = [0u8; 5];
        let mut plan = ChunkPlan::new(4096);
        plan.add(0, 8, &mut a, "a");
        plan.add(0, 18, &mut b, "b");
        plan.add(0, 28, &mut big, "big");
        plan.add(0, 20_000, &mut gap, "gap");
        plan.add(1, 0, &mut other, "other file");
        let spans: Vec<(usize, u64, usize)> = plan
            .chunks
            .iter()
            .map(|c| (c.file, c.offset, c.len))
            .collect();
        assert_eq!(
            spans,
            vec![
                (0, 8, 4096),
                (0, 4104, 4096),
                (0, 8200, 1828),
                (0, 20_000, 5),
                (1, 0, 5)
            ]
        );
        assert_eq!(plan.total_bytes(), 10 + 10 + 10_000 + 5 + 5);
        for c in &plan.chunks {
            let sum: usize = plan.segments[c.segments.clone()]
                .iter()
                .map(|s| s.len)
                .sum();
            assert_eq!(sum, c.len);
        }
    }

    #[test]
    fn converting_segments_split_on_element_boundaries() {
        // 3 odd bytes first, so the BF16 tensor starts mid-chunk at an odd position.
        let mut odd = [0u8; 3];
        let mut wide = vec![0u8; 5000 * 4]; // 5000 BF16 elements into F32
        let mut plan = ChunkPlan::new(4096);
        plan.add(0, 0, &mut odd, "odd");
        plan.add_converting(0, 3, &mut wide, Dtype::BF16, Dtype::F32, "w");
        let conv: Vec<&Segment> = plan
            .segments
            .iter()
            .filter(|s| s.transform != Transform::Copy)
            .collect();
        assert_eq!(conv.iter().map(|s| s.len).sum::<usize>(), 10_000);
        assert_eq!(conv.iter().map(|s| s.dest_len).sum::<usize>(), 20_000);
        for s in conv {
            assert_eq!(s.len % 2, 0);
            assert_eq!(s.dest_len, s.len * 2);
        }
        assert!(plan.chunks.iter().all(|c| c.len <= 4096));
    }

    /// Three files of 8 KiB in 4 KiB chunks, the second cut to `second` bytes.
    fn three_files(bufs: &mut [[u8; 8192]; 3], second: usize) -> ChunkPlan<'_> {
        let mut plan = ChunkPlan::new(4096);
        let [a, b, c] = bufs;
        plan.add(0, 0, a, "a");
        plan.add(1, 0, &mut b[..second], "b");
        plan.add(2, 0, c, "c");
        plan
    }

    fn file_order(plan: &ChunkPlan<'_>) -> Vec<(usize, u64)> {
        plan.chunks.iter().map(|c| (c.file, c.offset)).collect()
    }

    #[test]
    fn files_take_turns_each_in_offset_order() {
        let mut bufs = [[0u8; 8192]; 3];
        let mut plan = three_files(&mut bufs, 4096);
        plan.take_turns(3);
        assert_eq!(
            file_order(&plan),
            [(0, 0), (1, 0), (2, 0), (0, 4096), (2, 4096)]
        );
        assert_eq!(plan.total_bytes(), 5 * 4096);
    }

    #[test]
    fn files_take_turns_a_few_at_a_time() {
        let mut bufs = [[0u8; 8192]; 3];
        let mut plan = three_files(&mut bufs, 8192);
        plan.take_turns(2);
        assert_eq!(
            file_order(&plan),
            [(0, 0), (1, 0), (0, 4096), (1, 4096), (2, 0), (2, 4096)]
        );
        plan.take_turns(1);
        assert_eq!(
            file_order(&plan),
            [(0, 0), (0, 4096), (1, 0), (1, 4096), (2, 0), (2, 4096)]
        );
    }
}
