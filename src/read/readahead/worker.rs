//! The background workers: started on the first request, stopped with the read-ahead, each
//! claiming batches of the walk and reading them (owned memory, provided destinations, or map
//! pages made resident).

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::format::header::TensorInfo;
use crate::platform;
use crate::read::buffer::{Fresh, TensorBytes};
use crate::read::counts::ReadCounts;
use crate::read::source;
use crate::read::strategy::Strategy;

use super::{BATCH_WORKERS, Mode, PREFETCH_BYTES, ReadAhead, Shared, Slot, State};

/// Workers populating a map (each waits on its own 16 MiB at a time).
const PAGE_CACHE_WORKERS: usize = 4;

impl ReadAhead {
    /// Closes: stops the workers and frees what was not taken (see the `Drop` for page-cache
    /// hints that finish on their own).
    pub fn close(&self) {
        if self.forked() {
            return self.stop();
        }
        let finish = self.shared.mode == Mode::PageCache && self.shared.lock().want_all;
        if !finish {
            self.stop();
        }
    }

    /// Stops the workers (a read in flight is cancelled) and frees what was not taken.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if self.forked() {
            // The parent's threads and locks: nothing here to join or free (the child's copy
            // of what they read goes with the process).
            if let Ok(mut workers) = self.workers.try_lock() {
                std::mem::take(&mut *workers)
                    .into_iter()
                    .for_each(std::mem::forget);
            }
            return;
        }
        self.shared.cv.notify_all();
        self.shared.room.notify_all();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
        let mut state = self.shared.lock();
        for slot in state.slots.iter_mut() {
            if matches!(slot, Slot::Ready(_) | Slot::Provided(_) | Slot::Wanted) {
                *slot = Slot::Done;
            }
        }
        state.held = 0;
    }

    /// Waits for the workers to finish the walk (after [`ReadAhead::want_all`], when the window
    /// cannot stall them: a walk that makes pages resident, tests).
    pub(super) fn finish(&self) {
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            w.join().unwrap();
        }
    }

    pub(super) fn spawn(&self, state: &mut MutexGuard<'_, State>) {
        state.started = true;
        let generation = platform::fork_generation() + 1;
        self.shared.started_in.store(generation, Ordering::Relaxed);
        let count = match self.shared.mode {
            Mode::Owned(_) | Mode::Provided => BATCH_WORKERS,
            // Populating waits for its pages: several in flight keep the disk's queue full.
            Mode::PageCache => PAGE_CACHE_WORKERS,
        };
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..count {
            let shared = self.shared.clone();
            shared.running.fetch_add(1, Ordering::Relaxed);
            let spawned = std::thread::Builder::new()
                .name("safeload-readahead".into())
                .spawn(move || {
                    shared.work();
                    shared.running.fetch_sub(1, Ordering::Relaxed);
                    shared.cv.notify_all();
                });
            // Without a thread there is no read-ahead: every request reads on demand.
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(_) => {
                    self.shared.running.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for ReadAhead {
    /// Stops the workers, except page-cache hints for a file whose every tensor was asked for
    /// (`get_tensors()` on a map, as `load_file` does before closing the handle): they finish the
    /// walk on their own (it ends at the last tensor), so the caller's first touches find the
    /// pages read. They hold the file open until then, as the map's views do.
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    /// A worker: claims batches in the walk's order and reads them until the walk is over or
    /// stopped.
    fn work(&self) {
        if self.lock().by_name {
            self.name_order(); // made here, not under the lock of a claim
        }
        loop {
            let batch = {
                let mut state = self.lock();
                loop {
                    if self.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Some(batch) = self.claim(&mut state) {
                        if self.mode == Mode::PageCache {
                            // Counted when claimed, under the lock, not when done: a caller may
                            // take (map) a tensor this batch is still bringing in, and the count
                            // must not depend on who is first.
                            let asked: usize =
                                batch.iter().map(|(i, _)| self.items[*i].nbytes()).sum();
                            state.hinted += asked as u64;
                        }
                        break batch;
                    }
                    if state.scanned >= state.slots.len() {
                        return;
                    }
                    state = self.wait_for_room(state);
                }
            };
            let (batch, dests): (Vec<usize>, Vec<Option<Fresh>>) = batch.into_iter().unzip();
            let infos: Vec<&TensorInfo> = batch.iter().map(|&i| &self.items[i]).collect();
            let read =
                crate::error::catch_panic("a read-ahead worker", || self.read(&infos, dests));
            let mut state = self.lock();
            match read {
                Ok((buffers, report)) => {
                    self.tally.add(self.mode.strategy(), &report);
                    if self.mode != Mode::PageCache {
                        state.bytes_read += report.bytes;
                    }
                    state.seconds += report.seconds;
                    state.direct_refused |= report.direct_refused;
                    for (&i, bytes) in batch.iter().zip(buffers) {
                        if matches!(state.slots[i], Slot::Reading) {
                            state.slots[i] = Slot::Ready(bytes);
                        }
                    }
                }
                // Failed or cancelled: the callers read these themselves and get the error.
                Err(_) => {
                    for &i in &batch {
                        if matches!(state.slots[i], Slot::Reading) {
                            state.slots[i] = Slot::Done;
                            state.held -= self.items[i].nbytes() as u64;
                        }
                    }
                }
            }
            self.wake(&state);
        }
    }

    /// Reads `infos` into their provided destinations, with pread.
    pub(super) fn read_provided(
        &self,
        infos: &[&TensorInfo],
        mut dests: Vec<Fresh>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Vec<TensorBytes>, ReadCounts)> {
        let source = &*self.source;
        let targets = infos
            .iter()
            .zip(dests.iter_mut())
            .map(|(info, dest)| source::Target {
                source: 0,
                info,
                dtype: info.dtype,
                dest: dest.as_mut_slice(),
            })
            .collect();
        let report =
            source::read_targets(&[source], targets, &[Strategy::Pread], &self.opts, poll)?;
        Ok((dests.into_iter().map(Fresh::into_shared).collect(), report))
    }

    /// [`Shared::populate_span`] of one tensor's bytes.
    pub(super) fn populate(&self, info: &TensorInfo) {
        self.populate_span(&info.name, info.begin, info.end);
    }

    /// Makes data bytes `[begin, end)` (`tensor`'s, and maybe those of the tensors after it)
    /// resident in the file's map where the OS can (the pages are read and mapped, so the
    /// caller's touches do not fault), else hints them to the page cache; 16 MiB at a time,
    /// until stopped. Errors (a file cut short) are left to the touch.
    fn populate_span(&self, tensor: &str, begin: usize, end: usize) {
        let source = &*self.source;
        let span = source.map_span_to_populate(tensor, begin, end);
        let (Ok(span), Some(file)) = (span, source.backing.file()) else {
            return;
        };
        // The whole range is queued first, so the disk reads ahead of the waits below.
        let data_start = source.header.data_start();
        platform::prefetch(file, data_start + begin as u64, span.len() as u64);
        let mut at = 0usize;
        while at < span.len() && !self.stop.load(Ordering::Relaxed) {
            let len = (PREFETCH_BYTES as usize).min(span.len() - at);
            // SAFETY: `at < span.len()`: in bounds of the span's live map.
            let ptr = unsafe { span.as_mut_ptr().add(at) };
            let populated =
                std::ptr::NonNull::new(ptr).is_some_and(|p| platform::populate_mapped(p, len));
            if !populated {
                platform::prefetch(file, data_start + (begin + at) as u64, len as u64);
            }
            at += len;
        }
    }

    /// Reads one batch: owned buffers, provided destinations (`dests`), or resident map pages
    /// (None for each).
    fn read(
        &self,
        infos: &[&TensorInfo],
        dests: Vec<Option<Fresh>>,
    ) -> Result<(Vec<Option<TensorBytes>>, ReadCounts)> {
        let source = &*self.source;
        match self.mode {
            Mode::Provided => {
                let dests = dests
                    .into_iter()
                    .map(|d| d.expect("claimed provided"))
                    .collect();
                let mut poll = || self.stop.load(Ordering::Relaxed);
                let (read, report) = self.read_provided(infos, dests, &mut poll)?;
                Ok((read.into_iter().map(Some).collect(), report))
            }
            Mode::Owned(strategy) => {
                let wanted: Vec<(usize, &TensorInfo)> = infos.iter().map(|t| (0, *t)).collect();
                let mut poll = || self.stop.load(Ordering::Relaxed);
                let (tensors, report) = source::read_or_map(
                    &[source],
                    &wanted,
                    &[strategy],
                    None,
                    &self.opts,
                    &mut poll,
                )?;
                Ok((tensors.into_iter().map(|(b, _)| Some(b)).collect(), report))
            }
            Mode::PageCache => {
                for (first, begin, end) in spans(infos) {
                    self.populate_span(first, begin, end);
                }
                Ok((infos.iter().map(|_| None).collect(), ReadCounts::default()))
            }
        }
    }
}

/// The data spans `[begin, end)` of `infos` (in file order, whatever order `infos` are in),
/// tensors that follow each other in the file joined into one, each with the name of its first
/// tensor: a batch of thousands of small tensors is made resident with a few system calls, not two
/// for each tensor, whose cost would show in a cold load of many small tensors. A gap (a tensor
/// left out of a plan, rows not asked for) is not read.
fn spans<'a>(infos: &[&'a TensorInfo]) -> Vec<(&'a str, usize, usize)> {
    let mut infos = infos.to_vec();
    infos.sort_by_key(|t| t.begin); // a walk in name order claims tensors of several runs
    let mut out: Vec<(&str, usize, usize)> = Vec::new();
    for t in infos {
        match out.last_mut() {
            Some((_, _, end)) if t.begin <= *end => *end = (*end).max(t.end),
            _ => out.push((&t.name, t.begin, t.end)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::read::readahead::tests::{open, owned, remove, sample};

    #[test]
    fn a_file_cut_short_leaves_reads_to_the_caller() {
        let (path, tensors) = sample("cut", 8, 1 << 20);
        let source = open(&path);
        // Truncated after open: the read-ahead's read fails; the caller gets None and its own
        // read reports the error.
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let ahead = owned(&source, 64 << 20);
        let last = source.header.index_of(&tensors[7].0).unwrap();
        ahead.want_all();
        assert!(ahead.take(last, true, &mut || false).unwrap().is_none());
        remove(&path, source, ahead);
    }

    #[test]
    fn tensors_that_follow_each_other_are_one_span() {
        let info = |name: &str, begin, end| crate::format::header::TensorInfo {
            name: name.into(),
            dtype: crate::format::dtype::Dtype::U8,
            shape: vec![end - begin],
            begin,
            end,
        };
        let ts = [
            info("a", 0, 8),
            info("b", 8, 20),
            info("empty", 20, 20),
            info("c", 20, 24),
            info("d", 32, 40), // after a gap of 8 bytes no one asked for
            info("e", 40, 48),
            info("f", 64, 72),
        ];
        let infos: Vec<_> = ts.iter().collect();
        assert_eq!(
            super::spans(&infos),
            [("a", 0, 24), ("d", 32, 48), ("f", 64, 72)]
        );
        assert_eq!(super::spans(&infos[4..5]), [("d", 32, 40)]);
        assert!(super::spans(&[]).is_empty());
    }
}
