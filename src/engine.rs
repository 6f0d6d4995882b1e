//! The reader: workers claim chunks of a [`Plan`] in offset order and `preadv` them straight into
//! their destinations. One pass over every byte, no intermediate copy, no Python.
//!
//! The calling thread does not read when workers run: it waits and calls `poll` every few
//! milliseconds, so a binding can check for Ctrl-C and cancel promptly.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::plan::{Chunk, Plan, Segment};

/// How often the waiting thread calls `poll`.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Below this many bytes a plan is read on the calling thread.
const INLINE_BYTES: u64 = 4 << 20;

/// A file the plan reads from.
pub struct Input<'a> {
    pub path: &'a Path,
    pub file: &'a File,
}

/// Worker count when the caller does not choose: one per core, at least 2, at most 8.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
}

/// Reads every chunk of `plan`. `poll` returns true to cancel (then the result is `Cancelled`).
pub fn execute(
    inputs: &[Input<'_>],
    plan: &Plan,
    threads: usize,
    poll: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let threads = threads.max(1).min(plan.chunks.len().max(1));
    if threads == 1 || plan.total_bytes() < INLINE_BYTES {
        for chunk in &plan.chunks {
            if poll() {
                return Err(Error::Cancelled);
            }
            read_chunk(inputs, plan, chunk)?;
        }
        return Ok(());
    }

    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let finished = (Mutex::new(0usize), Condvar::new());
    let mut cancelled = false;

    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(chunk) = plan.chunks.get(i) else {
                        break;
                    };
                    if let Err(e) = read_chunk(inputs, plan, chunk) {
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
        let (count, cv) = &finished;
        let mut done = count.lock().unwrap_or_else(|p| p.into_inner());
        while *done < threads {
            done = cv
                .wait_timeout(done, POLL_INTERVAL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if !cancelled && *done < threads && poll() {
                cancelled = true;
                stop.store(true, Ordering::Relaxed);
            }
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if cancelled {
        return Err(Error::Cancelled);
    }
    Ok(())
}

fn read_chunk(inputs: &[Input<'_>], plan: &Plan, chunk: &Chunk) -> Result<()> {
    let input = &inputs[chunk.file];
    let segments = &plan.segments[chunk.segments.clone()];
    preadv_exact(input.file, chunk.offset, segments).map_err(|(done, source)| {
        let tensor = tensor_at(segments, done);
        Error::Read {
            path: input.path.to_path_buf(),
            tensor: plan.tensors[tensor].clone(),
            offset: chunk.offset + done as u64,
            source,
        }
    })
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

/// Fills every segment from `offset` on, retrying short reads and EINTR.
/// On failure returns how many bytes were read before it.
fn preadv_exact(
    file: &File,
    offset: u64,
    segments: &[Segment],
) -> std::result::Result<(), (usize, io::Error)> {
    let mut iov: Vec<libc::iovec> = segments
        .iter()
        .map(|s| libc::iovec {
            iov_base: s.dest.cast(),
            iov_len: s.len,
        })
        .collect();
    let fd = file.as_raw_fd();
    let mut first = 0usize;
    let mut done = 0usize;
    while first < iov.len() {
        let count = (iov.len() - first).min(crate::plan::MAX_SEGMENTS) as libc::c_int;
        let at = (offset + done as u64) as libc::off_t;
        // SAFETY: each iovec points into a live destination owned by the caller of `execute`,
        // disjoint from every other chunk's (Plan::add contract).
        let n = unsafe { libc::preadv(fd, iov[first..].as_ptr(), count, at) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err((done, e));
        }
        if n == 0 {
            let missing: usize = iov[first..].iter().map(|v| v.iov_len).sum();
            return Err((
                done,
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("file ended early, {missing} bytes missing (truncated while reading?)"),
                ),
            ));
        }
        let mut n = n as usize;
        done += n;
        while n > 0 {
            let v = &mut iov[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: advancing within the same destination.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
        while first < iov.len() && iov[first].iov_len == 0 {
            first += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(bytes: &[u8]) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!(
            "safeload-engine-{}-{}",
            std::process::id(),
            bytes.len()
        ));
        File::create(&path).unwrap().write_all(bytes).unwrap();
        let file = File::open(&path).unwrap();
        (path, file)
    }

    #[test]
    fn reads_every_byte_with_threads_and_odd_sizes() {
        let data: Vec<u8> = (0..20_000_003u32).map(|i| (i % 251) as u8).collect();
        let (path, file) = temp_file(&data);
        let sizes = [
            1usize,
            7,
            4096,
            3 << 20,
            9_999_999,
            0,
            20_000_003 - (1 + 7 + 4096 + (3 << 20) + 9_999_999),
        ];
        let bufs = crate::buffer::allocate(&sizes).unwrap();
        for threads in [1, 2, 5] {
            let mut plan = Plan::new(1 << 20);
            let mut at = 0u64;
            for (b, &len) in bufs.iter().zip(&sizes) {
                plan.add(0, at, b.as_mut_ptr(), len, "t");
                at += len as u64;
            }
            let inputs = [Input {
                path: &path,
                file: &file,
            }];
            execute(&inputs, &plan, threads, &mut || false).unwrap();
            let mut at = 0usize;
            for (b, &len) in bufs.iter().zip(&sizes) {
                assert_eq!(b.as_slice(), &data[at..at + len]);
                at += len;
            }
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn short_file_names_tensor_and_offset() {
        let (path, file) = temp_file(&[1u8; 100]);
        let bufs = crate::buffer::allocate(&[50, 80]).unwrap();
        let mut plan = Plan::new(1 << 20);
        plan.add(0, 0, bufs[0].as_mut_ptr(), 50, "first");
        plan.add(0, 50, bufs[1].as_mut_ptr(), 80, "second");
        let inputs = [Input {
            path: &path,
            file: &file,
        }];
        let err = execute(&inputs, &plan, 1, &mut || false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor second") && err.contains("offset 100"),
            "{err}"
        );
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn poll_cancels() {
        let (path, file) = temp_file(&[0u8; 64 << 10]);
        let bufs = crate::buffer::allocate(&[64 << 10]).unwrap();
        let mut plan = Plan::new(4096);
        plan.add(0, 0, bufs[0].as_mut_ptr(), 64 << 10, "t");
        let inputs = [Input {
            path: &path,
            file: &file,
        }];
        let err = execute(&inputs, &plan, 1, &mut || true).unwrap_err();
        assert!(matches!(err, Error::Cancelled));
        std::fs::remove_file(path).unwrap();
    }
}
