//! Read planning: wanted byte ranges, in file-offset order, cut and coalesced into chunks.
//!
//! A chunk is one contiguous span of one file read with a single `preadv` into one or more
//! destination segments. Small neighbouring tensors share a chunk; a large tensor is split across
//! several, so every worker issues large, sequential reads.

/// Default chunk size, chosen by measurement (see README, "Tuning").
pub const DEFAULT_CHUNK_BYTES: usize = 8 << 20;
/// At most this many destinations in one vectored read (Linux's IOV_MAX).
pub const MAX_SEGMENTS: usize = 1024;

/// A destination for `len` bytes. The pointer must stay valid and unaliased until the read ends.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub dest: *mut u8,
    pub len: usize,
    /// Index into [`Plan::tensors`], for error messages.
    pub tensor: usize,
}

#[derive(Debug, Clone)]
pub struct Chunk {
    /// Index into the caller's list of files.
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    pub len: usize,
    /// Range of [`Plan::segments`].
    pub segments: std::ops::Range<usize>,
}

/// Chunks in the order workers claim them (file order, then offset order).
#[derive(Debug, Default)]
pub struct Plan {
    pub chunks: Vec<Chunk>,
    pub segments: Vec<Segment>,
    /// Tensor names, for error messages.
    pub tensors: Vec<String>,
    chunk_bytes: usize,
}

// SAFETY: segments point at destinations owned by the caller for the duration of the read;
// `PlanBuilder::add` callers guarantee the ranges are disjoint.
unsafe impl Send for Plan {}
// SAFETY: as above; workers only write through the pointers of the chunks they claim.
unsafe impl Sync for Plan {}

impl Plan {
    pub fn new(chunk_bytes: usize) -> Self {
        Plan {
            chunk_bytes: chunk_bytes.max(4096),
            ..Plan::default()
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len as u64).sum()
    }

    /// Adds `len` bytes at `offset` of `file` to be read into `dest`, for tensor `name`.
    /// Calls must come in (file, offset) order; the destinations must not overlap.
    pub fn add(&mut self, file: usize, offset: u64, dest: *mut u8, len: usize, name: &str) {
        if len == 0 {
            return;
        }
        let tensor = self.tensors.len();
        self.tensors.push(name.to_string());
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            let room = match self.chunks.last() {
                Some(c)
                    if c.file == file
                        && c.offset + c.len as u64 == at
                        && c.len < self.chunk_bytes
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
                    self.chunk_bytes
                }
            };
            let take = room.min(len - done);
            // `done + take <= len`: still inside the caller's destination.
            let dest = dest.wrapping_add(done);
            self.segments.push(Segment {
                dest,
                len: take,
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
        let mut buf = vec![0u8; 100];
        let p = buf.as_mut_ptr();
        let mut plan = Plan::new(4096);
        plan.add(0, 8, p, 10, "a");
        plan.add(0, 18, p, 10, "b");
        plan.add(0, 28, p, 10_000, "big");
        plan.add(0, 20_000, p, 5, "gap");
        plan.add(1, 0, p, 5, "other file");
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
}
