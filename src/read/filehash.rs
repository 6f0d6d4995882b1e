//! A file's SHA-256 computed from the bytes the engine reads, in the same pass.
//!
//! A digest covers every byte of the file in order: the 8-byte prefix and the JSON header (the
//! bytes the source parsed at open, not a re-read), then the data area, which the header's
//! rules make one contiguous run of tensors with no gap. [`FileHash`] is that state, kept on the
//! file's `Source` between reads: bytes `0..cursor` hashed, each exactly once, so a checkpoint
//! read in batches in file order hashes as it goes.
//!
//! Within one read, workers finish chunks out of order. [`Ordered`] puts them back in order:
//! a finished chunk that is not at the cursor waits in a queue (its bytes stay in its
//! destinations, alive until the plan ends, or, where they went through a worker's buffer to be
//! converted, in that buffer, handed over). A read of several workers hashes on a thread of its
//! own ([`Ordered::hash_in_order`]): workers queue every chunk and go on reading, so the disk's
//! queue stays full while one core hashes (one file's SHA-256 is serial; files hash side by
//! side). A read on one thread hashes each chunk as it reaches the cursor.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::format::digest::{Digest, Sha256};
use crate::read::plan::ChunkPlan;

/// How often a worker waiting for room in the queue looks at the read's stop flag.
const WAIT: Duration = Duration::from_millis(20);

/// A file's hash as its source keeps it: None when not started, or while a read feeds it.
pub type Slot = Mutex<Option<FileHash>>;

/// The hash of a file's first `cursor` bytes.
pub struct FileHash {
    sha: Sha256,
    cursor: u64,
    len: u64,
    /// The lowest offset past the cursor that a read covered without hashing it (a gap before
    /// it): where the first missing range ends, for the message.
    resumed: Option<u64>,
}

/// Bytes `from..to` of the file were not hashed: what [`FileHash::finish`] reports instead of a
/// digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Missing {
    pub from: u64,
    pub to: u64,
}

impl FileHash {
    /// A hash of a file of `len` bytes whose prefix and header are `head`, hashed at once.
    pub fn start(head: &[u8], len: u64) -> FileHash {
        let mut sha = Sha256::new();
        sha.update(head);
        FileHash {
            sha,
            cursor: head.len() as u64,
            len,
            resumed: None,
        }
    }

    /// The digest, when every byte of the file was hashed.
    pub fn finish(self) -> Result<Digest, Missing> {
        if self.cursor == self.len {
            return Ok(self.sha.finish());
        }
        let to = self.resumed.filter(|&r| r > self.cursor);
        Err(Missing {
            from: self.cursor,
            to: to.unwrap_or(self.len),
        })
    }

    /// Hashes the part of `bytes` (the file's bytes from `offset`, at or before the cursor) that
    /// lies past the cursor.
    fn feed(&mut self, offset: u64, bytes: &[u8]) {
        debug_assert!(offset <= self.cursor, "bytes fed past a gap");
        let end = offset + bytes.len() as u64;
        if end > self.cursor {
            self.sha.update(&bytes[(self.cursor - offset) as usize..]);
            self.cursor = end;
        }
    }

    /// Notes that bytes from `offset` on were read and not hashed.
    fn note_unhashed(&mut self, offset: u64) {
        if offset > self.cursor {
            self.resumed = Some(match self.resumed {
                Some(r) if r > self.cursor => r.min(offset),
                _ => offset,
            });
        }
    }
}

/// Where the file bytes of a chunk a worker finished are.
pub enum Raw<'w> {
    /// In the chunk's destinations (every segment copies).
    Dests,
    /// In the first bytes of the worker's buffer, which the queue may take (the worker gets
    /// another).
    Owned(&'w mut Vec<u8>),
    /// In a buffer the worker keeps: copied when they must wait.
    Lent(&'w [u8]),
}

/// One read's feed of one file's hash: chunks hashed in file order as they finish.
pub struct Ordered<'s> {
    slot: &'s Slot,
    queue: Mutex<Queue>,
    /// Signalled when the cursor moves on or a held buffer is freed.
    turned: Condvar,
    /// Per chunk of the plan: whether this read hashes it. A chunk is hashed when it starts at
    /// or before where the chunks claimed before it reach from the cursor; the others can never
    /// be reached in this read, and are not queued.
    hashable: Vec<bool>,
    /// Buffers the queue may hold (bytes converted on the way wait in them), after which a
    /// worker waits for the hash to catch up; 0: no limit (a single worker, which never queues).
    max_held: usize,
    /// A thread of its own hashes ([`Ordered::hash_in_order`]): workers only queue their chunks
    /// and go on reading. Else the worker that finishes the chunk at the cursor hashes.
    hasher: bool,
    /// Chunks this read hashes, and those hashed so far.
    to_hash: usize,
    hashed: std::sync::atomic::AtomicUsize,
    /// The workers are done: nothing more will be queued.
    read_done: AtomicBool,
}

struct Queue {
    /// None while a worker hashes.
    hash: Option<FileHash>,
    /// Finished chunks past the cursor, by (offset, chunk): their bytes when held here, None
    /// when they are in the chunk's destinations.
    waiting: BTreeMap<(u64, usize), Option<Vec<u8>>>,
    held: usize,
    /// Freed buffers, for workers that hand theirs over.
    spare: Vec<Vec<u8>>,
}

impl<'s> Ordered<'s> {
    /// Takes the hash out of `slot` for a read of `plan` by `workers` workers (its chunks of
    /// file `file` feed it); None when the hash was not started or another read holds it. The
    /// hash goes back to the slot when this is dropped.
    /// `hasher`: a thread of its own will hash ([`Ordered::hash_in_order`]).
    pub fn claim(
        slot: &'s Slot,
        plan: &ChunkPlan<'_>,
        file: usize,
        workers: usize,
        hasher: bool,
    ) -> Option<Self> {
        let mut hash = slot.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let mut hashable = vec![false; plan.chunks.len()];
        let mut reach = hash.cursor;
        for (i, chunk) in plan.chunks.iter().enumerate() {
            if chunk.file != file {
                continue;
            }
            if chunk.offset <= reach {
                hashable[i] = true;
                reach = reach.max(chunk.offset + chunk.len as u64);
            } else {
                hash.note_unhashed(chunk.offset);
            }
        }
        Some(Ordered {
            slot,
            queue: Mutex::new(Queue {
                hash: Some(hash),
                waiting: BTreeMap::new(),
                held: 0,
                spare: Vec::new(),
            }),
            turned: Condvar::new(),
            to_hash: hashable.iter().filter(|&&h| h).count(),
            hashable,
            max_held: if workers > 1 || hasher {
                workers.max(2)
            } else {
                0
            },
            hasher,
            hashed: std::sync::atomic::AtomicUsize::new(0),
            read_done: AtomicBool::new(false),
        })
    }

    /// The hashing thread's loop ([`Ordered::claim`]'s `hasher`): hashes the queued chunks in
    /// file order as they come, until every chunk this read hashes is hashed, the read stops
    /// (`stop`), or the workers are done ([`Ordered::read_done`]) and the next chunk at the
    /// cursor will never come (a failed read).
    /// Each input's hash (`slots`, in the plan's file order), taken for a read of `plan` by
    /// `workers` workers where it is asked for and started (given back to its source when
    /// dropped); `hasher`: each hashes on a thread of its own.
    pub fn claim_all(
        slots: impl Iterator<Item = Option<&'s Slot>>,
        plan: &ChunkPlan<'_>,
        workers: usize,
        hasher: bool,
    ) -> Vec<Option<Ordered<'s>>> {
        (slots.enumerate())
            .map(|(i, slot)| slot.and_then(|slot| Ordered::claim(slot, plan, i, workers, hasher)))
            .collect()
    }

    pub fn hash_in_order(&self, plan: &ChunkPlan<'_>, stop: &AtomicBool) {
        loop {
            let done = self.hashed.load(Ordering::Relaxed) >= self.to_hash;
            if done || stop.load(Ordering::Relaxed) {
                return;
            }
            let mut queue = self.lock();
            let ready = match (&queue.hash, queue.waiting.first_key_value()) {
                (Some(hash), Some((&(offset, _), _))) => offset <= hash.cursor,
                _ => false,
            };
            if ready {
                let hash = queue.hash.take().expect("looked at above");
                drop(queue);
                self.drain(hash, plan);
                continue;
            }
            if self.read_done.load(Ordering::Relaxed) {
                return;
            }
            drop(self.turned.wait_timeout(queue, WAIT));
        }
    }

    /// The workers are done: the hashing thread hashes what can be and ends.
    pub fn read_done(&self) {
        self.read_done.store(true, Ordering::Relaxed);
        let _queue = self.lock();
        self.turned.notify_all();
    }

    /// Chunk `index` of `plan` was read, its file bytes at `raw`: hashed now when it is at the
    /// cursor and no other worker hashes (then the queued chunks that follow on too), else
    /// queued. A worker holding its bytes in its own buffer waits while the queue holds
    /// `max_held` such buffers (or until `stop`).
    pub fn finished(
        &self,
        plan: &ChunkPlan<'_>,
        index: usize,
        mut raw: Raw<'_>,
        stop: &AtomicBool,
    ) {
        if !self.hashable[index] {
            return;
        }
        let chunk = &plan.chunks[index];
        let mut queue = self.lock();
        loop {
            let mine = !self.hasher;
            if let Some(mut hash) = queue.hash.take_if(|h| mine && chunk.offset <= h.cursor) {
                drop(queue);
                match raw {
                    Raw::Dests => feed_dests(&mut hash, plan, index),
                    Raw::Owned(bytes) => hash.feed(chunk.offset, &bytes[..chunk.len]),
                    Raw::Lent(bytes) => hash.feed(chunk.offset, bytes),
                }
                self.hashed.fetch_add(1, Ordering::Relaxed);
                return self.drain(hash, plan);
            }
            let holds = !matches!(raw, Raw::Dests);
            // The chunk the hash waits for (before every queued one) is taken whatever the queue
            // holds: with a hashing thread, its worker must not wait for room the hash makes.
            let first =
                (queue.waiting.first_key_value()).is_none_or(|(&(o, _), _)| chunk.offset < o);
            let room = self.max_held == 0 || queue.held < self.max_held;
            if !holds || room || (self.hasher && first) {
                let bytes = match &mut raw {
                    Raw::Dests => None,
                    Raw::Owned(buffer) => {
                        let other = queue.spare.pop().unwrap_or_default();
                        Some(std::mem::replace(*buffer, other))
                    }
                    Raw::Lent(bytes) => {
                        let mut copy = queue.spare.pop().unwrap_or_default();
                        copy.clear();
                        copy.extend_from_slice(bytes);
                        Some(copy)
                    }
                };
                queue.held += usize::from(bytes.is_some());
                queue.waiting.insert((chunk.offset, index), bytes);
                if self.hasher {
                    drop(queue);
                    self.turned.notify_all();
                }
                return;
            }
            if stop.load(Ordering::Relaxed) {
                return;
            }
            queue = (self.turned.wait_timeout(queue, WAIT))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Hashes the queued chunks that follow on from the cursor, one at a time (the queue is
    /// unlocked while hashing), then puts the hash back for the next worker at the cursor.
    fn drain(&self, mut hash: FileHash, plan: &ChunkPlan<'_>) {
        let mut freed: Option<Vec<u8>> = None;
        loop {
            let mut queue = self.lock();
            if let Some(buffer) = freed.take().filter(|_| queue.spare.len() < self.max_held) {
                queue.spare.push(buffer);
            }
            let next = queue
                .waiting
                .first_key_value()
                .map(|(&(offset, _), _)| offset);
            if next.is_none_or(|offset| offset > hash.cursor) {
                queue.hash = Some(hash);
                drop(queue);
                self.turned.notify_all();
                return;
            }
            let ((offset, index), bytes) = queue.waiting.pop_first().expect("looked at above");
            queue.held -= usize::from(bytes.is_some());
            drop(queue);
            match &bytes {
                Some(bytes) => hash.feed(offset, &bytes[..plan.chunks[index].len]),
                None => feed_dests(&mut hash, plan, index),
            }
            self.hashed.fetch_add(1, Ordering::Relaxed);
            if bytes.is_some() {
                self.turned.notify_all();
            }
            freed = bytes;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The read is over (done, failed or cancelled): the hash goes back to its slot, with the
/// chunks still queued (read past a gap the failure left) noted as unhashed. A hash lost to a
/// panic while hashing leaves the slot empty (not started).
impl Drop for Ordered<'_> {
    fn drop(&mut self) {
        let queue = self.queue.get_mut().unwrap_or_else(|p| p.into_inner());
        let Some(mut hash) = queue.hash.take() else {
            return;
        };
        if let Some(&(offset, _)) = queue.waiting.keys().next() {
            hash.note_unhashed(offset);
        }
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(hash);
    }
}

/// Hashes chunk `index`, whose file bytes are in its destinations (every segment copies).
fn feed_dests(hash: &mut FileHash, plan: &ChunkPlan<'_>, index: usize) {
    let chunk = &plan.chunks[index];
    let mut at = chunk.offset;
    for segment in &plan.segments[chunk.segments.clone()] {
        // SAFETY: the chunk is finished (each chunk is read once, by one worker) and the plan
        // is alive (this read's): nothing writes the segment while it is hashed.
        hash.feed(at, unsafe { segment.dest() });
        at += segment.len as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_fed_in_order_skipping_what_it_has() {
        let file: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut hash = FileHash::start(&file[..100], 1000);
        hash.feed(100, &file[100..400]);
        hash.feed(250, &file[250..600]); // overlaps: only 400..600 is new
        hash.feed(0, &file[..50]); // behind the cursor: nothing
        assert_eq!(
            hash.finish().unwrap_err(),
            Missing {
                from: 600,
                to: 1000
            }
        );
        let mut hash = FileHash::start(&file[..100], 1000);
        hash.feed(100, &file[100..]);
        assert_eq!(hash.finish().unwrap(), Digest::of(&file));
    }

    #[test]
    fn a_missing_range_ends_where_reads_resumed() {
        let mut hash = FileHash::start(&[0; 8], 100);
        hash.note_unhashed(60);
        hash.note_unhashed(40);
        hash.note_unhashed(8); // at the cursor: not past a gap
        assert_eq!(hash.finish().unwrap_err(), Missing { from: 8, to: 40 });
        let mut hash = FileHash::start(&[0; 8], 100);
        hash.note_unhashed(20);
        hash.feed(8, &[0; 30]); // the cursor passed 20: that note is stale
        hash.note_unhashed(90);
        assert_eq!(hash.finish().unwrap_err(), Missing { from: 38, to: 90 });
    }
}
