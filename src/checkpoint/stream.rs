//! A checkpoint streamed in batches: whole tensors in file order, at most half the in-flight
//! budget a batch (a larger tensor alone), the next batch read on a thread of its own while the
//! caller uses the current one, so at most two batches are in memory. Counts what it has handed
//! over, for progress. Dropping the stream stops the reader.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result, catch_panic};
use crate::format::dtype::Dtype;
use crate::read::buffer::TensorBytes;

/// A tensor of a batch: name, dtype, shape, bytes.
pub type Item = (String, Dtype, Vec<usize>, TensorBytes);

/// How often a waiting caller looks at its `poll` (Ctrl-C).
const POLL_EVERY: Duration = Duration::from_millis(50);

/// The in-flight budget of a whole load that reports progress: about 32 steps, 64 MiB to 1 GiB
/// each.
fn progress_budget(total: u64) -> u64 {
    (total / 32).clamp(64 << 20, 1 << 30)
}

pub struct Stream {
    batches: Receiver<Result<Vec<Item>>>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    /// Bytes of every tensor, and of those handed over so far.
    pub total: u64,
    done: AtomicU64,
}

impl Stream {
    /// Starts reading the first batch of `ckpt` at once, with at most `in_flight` bytes read and
    /// not yet used (None: a budget for a whole load reporting progress).
    pub fn start(ckpt: Arc<Checkpoint>, in_flight: Option<u64>) -> Stream {
        let total = ckpt.entries().map(|(_, t)| t.nbytes() as u64).sum();
        let max_bytes = (in_flight.unwrap_or_else(|| progress_budget(total)) / 2).max(1);
        // Capacity 0: the reader hands a batch over only when the caller asks, and then reads
        // the next one while the caller works on it.
        let (send, batches) = sync_channel(0);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let reader = std::thread::Builder::new()
            .name("safeload-stream".into())
            .spawn(move || {
                let all: Vec<_> = ckpt.entries().collect();
                for batch in Checkpoint::batches(&all, max_bytes) {
                    let mut poll = || stopped.load(Ordering::Relaxed);
                    let read =
                        catch_panic("the stream's reader", || ckpt.read(&batch, None, &mut poll));
                    let read = read.map(|(read, _)| {
                        (batch.iter().zip(read))
                            .map(|((_, t), (bytes, dtype))| {
                                (t.name.clone(), dtype, t.shape.clone(), bytes)
                            })
                            .collect()
                    });
                    let failed = read.is_err();
                    if send.send(read).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawning the stream's reader thread");
        Stream {
            batches,
            stop,
            reader: Some(reader),
            total,
            done: AtomicU64::new(0),
        }
    }

    /// Bytes of the tensors handed over so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The next batch (None after the last), waiting for it; `poll` returning true while
    /// waiting (Ctrl-C) stops the stream with [`Error::Cancelled`].
    pub fn next(&self, poll: &mut dyn FnMut() -> bool) -> Option<Result<Vec<Item>>> {
        loop {
            match self.batches.recv_timeout(POLL_EVERY) {
                Ok(batch) => {
                    // Views of a map were made when the reader got to them: handed out only
                    // while the file still covers them.
                    let batch = batch.and_then(|items| {
                        (items.into_iter())
                            .map(|(name, dtype, shape, bytes)| {
                                let bytes = bytes.checked(&name)?;
                                Ok((name, dtype, shape, bytes))
                            })
                            .collect::<Result<Vec<Item>>>()
                    });
                    if let Ok(items) = &batch {
                        let bytes: usize = items.iter().map(|i| i.3.len()).sum();
                        self.done.fetch_add(bytes as u64, Ordering::Relaxed);
                    }
                    return Some(batch);
                }
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) if poll() => {
                    self.stop.store(true, Ordering::Relaxed);
                    return Some(Err(Error::Cancelled));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Take what the reader is handing over, so it sees the stop flag and ends.
        while self.batches.recv().is_ok() {}
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::serialize;
    use crate::read::source::ReadOptions;
    use crate::read::strategy::Backend;

    #[test]
    fn batches_in_file_order_bounded_and_stoppable() {
        let dir = std::env::temp_dir().join(format!("safeload-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.safetensors");
        let data: Vec<Vec<u8>> = (0..6u8).map(|i| vec![i; 100 * (i as usize + 1)]).collect();
        let names: Vec<String> = (0..6).map(|i| format!("t{i}")).collect();
        let mut specs: Vec<serialize::TensorIn<'_>> = Vec::new();
        let shapes: Vec<Vec<usize>> = data.iter().map(|d| vec![d.len()]).collect();
        for i in 0..6 {
            specs.push(serialize::TensorIn {
                name: &names[i],
                dtype: Dtype::U8,
                shape: &shapes[i],
                data: &data[i],
            });
        }
        crate::storage::write::to_file(&path, &specs, None, false).unwrap();
        let open = || {
            Arc::new(
                Checkpoint::open(
                    std::slice::from_ref(&path),
                    Backend::Pread,
                    ReadOptions::default(),
                )
                .unwrap(),
            )
        };
        let ckpt = open();
        let stream = Stream::start(ckpt.clone(), Some(1400));
        let mut seen = Vec::new();
        while let Some(batch) = stream.next(&mut || false) {
            let batch = batch.unwrap();
            let bytes: usize = batch.iter().map(|(_, _, _, b)| b.len()).sum();
            assert!(bytes <= 700 || batch.len() == 1, "{bytes}");
            for (name, _, _, b) in batch {
                let i: usize = name[1..].parse().unwrap();
                assert_eq!(b.as_slice(), &data[i][..]);
                seen.push(i);
            }
        }
        let mut by_offset = ckpt
            .entries()
            .map(|(_, t)| t.name[1..].parse().unwrap())
            .collect::<Vec<usize>>();
        assert_eq!(seen, std::mem::take(&mut by_offset));
        let total = data.iter().map(|d| d.len() as u64).sum::<u64>();
        assert_eq!(ckpt.totals(true).bytes, total);
        assert_eq!((stream.done(), stream.total), (total, total));
        // Dropped after one batch: the reader stops, nothing hangs.
        let stream = Stream::start(open(), Some(200));
        assert!(stream.next(&mut || false).unwrap().is_ok());
        drop(stream);
        drop(ckpt); // Windows deletes no open file
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
