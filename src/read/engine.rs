//! The reader: workers claim chunks of a [`ChunkPlan`] in offset order and `preadv` them straight into
//! their destinations. One pass over every byte, no intermediate copy, no Python. A chunk read
//! in full still fails when the file no longer covers it ([`backing::confirm_covered`]).
//!
//! The calling thread does not read when workers run: it waits and calls `poll` every few
//! milliseconds, so a binding can check for Ctrl-C and cancel promptly.
//!
//! An input whose hash is asked for feeds it in the same pass ([`crate::read::filehash`]): each
//! finished chunk's file bytes, from its destinations, or from the worker's buffer where they
//! were converted; nothing is read twice.

use std::io::{self, IoSliceMut};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::platform::{self, Uncached};
use crate::read::buffer::Region;
use crate::read::counts::ReadCounts;
use crate::read::filehash::{Ordered, Raw, Slot};
use crate::read::plan::{Chunk, ChunkPlan, Segment, Transform, distribute};
use crate::read::strategy;
use crate::storage::backing::{self, Backing, Reader, ended_early};

/// How often the waiting thread calls `poll`.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A file (or an object in a store) the plan reads from.
pub struct Input<'a> {
    pub path: &'a Path,
    pub backing: &'a Backing,
    /// The same file opened to read around the page cache.
    pub direct: Option<&'a Uncached>,
    /// The file's hash, which this read feeds (in file order, as far as its chunks reach) when
    /// it has been started; None: not hashed.
    pub hash: Option<&'a Slot>,
}

/// How a plan is executed.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub threads: usize,
    /// Each worker opens its own descriptor (network filesystems serialise reads on one fd).
    pub own_fds: bool,
    /// The read runs on the calling thread (the plan's rule: `strategy::runs_inline`).
    pub inline: bool,
}

/// One worker's resources: its reader of each input, its bounce buffer for aligned uncached reads
/// and its scratch buffer for chunks that convert.
struct Worker<'a> {
    inputs: &'a [Input<'a>],
    readers: Vec<Reader<'a>>,
    bounce: Option<Region>,
    scratch: Vec<u8>,
    direct_refused: &'a AtomicBool,
    /// Set when the read is stopped (Ctrl-C, another worker's error): remote reads give up.
    stop: &'a AtomicBool,
}

impl<'a> Worker<'a> {
    fn new(
        inputs: &'a [Input<'a>],
        own_fds: bool,
        direct_refused: &'a AtomicBool,
        stop: &'a AtomicBool,
    ) -> Self {
        Worker {
            inputs,
            readers: (inputs.iter())
                .map(|i| i.backing.reader(i.path, own_fds))
                .collect(),
            bounce: None,
            scratch: Vec::new(),
            direct_refused,
            stop,
        }
    }

    /// Reads chunk `index`, then feeds `hash` (its file's, when hashed) with its file bytes.
    fn read(
        &mut self,
        plan: &ChunkPlan<'_>,
        index: usize,
        hash: Option<&Ordered<'_>>,
    ) -> Result<()> {
        let chunk = &plan.chunks[index];
        if hash.is_some() {
            self.ask_ahead(plan, index);
        }
        let raw = self.read_raw(plan, chunk)?;
        if let Some(hash) = hash {
            let len = chunk.len;
            let raw = match raw {
                RawAt::Dests => Raw::Dests,
                RawAt::Scratch => Raw::Owned(&mut self.scratch),
                RawAt::Bounce { head } => Raw::Lent(
                    &(self.bounce.as_mut().and_then(Region::as_bytes_mut))
                        .expect("the bounce buffer the chunk was read into")
                        [head..head + len],
                ),
            };
            hash.finished(plan, index, raw, self.stop);
        }
        Ok(())
    }

    /// A read that hashes keeps to the cores its hashes leave (one reader on two cores): before
    /// each chunk it asks the storage for the next one of the same input, so the disk reads on
    /// while this reader waits for the chunk in hand. Not for uncached reads (they would read it
    /// again).
    fn ask_ahead(&mut self, plan: &ChunkPlan<'_>, index: usize) {
        let (chunk, next) = (&plan.chunks[index], plan.chunks.get(index + 1));
        let Some(next) = next.filter(|n| n.file == chunk.file) else {
            return;
        };
        if self.inputs[chunk.file].direct.is_none() {
            self.readers[chunk.file].ask_ahead(next.offset, next.len as u64);
        }
    }

    /// Reads one chunk into its destinations; returns where its file bytes are.
    fn read_raw(&mut self, plan: &ChunkPlan<'_>, chunk: &Chunk) -> Result<RawAt> {
        let input = &self.inputs[chunk.file];
        let segments = &plan.segments[chunk.segments.clone()];
        let to_error = |(done, source): (usize, io::Error)| Error::Read {
            path: input.path.to_path_buf(),
            tensor: plan.tensors[tensor_at(segments, done)].clone(),
            offset: chunk.offset + done as u64,
            source,
        };
        let direct = input
            .direct
            .filter(|_| !self.direct_refused.load(Ordering::Relaxed));
        let result = match direct.map(|d| self.read_chunk(Some(d), chunk, segments)) {
            // The filesystem refuses uncached reads: buffered from now on, for every worker.
            Some(Err((_, e))) if platform::uncached_refused(&e) => {
                self.direct_refused.store(true, Ordering::Relaxed);
                self.read_chunk(None, chunk, segments)
            }
            Some(done) => done,
            None => self.read_chunk(None, chunk, segments),
        };
        result.map_err(to_error)
    }

    /// Reads one chunk: straight into its segments when nothing converts and the handle has no
    /// alignment rule; else its bytes into a worker buffer first, then copied or converted out.
    /// Through `direct` (the file opened to read around the page cache) where given, else
    /// through the input's reader (the page cache, or a store's ranged GETs).
    fn read_chunk(
        &mut self,
        direct: Option<&Uncached>,
        chunk: &Chunk,
        segments: &[Segment],
    ) -> IoResult<RawAt> {
        let aligned = direct.is_some_and(|d| d.align > 1);
        let converts = segments.iter().any(|s| s.transform != Transform::Copy);
        if !aligned && !converts {
            let mut bufs: Vec<IoSliceMut<'_>> = segments
                .iter()
                // SAFETY: this worker is the only one handling the chunk, while the plan is alive.
                .map(|s| IoSliceMut::new(unsafe { s.dest_mut() }))
                .collect();
            match direct {
                Some(d) => {
                    prefault(bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())));
                    backing::read_exact_into(&d.file, chunk.offset, &mut bufs)?;
                }
                None => {
                    let reader = &mut self.readers[chunk.file];
                    // Asked ahead first: the storage reads the chunk while this thread maps its
                    // destination pages, rather than the two taking turns.
                    reader.ask_ahead(chunk.offset, chunk.len as u64);
                    prefault(bufs.iter_mut().map(|b| (b.as_mut_ptr(), b.len())));
                    reader.read_exact_into(chunk.offset, &mut bufs, self.stop)?;
                }
            }
            return Ok(RawAt::Dests);
        }
        if self.scratch.len() < chunk.len {
            self.scratch.resize(chunk.len, 0);
        }
        let (bytes, at) = match direct {
            Some(d) if aligned => {
                let head = (chunk.offset % d.align) as usize;
                (self.read_aligned(d, chunk)?, RawAt::Bounce { head })
            }
            _ => {
                let buf = &mut self.scratch[..chunk.len];
                let bufs = &mut [IoSliceMut::new(buf)];
                match direct {
                    Some(d) => backing::read_exact_into(&d.file, chunk.offset, bufs)?,
                    None => {
                        (self.readers[chunk.file]).read_exact_into(chunk.offset, bufs, self.stop)?
                    }
                }
                (&self.scratch[..chunk.len], RawAt::Scratch)
            }
        };
        // SAFETY: this worker is the only one handling the chunk, while the plan is alive.
        unsafe { distribute(bytes, segments) }?;
        // Copied out: the destinations hold the file's bytes too.
        Ok(if converts { at } else { RawAt::Dests })
    }

    /// Reads the aligned span around the chunk uncached into the worker's bounce buffer; returns
    /// the chunk's own bytes once the file is confirmed to still cover them.
    fn read_aligned(&mut self, direct: &Uncached, chunk: &Chunk) -> IoBytes<'_> {
        let align = direct.align;
        let start = chunk.offset / align * align;
        let end = (chunk.offset + chunk.len as u64).next_multiple_of(align);
        let span = (end - start) as usize;
        if self.bounce.as_ref().is_none_or(|b| b.len() < span) {
            self.bounce = Some(Region::alloc_mapped(span).map_err(|e| (0, e))?);
        }
        let head = (chunk.offset - start) as usize;
        let need = head + chunk.len;
        let bounce = self
            .bounce
            .as_mut()
            .and_then(Region::as_bytes_mut)
            .expect("a mapped bounce buffer, allocated above");
        let mut got = 0usize;
        while got < need {
            // `got` stays a multiple of `align` (checked below), as uncached reads require; the
            // bounce buffer is aligned to the OS's map alignment, a multiple of `align`.
            match platform::read_at(&direct.file, &mut bounce[got..span], start + got as u64) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err((got.saturating_sub(head), e)),
                Ok(0) => return Err((got.saturating_sub(head), ended_early(need - got))),
                Ok(n) => got += n,
            }
            if got < need && !(got as u64).is_multiple_of(align) {
                // An unaligned short read cannot be continued uncached: the rest buffered.
                let from = got.max(head);
                let rest = &mut [IoSliceMut::new(&mut bounce[from..need])];
                (self.readers[chunk.file])
                    .read_exact_into(start + from as u64, rest, self.stop)
                    .map_err(|(n, e)| (from - head + n, e))?;
                break;
            }
        }
        backing::confirm_covered(&direct.file, chunk.offset, chunk.len)?;
        Ok(&bounce[head..need])
    }
}

/// Where a chunk's file bytes are once it is read (what its hash is computed from).
#[derive(Clone, Copy)]
enum RawAt {
    /// In its destinations: every segment copies.
    Dests,
    /// In the first bytes of the worker's scratch buffer.
    Scratch,
    /// In the worker's bounce buffer, from `head` on.
    Bounce { head: usize },
}

/// On failure: how many of the chunk's bytes were read before the error, and the error.
type IoResult<T = ()> = std::result::Result<T, (usize, io::Error)>;
type IoBytes<'b> = std::result::Result<&'b [u8], (usize, io::Error)>;

/// Reads every chunk of `plan`. `poll` returns true to cancel (then the result is `Cancelled`).
pub fn execute(
    inputs: &[Input<'_>],
    plan: &ChunkPlan<'_>,
    settings: Settings,
    poll: &mut dyn FnMut() -> bool,
) -> Result<ReadCounts> {
    let started = Instant::now();
    let threads = settings.threads.max(1).min(plan.chunks.len().max(1));
    let direct_refused = AtomicBool::new(false);
    let report = |threads| ReadCounts {
        bytes: plan.total_bytes(),
        seconds: started.elapsed().as_secs_f64(),
        threads,
        direct_refused: direct_refused.load(Ordering::Relaxed),
    };
    let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
    let inline = settings.inline;
    let slots = inputs.iter().map(|i| i.hash);
    let hashes = Ordered::claim_all(slots, plan, if inline { 1 } else { threads }, !inline);
    let hash_of = |chunk: usize| hashes[plan.chunks[chunk].file].as_ref();
    let threads = strategy::readers_beside(threads, hashes.iter().flatten().count());
    if inline {
        let mut worker = Worker::new(inputs, false, &direct_refused, &stop);
        for i in 0..plan.chunks.len() {
            if poll() {
                return Err(Error::Cancelled);
            }
            worker.read(plan, i, hash_of(i))?;
        }
        return Ok(report(1));
    }

    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let finished = (Mutex::new(0usize), Condvar::new());

    let cancelled = std::thread::scope(|scope| {
        for hash in hashes.iter().flatten() {
            scope.spawn(|| hash.hash_in_order(plan, &stop));
        }
        for _ in 0..threads {
            scope.spawn(|| {
                let mut worker = Worker::new(inputs, settings.own_fds, &direct_refused, &stop);
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= plan.chunks.len() {
                        break;
                    }
                    if let Err(e) = worker.read(plan, i, hash_of(i)) {
                        stop.store(true, Ordering::Relaxed);
                        failure
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        break;
                    }
                }
                let (count, cv) = &finished;
                *count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                cv.notify_one();
            });
        }
        let cancelled = wait_for(&finished, threads, &stop, poll);
        for hash in hashes.iter().flatten() {
            hash.read_done();
        }
        cancelled
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if cancelled {
        return Err(Error::Cancelled);
    }
    Ok(report(threads))
}

/// Waits until the `threads` workers have counted themselves in `finished`, calling `poll` every
/// [`POLL_INTERVAL`]; when it asks to cancel, sets `stop` and returns true (after the wait).
fn wait_for(
    finished: &(Mutex<usize>, Condvar),
    threads: usize,
    stop: &AtomicBool,
    poll: &mut dyn FnMut() -> bool,
) -> bool {
    let (count, cv) = finished;
    let mut cancelled = false;
    let mut done = count.lock().unwrap_or_else(|p| p.into_inner());
    while *done < threads {
        done = (cv.wait_timeout(done, POLL_INTERVAL))
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if !cancelled && *done < threads && poll() {
            cancelled = true;
            stop.store(true, Ordering::Relaxed);
        }
    }
    cancelled
}

/// The tensor whose bytes sit `pos` bytes into the chunk.
fn tensor_at(segments: &[Segment], mut pos: usize) -> usize {
    for s in segments {
        if pos < s.len {
            return s.tensor;
        }
        pos -= s.len;
    }
    segments.last().map_or(0, |s| s.tensor)
}

/// Maps the destination pages of one read ahead of it ([`platform::prefault`]): destinations
/// that follow each other in memory (small tensors packed in an arena) as one span.
fn prefault(dests: impl Iterator<Item = (*mut u8, usize)>) {
    let mut span: Option<(usize, usize)> = None;
    for (ptr, len) in dests {
        let (start, end) = (ptr as usize, ptr as usize + len);
        span = match span {
            Some((s, e)) if start >= e && start - e < 4096 => Some((s, end)),
            Some((s, e)) => {
                platform::prefault(s as *mut u8, e - s);
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((s, e)) = span {
        platform::prefault(s as *mut u8, e - s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;

    fn temp_file(bytes: &[u8], tag: &str) -> (std::path::PathBuf, Backing) {
        let path =
            std::env::temp_dir().join(format!("safeload-engine-{}-{tag}", std::process::id()));
        File::create(&path).unwrap().write_all(bytes).unwrap();
        let file = File::open(&path).unwrap();
        (path, Backing::from(file))
    }

    fn open_direct(path: &Path) -> Option<Uncached> {
        platform::open_uncached(path)
    }

    fn settings(threads: usize) -> Settings {
        Settings {
            threads,
            own_fds: false,
            inline: threads == 1,
        }
    }

    #[test]
    fn reads_every_byte_with_threads_odd_sizes_and_direct_io() {
        let data: Vec<u8> = (0..20_000_003u32).map(|i| (i % 251) as u8).collect();
        let (path, file) = temp_file(&data, "every");
        let direct = open_direct(&path);
        let sizes = [
            1usize,
            7,
            4096,
            3 << 20,
            9_999_999,
            0,
            20_000_003 - (1 + 7 + 4096 + (3 << 20) + 9_999_999),
        ];
        for (threads, own_fds, use_direct) in [
            (1, false, false),
            (2, false, true),
            (5, true, false),
            (3, true, true),
        ] {
            let mut bufs = crate::read::buffer::allocate(&sizes).unwrap();
            let mut plan = ChunkPlan::new(1 << 20);
            let mut at = 0u64;
            for (b, &len) in bufs.iter_mut().zip(&sizes) {
                plan.add(0, at, b.as_mut_slice(), "t");
                at += len as u64;
            }
            let inputs = [Input {
                path: &path,
                backing: &file,
                direct: if use_direct { direct.as_ref() } else { None },
                hash: None,
            }];
            let report = execute(
                &inputs,
                &plan,
                Settings {
                    threads,
                    own_fds,
                    inline: false,
                },
                &mut || false,
            )
            .unwrap();
            assert_eq!(report.bytes, data.len() as u64);
            drop(plan);
            let mut at = 0usize;
            for (b, &len) in bufs.iter().zip(&sizes) {
                assert_eq!(
                    b.as_slice(),
                    &data[at..at + len],
                    "threads {threads} direct {use_direct}"
                );
                at += len;
            }
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn short_file_names_tensor_and_offset() {
        let (path, file) = temp_file(&[1u8; 100], "short");
        let direct = open_direct(&path);
        for direct in [None, direct.as_ref()] {
            let mut bufs = crate::read::buffer::allocate(&[50, 80]).unwrap();
            let [first, second] = &mut bufs[..] else {
                unreachable!()
            };
            let mut plan = ChunkPlan::new(1 << 20);
            plan.add(0, 0, first.as_mut_slice(), "first");
            plan.add(0, 50, second.as_mut_slice(), "second");
            let inputs = [Input {
                path: &path,
                backing: &file,
                direct,
                hash: None,
            }];
            let err = execute(&inputs, &plan, settings(1), &mut || false)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("tensor second") && err.contains("offset 100"),
                "{err}"
            );
        }
        std::fs::remove_file(path).unwrap();
    }

    /// A read that gets every byte it asked for, of a file whose length says it no longer holds
    /// them, is what a read racing a truncation returns on Linux: the size is lowered first, the
    /// cut-off part of the page the read holds zeroed after. `/dev/zero` is such a file at once:
    /// every read is answered in full (zeros), and its length is 0.
    #[cfg(target_os = "linux")]
    #[test]
    fn full_read_the_file_no_longer_covers_names_tensor_and_offset() {
        let path = Path::new("/dev/zero");
        let zeros = Backing::from(File::open(path).unwrap());
        for converts in [false, true] {
            let mut bufs =
                crate::read::buffer::allocate(&[50, if converts { 160 } else { 80 }]).unwrap();
            let [first, second] = &mut bufs[..] else {
                unreachable!()
            };
            let mut plan = ChunkPlan::new(1 << 20);
            plan.add(0, 4096, first.as_mut_slice(), "first");
            let (f16, f32) = (
                crate::format::dtype::Dtype::F16,
                crate::format::dtype::Dtype::F32,
            );
            match converts {
                true => plan.add_converting(0, 4146, second.as_mut_slice(), f16, f32, "second"),
                false => plan.add(0, 4146, second.as_mut_slice(), "second"),
            }
            let inputs = [Input {
                path,
                backing: &zeros,
                direct: None,
                hash: None,
            }];
            let err = execute(&inputs, &plan, settings(1), &mut || false)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("tensor first")
                    && err.contains("offset 4096")
                    && err.contains("130 bytes missing (truncated while reading?)"),
                "converts {converts}: {err}"
            );
        }
    }

    #[test]
    fn poll_cancels() {
        let (path, file) = temp_file(&[0u8; 64 << 10], "cancel");
        let mut bufs = crate::read::buffer::allocate(&[64 << 10]).unwrap();
        let mut plan = ChunkPlan::new(4096);
        plan.add(0, 0, bufs[0].as_mut_slice(), "t");
        let inputs = [Input {
            path: &path,
            backing: &file,
            direct: None,
            hash: None,
        }];
        let err = execute(&inputs, &plan, settings(1), &mut || true).unwrap_err();
        assert!(matches!(err, Error::Cancelled));
        std::fs::remove_file(path).unwrap();
    }
}
