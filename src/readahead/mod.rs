//! Read-ahead for tensors pulled one at a time (`get_tensor` loops, `get_slice(k)[...]` from
//! several threads, in any order): background workers read the file's tensors in file order with
//! the parallel engine, within a memory budget, and hand each one over when it is asked for.
//!
//! - Owned memory (`pread`, `direct`): each tensor is read into memory it will own, as a demand
//!   read would; [`ReadAhead::take`] hands those bytes over (no copy). A tensor asked for before
//!   the read-ahead reached it is read by the caller (the demand path) and skipped here.
//! - Page cache (`mmap`): the map's views need no copy; the workers make the tensors' pages
//!   resident ahead of the touches ([`platform::populate_mapped`], else [`platform::prefetch`]),
//!   in file order, and a request they have not reached populates its own tensor.
//! - Provided memory (a device's host alias, for MPS): the caller allocates the destinations
//!   the walk asks for ([`ReadAhead::wanted`], [`ReadAhead::provide`]) on its own thread, and
//!   the workers read into them; one write per byte, straight into the final memory.
//!
//! A process forked while workers run has none of them: its requests bypass the read-ahead.
//!
//! The window: at most `min(budget, max(64 MiB, bytes taken so far))` of tensors read ahead and
//! not yet taken, so one `get_tensor` costs at most 64 MiB of extra reads, a loop's window grows
//! as it goes, and a tensor nobody asks for costs at most its share of the budget (its memory is
//! released with the handle). [`ReadAhead::want_all`] lifts the window (every tensor was asked).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::buffer::{Fresh, TensorBytes};
use crate::engine;
use crate::error::{Error, Result};
use crate::header::TensorInfo;
use crate::platform;
use crate::source::{self, ReadOptions, Source};
use crate::storage::Strategy;

/// Default budget of owned read-ahead memory (`SAFELOAD_READAHEAD_BYTES`; 0 turns it off).
pub const DEFAULT_BUDGET: u64 = 256 << 20;
/// Maps read ahead into the page cache, which the OS can reclaim: this many times the budget.
const PAGE_CACHE_FACTOR: u64 = 4;
/// The window before anything was taken.
const FIRST_WINDOW: u64 = 64 << 20;
/// Page-cache hints are given this many bytes at a time.
const PREFETCH_BYTES: u64 = 16 << 20;
/// Workers populating a map (each waits on its own 16 MiB at a time).
const PAGE_CACHE_WORKERS: usize = 4;
/// Workers reading batches into memory: two batches in flight, so one's tail overlaps the next
/// one's start. They share the handle's read threads (each batch's engine runs half of them):
/// measured on 2 cores, warm 2.5 GiB file, `prefetch()` + take all, 8 fresh processes, medians:
/// 1.92 GiB/s with every batch running all the threads (4 on 2 cores), 2.26 shared, against
/// 2.28 for `get_tensors()`.
const BATCH_WORKERS: usize = 2;
/// How often a waiting caller polls for cancellation.
const WAIT: Duration = Duration::from_millis(20);

/// The read-ahead budget from `SAFELOAD_READAHEAD_BYTES` (bytes, or `256MiB`-style), else
/// [`DEFAULT_BUDGET`], at most a quarter of what the process may still take
/// ([`crate::memory::available`]). 0 turns read-ahead off.
pub fn budget_from_env() -> u64 {
    budget("SAFELOAD_READAHEAD_BYTES", DEFAULT_BUDGET)
}

/// Default budget of a prefetch loader (`SAFELOAD_PREFETCH_BYTES`): a loader's tensors are the
/// caller's final memory, which a caller taking every tensor holds in the end anyway, and a
/// window as large as the file lets it be read in file order whatever the order of the takes.
pub const DEFAULT_PREFETCH_BUDGET: u64 = 4 << 30;

/// Default budget of a loader whose destinations are staging memory (CUDA: pinned host
/// tensors, each copied to the device when taken), not the caller's final memory.
pub const DEFAULT_STAGING_BUDGET: u64 = 1 << 30;

/// A prefetch loader's budget when the caller gives none: `SAFELOAD_PREFETCH_BYTES`, else
/// [`DEFAULT_STAGING_BUDGET`] for a `staging` loader and [`DEFAULT_PREFETCH_BUDGET`] for the
/// others, at most a quarter of what the process may still take.
pub fn prefetch_budget_from_env(staging: bool) -> u64 {
    let default = if staging {
        DEFAULT_STAGING_BUDGET
    } else {
        DEFAULT_PREFETCH_BUDGET
    };
    budget("SAFELOAD_PREFETCH_BYTES", default)
}

fn budget(var: &str, default: u64) -> u64 {
    let asked = std::env::var(var)
        .ok()
        .and_then(|v| crate::memory::parse_bytes(&v))
        .unwrap_or(default);
    crate::memory::available().map_or(asked, |a| asked.min(a / 4))
}

/// Where read-ahead puts the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Owned buffers, read with this strategy (`Pread` or `Direct`).
    Owned(Strategy),
    /// The page cache, for a mapped file.
    PageCache,
    /// Destinations the caller provides ([`ReadAhead::provide`]), read with pread.
    Provided,
}

impl Mode {
    /// The read-ahead for a handle reading with `strategy`.
    pub fn for_strategy(strategy: Strategy) -> Mode {
        match strategy {
            Strategy::Mmap => Mode::PageCache,
            owned => Mode::Owned(owned),
        }
    }
}

enum Slot {
    /// Not read yet; the read-ahead may claim it (except in [`Mode::Provided`]).
    Idle,
    /// [`Mode::Provided`]: named by [`ReadAhead::wanted`]; its destination is being made.
    Wanted,
    /// [`Mode::Provided`]: its destination is here; the read-ahead may claim it.
    Provided(Fresh),
    /// Claimed by a read-ahead worker.
    Reading,
    /// Read ahead, waiting to be taken (None: in the page cache).
    Ready(Option<TensorBytes>),
    /// Taken, or left to the caller's own read.
    Done,
}

struct State {
    slots: Vec<Slot>,
    /// The read-ahead walks tensors from `start` to the end, then from the first to `start`.
    start: usize,
    /// Positions of that walk already claimed or passed.
    scanned: usize,
    /// Bytes claimed or read ahead and not yet taken.
    held: u64,
    /// Bytes asked for so far (taken or read by callers): the window grows with it.
    taken: u64,
    want_all: bool,
    started: bool,
    /// Totals of the read-ahead's own reads.
    bytes_read: u64,
    seconds: f64,
    direct_refused: bool,
    hinted: u64,
}

struct Shared {
    source: Arc<Source>,
    /// What is read ahead, in file order: the file's tensors, or a plan's (parts of) tensors.
    items: Vec<TensorInfo>,
    mode: Mode,
    opts: ReadOptions,
    budget: u64,
    /// The window before anything was taken.
    first_window: u64,
    /// A prefetch ([`ReadAhead::eager`]): a request for a tensor the walk will reach within
    /// the window waits for it, so the file is read in file order whatever the request order.
    eager: bool,
    /// Workers running now (none: every request reads on demand).
    running: AtomicUsize,
    /// The most bytes one batch claims (see [`batch_limit`]).
    batch_limit: u64,
    stop: AtomicBool,
    /// The process the workers were started in (0: not started). A child forked while they ran
    /// has no workers, and its copy of `state` may be locked by a thread it does not have: it
    /// never touches either.
    pid: AtomicU32,
    state: Mutex<State>,
    cv: Condvar,
}

/// What the read-ahead did, for a handle's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    pub bytes_read: u64,
    pub seconds: f64,
    pub direct_refused: bool,
    /// Page-cache mode: bytes the OS was asked to read ahead.
    pub hinted: u64,
}

/// Read-ahead over one open file; stops (and frees what was not taken) when dropped or
/// [`ReadAhead::stop`]ped.
pub struct ReadAhead {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl ReadAhead {
    /// Read-ahead for `source` in `mode` with at most `budget` bytes of owned memory held
    /// (page cache: [`PAGE_CACHE_FACTOR`] times it). Starts nothing until the first request.
    pub fn new(source: Arc<Source>, mode: Mode, opts: ReadOptions, budget: u64) -> ReadAhead {
        let items = source.header.tensors.clone();
        Self::build(source, items, mode, opts, budget, FIRST_WINDOW, false)
    }

    /// Read-ahead of `items` (parts of `source`'s tensors: name, dtype and shape of what is
    /// read, data offsets of its bytes; in file order, disjoint), started now from the first
    /// with the whole `budget` as its window: what a prefetch plan asks for. Indices in the
    /// other calls are indices into `items`.
    pub fn eager(
        source: Arc<Source>,
        items: Vec<TensorInfo>,
        mode: Mode,
        opts: ReadOptions,
        budget: u64,
    ) -> ReadAhead {
        let ahead = Self::build(source, items, mode, opts, budget, budget, true);
        if !ahead.shared.items.is_empty() {
            let mut state = ahead.shared.lock();
            ahead.spawn(&mut state);
        }
        ahead
    }

    fn build(
        source: Arc<Source>,
        items: Vec<TensorInfo>,
        mode: Mode,
        opts: ReadOptions,
        budget: u64,
        first_window: u64,
        eager: bool,
    ) -> ReadAhead {
        let n = items.len();
        let budget = match mode {
            Mode::PageCache => budget.saturating_mul(PAGE_CACHE_FACTOR),
            Mode::Owned(_) | Mode::Provided => budget,
        };
        let state = State {
            slots: (0..n).map(|_| Slot::Idle).collect(),
            start: 0,
            scanned: 0,
            held: 0,
            taken: 0,
            want_all: false,
            started: false,
            bytes_read: 0,
            seconds: 0.0,
            direct_refused: false,
            hinted: 0,
        };
        let batch_limit = batch_limit(&source, mode, &opts);
        let opts = match mode {
            Mode::Owned(_) | Mode::Provided => {
                let threads = source::threads(&[&*source], &opts);
                ReadOptions {
                    threads: Some(threads.div_ceil(BATCH_WORKERS)),
                    ..opts
                }
            }
            Mode::PageCache => opts,
        };
        ReadAhead {
            shared: Arc::new(Shared {
                source,
                items,
                first_window,
                eager,
                running: AtomicUsize::new(0),
                mode,
                opts,
                budget,
                batch_limit,
                stop: AtomicBool::new(false),
                pid: AtomicU32::new(0),
                state: Mutex::new(state),
                cv: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
        }
    }

    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// What is read ahead (indices of the other calls index this), in file order.
    pub fn items(&self) -> &[TensorInfo] {
        &self.shared.items
    }

    /// Tensor `index` (of the header's file-order table) for a caller that wants it whole:
    /// its read-ahead bytes when they are ready (waiting while a worker reads them), or None:
    /// then the caller reads it itself. Page-cache mode always returns None (map it), at once
    /// when a worker has read or is reading its pages, else once this call has populated them. The
    /// first request starts the read-ahead from this tensor on, when `start` is set.
    pub fn take(
        &self,
        index: usize,
        start: bool,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<Option<TensorBytes>> {
        let shared = &*self.shared;
        if self.forked() {
            return Ok(None); // the workers are the parent's: read on demand
        }
        let mut state = shared.lock();
        if start && !state.started {
            state.start = index;
            self.spawn(&mut state);
        }
        let size = shared.items[index].nbytes() as u64;
        loop {
            let waits = shared.eager
                && matches!(state.slots[index], Slot::Idle)
                && shared.reaches(&state, index);
            match &mut state.slots[index] {
                Slot::Provided(_) => {
                    // Not claimed yet: the caller reads it into its destination now.
                    let Slot::Provided(fresh) =
                        std::mem::replace(&mut state.slots[index], Slot::Done)
                    else {
                        unreachable!("matched above")
                    };
                    state.held -= size;
                    state.taken += size;
                    shared.cv.notify_all();
                    drop(state);
                    let info = &shared.items[index];
                    let (mut read, report) = shared.read_provided(&[info], vec![fresh], poll)?;
                    let mut state = shared.lock();
                    state.bytes_read += report.bytes;
                    state.seconds += report.seconds;
                    return Ok(read.pop());
                }
                Slot::Ready(bytes) => {
                    let bytes = bytes.take();
                    state.slots[index] = Slot::Done;
                    state.held -= size;
                    state.taken += size;
                    shared.cv.notify_all();
                    return Ok(bytes);
                }
                // Page cache: the view needs nothing from the worker; the caller's touches of
                // pages it is reading wait for those pages only.
                Slot::Reading if shared.mode == Mode::PageCache => {
                    // Taken now; the worker's populate goes on and leaves the slot as it is.
                    state.slots[index] = Slot::Done;
                    state.held -= size;
                    state.taken += size;
                    shared.cv.notify_all();
                    return Ok(None);
                }
                // Being read or given a destination; or, in a prefetch (which reads in file
                // order), not reached yet where the walk will get here without any other tensor
                // being taken first: wait.
                Slot::Reading | Slot::Wanted => state = shared.wait(state, poll)?,
                Slot::Idle if waits => state = shared.wait(state, poll)?,
                Slot::Idle => {
                    state.slots[index] = Slot::Done;
                    state.taken += size;
                    shared.cv.notify_all();
                    if self.shared.mode == Mode::PageCache {
                        // Page cache: the caller maps it; its pages are read here, beside the
                        // workers' (several callers' threads read in parallel).
                        drop(state);
                        let info = &shared.items[index];
                        shared.populate(info.begin, info.end);
                        shared.lock().hinted += size;
                    }
                    return Ok(None);
                }
                Slot::Done => return Ok(None),
            }
        }
    }

    /// Whether this is a child forked after the workers started (see [`Shared::pid`]).
    fn forked(&self) -> bool {
        let pid = self.shared.pid.load(Ordering::Relaxed);
        pid != 0 && pid != std::process::id()
    }

    /// Every tensor was asked for (a `get_tensors()` on a map): read ahead through the whole
    /// file, whatever the window.
    pub fn want_all(&self) {
        if self.forked() {
            return;
        }
        let mut state = self.shared.lock();
        state.want_all = true;
        if !state.started {
            state.start = 0;
            self.spawn(&mut state);
        }
        self.shared.cv.notify_all();
    }

    /// [`Mode::Provided`]: the tensors that need a destination now: `index` (unless it was read
    /// or asked for), then the walk's next tensors that fit the window. The first call starts
    /// the read-ahead from `index`. The caller allocates them and must hand them (or None) to
    /// [`ReadAhead::provide`]; until then no other call names them, and requests for them wait.
    pub fn wanted(&self, index: usize) -> Vec<usize> {
        if self.forked() || self.shared.mode != Mode::Provided {
            return Vec::new();
        }
        let shared = &*self.shared;
        let mut state = shared.lock();
        if !state.started {
            state.start = index;
            self.spawn(&mut state);
        }
        let n = state.slots.len();
        let size = |i: usize| shared.items[i].nbytes() as u64;
        let mut out = Vec::new();
        let mut held = state.held;
        if matches!(state.slots[index], Slot::Idle) {
            out.push(index);
            held += size(index);
        }
        let window = shared.window(&state);
        for pos in state.scanned..n {
            let i = (state.start + pos) % n;
            if i == index || !matches!(state.slots[i], Slot::Idle) {
                continue;
            }
            // One tensor larger than the window is provided alone once nothing else is held.
            if held + size(i) > window && !(out.is_empty() && held == 0) {
                break;
            }
            out.push(i);
            held += size(i);
        }
        for &i in &out {
            state.slots[i] = Slot::Wanted;
        }
        state.held = held;
        out
    }

    /// [`Mode::Provided`]: the destinations of the tensors `wanted` named, one per tensor in
    /// that order, each exactly the tensor's size; None when the caller could not make them
    /// (those tensors are then read by their callers). A destination of the wrong size is an
    /// error, and none of them is used.
    pub fn provide(&self, wanted: &[usize], destinations: Option<Vec<Fresh>>) -> Result<()> {
        let shared = &*self.shared;
        let (result, destinations) = match destinations.map(|d| shared.check(wanted, d)) {
            Some(Err(e)) => (Err(e), None),
            Some(Ok(d)) => (Ok(()), Some(d)),
            None => (Ok(()), None),
        };
        if self.forked() || shared.mode != Mode::Provided {
            return result;
        }
        let mut state = shared.lock();
        match destinations {
            Some(dests) => {
                for (&i, fresh) in wanted.iter().zip(dests) {
                    if matches!(state.slots[i], Slot::Wanted) {
                        state.slots[i] = Slot::Provided(fresh);
                    }
                }
            }
            None => {
                for &i in wanted {
                    if matches!(state.slots[i], Slot::Wanted) {
                        state.slots[i] = Slot::Idle;
                        state.held -= shared.items[i].nbytes() as u64;
                    }
                }
            }
        }
        shared.cv.notify_all();
        result
    }

    /// What the read-ahead has read so far.
    pub fn totals(&self) -> Totals {
        if self.forked() {
            return Totals::default();
        }
        let state = self.shared.lock();
        Totals {
            bytes_read: state.bytes_read,
            seconds: state.seconds,
            direct_refused: state.direct_refused,
            hinted: state.hinted,
        }
    }

    /// Bytes read ahead and not taken yet (owned memory or page cache).
    pub fn held_bytes(&self) -> u64 {
        if self.forked() {
            return 0;
        }
        self.shared.lock().held
    }

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

    /// Waits for the workers to finish the walk (tests: after [`ReadAhead::want_all`], when
    /// the window cannot stall them).
    #[cfg(test)]
    fn finish(&self) {
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            w.join().unwrap();
        }
    }

    fn spawn(&self, state: &mut MutexGuard<'_, State>) {
        state.started = true;
        self.shared.pid.store(std::process::id(), Ordering::Relaxed);
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

/// The most bytes one batch claims: one populate step for maps; for owned reads, two chunks per
/// engine worker (so every worker has work to the end of a batch). Worked out once: the worker
/// count may read the FUSE connection's settings from sysfs.
fn batch_limit(source: &Source, mode: Mode, opts: &ReadOptions) -> u64 {
    match mode {
        Mode::PageCache => PREFETCH_BYTES,
        Mode::Owned(_) | Mode::Provided => {
            let chunk = source::chunk_bytes(&[source], opts) as u64;
            let threads = source::threads(&[source], opts) as u64;
            (2 * chunk * threads).max(32 << 20)
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
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `dests` as destinations of the tensors `wanted` names: one each, of each one's size.
    fn check(&self, wanted: &[usize], dests: Vec<Fresh>) -> Result<Vec<Fresh>> {
        let tensors = &self.items;
        let path = self.source.path.display();
        if dests.len() != wanted.len() {
            return Err(Error::Destination(format!(
                "{} destinations for {} tensors of {path}",
                dests.len(),
                wanted.len()
            )));
        }
        for (&i, d) in wanted.iter().zip(&dests) {
            let t = &tensors[i];
            if d.len() != t.nbytes() {
                return Err(Error::Destination(format!(
                    "a destination of {} bytes for tensor {} ({} bytes) of {path}",
                    d.len(),
                    t.name,
                    t.nbytes()
                )));
            }
        }
        Ok(dests)
    }

    /// Waits a while for the workers, then checks for cancellation. `poll` may wait for the
    /// GIL, whose holder may be waiting for this lock (`wanted`, `provide`, the stats): it is
    /// never called holding it.
    fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        let (next, _) = self
            .cv
            .wait_timeout(state, WAIT)
            .unwrap_or_else(|p| p.into_inner());
        drop(next);
        if poll() {
            return Err(Error::Cancelled);
        }
        Ok(self.lock())
    }

    /// Whether the walk reaches item `index` within the window as things stand: the bytes held
    /// and those of the items it will claim before it fit (the walk advances on its own then).
    fn reaches(&self, state: &State, index: usize) -> bool {
        if self.mode == Mode::Provided
            || self.stop.load(Ordering::Relaxed)
            || self.running.load(Ordering::Relaxed) == 0
        {
            // Provided destinations come from the caller's own calls; without workers nothing
            // moves the walk.
            return false;
        }
        let n = state.slots.len();
        let window = self.window(state);
        let mut bytes = state.held;
        for pos in state.scanned..n {
            let i = (state.start + pos) % n;
            if matches!(state.slots[i], Slot::Idle) {
                bytes += self.items[i].nbytes() as u64;
                if bytes > window {
                    return false;
                }
            }
            if i == index {
                return true;
            }
        }
        false
    }

    fn window(&self, state: &State) -> u64 {
        if state.want_all {
            return u64::MAX;
        }
        self.budget.min(self.first_window.max(state.taken))
    }

    /// Claims the next tensors of the walk that fit the window (with their destinations in
    /// [`Mode::Provided`], where the walk waits at a tensor not provided yet); None when the
    /// window is full or the walk is over (`state.scanned` says which).
    fn claim(&self, state: &mut State) -> Option<Vec<(usize, Option<Fresh>)>> {
        let n = state.slots.len();
        let provided = self.mode == Mode::Provided;
        let (window, limit) = (self.window(state), self.batch_limit);
        let mut batch = Vec::new();
        let mut bytes = 0u64;
        while state.scanned < n {
            let i = (state.start + state.scanned) % n;
            match state.slots[i] {
                Slot::Idle | Slot::Wanted if provided => break,
                Slot::Idle | Slot::Provided(_) => {}
                _ => {
                    state.scanned += 1;
                    continue;
                }
            }
            let size = self.items[i].nbytes() as u64;
            // Provided destinations were counted (and fitted to the window) when provided.
            let fits_window = provided || state.held + bytes + size <= window;
            // One tensor larger than the window is read alone once nothing else is held.
            let alone = batch.is_empty() && state.held == 0;
            if !batch.is_empty() && (bytes + size > limit || !fits_window) {
                break;
            }
            if batch.is_empty() && !fits_window && !alone {
                break;
            }
            let dest = match std::mem::replace(&mut state.slots[i], Slot::Reading) {
                Slot::Provided(fresh) => Some(fresh),
                _ => None,
            };
            state.scanned += 1;
            batch.push((i, dest));
            bytes += size;
            // A wrap back to the first tensor starts a new batch (keeps batches in file order).
            if (state.start + state.scanned).is_multiple_of(n) {
                break;
            }
        }
        if !provided {
            state.held += bytes;
        }
        (!batch.is_empty()).then_some(batch)
    }

    /// A worker: claims batches in file order and reads them until the walk is over or stopped.
    fn work(&self) {
        loop {
            let batch = {
                let mut state = self.lock();
                loop {
                    if self.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Some(batch) = self.claim(&mut state) {
                        break batch;
                    }
                    if state.scanned >= state.slots.len() {
                        return;
                    }
                    state = self
                        .cv
                        .wait_timeout(state, WAIT)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            };
            let (batch, dests): (Vec<usize>, Vec<Option<Fresh>>) = batch.into_iter().unzip();
            let infos: Vec<&TensorInfo> = batch.iter().map(|&i| &self.items[i]).collect();
            let read = self.read(&infos, dests);
            let mut state = self.lock();
            match read {
                Ok((buffers, report)) => {
                    if self.mode == Mode::PageCache {
                        state.hinted += infos.iter().map(|t| t.nbytes() as u64).sum::<u64>();
                    } else {
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
            self.cv.notify_all();
        }
    }

    /// Reads `infos` into their provided destinations, with pread.
    fn read_provided(
        &self,
        infos: &[&TensorInfo],
        mut dests: Vec<Fresh>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<(Vec<TensorBytes>, engine::Report)> {
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
        let report = source::read_targets(&[source], targets, Strategy::Pread, &self.opts, poll)?;
        Ok((dests.into_iter().map(Fresh::into_shared).collect(), report))
    }

    /// Makes data bytes `[begin, end)` resident in the file's map where the OS can (the pages
    /// are read and mapped, so the caller's touches do not fault), else hints them to the page
    /// cache; 16 MiB at a time, until stopped. Errors (a file cut short) are left to the touch.
    fn populate(&self, begin: usize, end: usize) {
        let source = &*self.source;
        let Ok(span) = source.map_span(begin, end) else {
            return;
        };
        // The whole range is queued first, so the disk reads ahead of the waits below.
        let data_start = source.header.data_start();
        platform::prefetch(&source.file, data_start + begin as u64, span.len() as u64);
        let mut at = 0usize;
        while at < span.len() && !self.stop.load(Ordering::Relaxed) {
            let len = (PREFETCH_BYTES as usize).min(span.len() - at);
            // SAFETY: `at < span.len()`: in bounds of the span's live map.
            let ptr = unsafe { span.as_mut_ptr().add(at) };
            let populated =
                std::ptr::NonNull::new(ptr).is_some_and(|p| platform::populate_mapped(p, len));
            if !populated {
                platform::prefetch(&source.file, data_start + (begin + at) as u64, len as u64);
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
    ) -> Result<(Vec<Option<TensorBytes>>, engine::Report)> {
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
                let (tensors, report, _) =
                    source::read_or_map(&[source], &wanted, strategy, None, &self.opts, &mut poll)?;
                Ok((tensors.into_iter().map(|(b, _)| Some(b)).collect(), report))
            }
            Mode::PageCache => {
                for t in infos {
                    self.populate(t.begin, t.end);
                }
                Ok((
                    infos.iter().map(|_| None).collect(),
                    engine::Report::default(),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::dtype::Dtype;
    use crate::serialize;

    /// A file of `n` U8 tensors of `size` bytes each, every byte a function of tensor and
    /// position; returns its path and each tensor's bytes.
    fn sample(tag: &str, n: usize, size: usize) -> (std::path::PathBuf, Vec<(String, Vec<u8>)>) {
        let dir = std::env::temp_dir().join(format!("safeload-ra-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let tensors: Vec<(String, Vec<u8>)> = (0..n)
            .map(|t| {
                let bytes = (0..size)
                    .map(|i| (i * 31 + t * 7 + i / 251) as u8)
                    .collect();
                (format!("t{t:03}"), bytes)
            })
            .collect();
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|(_, b)| vec![b.len()]).collect();
        let mut specs: Vec<serialize::TensorIn<'_>> = tensors
            .iter()
            .zip(&shapes)
            .map(|((name, data), shape)| serialize::TensorIn {
                name,
                dtype: Dtype::U8,
                shape,
                data,
            })
            .collect();
        serialize::to_file(&path, &mut specs, None, false).unwrap();
        (path, tensors)
    }

    fn open(path: &std::path::Path) -> Arc<Source> {
        Arc::new(Source::open(path).unwrap())
    }

    fn owned(source: &Arc<Source>, budget: u64) -> ReadAhead {
        ReadAhead::new(
            source.clone(),
            Mode::Owned(Strategy::Pread),
            ReadOptions::default(),
            budget,
        )
    }

    /// Stops the read-ahead and closes the file before removing the sample (Windows cannot
    /// delete a file still open).
    fn remove(path: &std::path::Path, source: Arc<Source>, ahead: ReadAhead) {
        drop(ahead);
        drop(source);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn owned_reads_serve_any_order_within_the_budget() {
        let (path, tensors) = sample("order", 48, 1 << 20);
        let source = open(&path);
        let budget = 6 << 20;
        let ahead = owned(&source, budget);
        // Odd tensors backwards, then even ones forwards: most requests are not the next in file
        // order. What the read-ahead hands over must be the file's bytes, and anything it does
        // not have is the caller's to read (None).
        let order: Vec<usize> = (0..48)
            .rev()
            .filter(|i| i % 2 == 1)
            .chain((0..48).filter(|i| i % 2 == 0))
            .collect();
        let mut served = 0;
        for &i in &order {
            let index = source.header.index_of(&tensors[i].0).unwrap();
            if let Some(bytes) = ahead.take(index, true, &mut || false).unwrap() {
                assert_eq!(bytes.as_slice(), &tensors[i].1[..], "tensor {i}");
                served += 1;
            }
            assert!(
                ahead.held_bytes() <= budget,
                "held {} > budget {budget}",
                ahead.held_bytes()
            );
        }
        // A second request of a tensor already handed over is the caller's (a fresh read).
        assert!(ahead.take(0, true, &mut || false).unwrap().is_none());
        ahead.stop();
        assert_eq!(ahead.held_bytes(), 0);
        let totals = ahead.totals();
        assert!(totals.bytes_read >= served as u64 * (1 << 20));
        remove(&path, source, ahead);
    }

    /// A destination outside our allocator, as a device alias would be: a boxed buffer whose
    /// tag says which tensor it was provided for.
    fn external(tag: usize, len: usize) -> Fresh {
        let mut memory = vec![0xA5u8; len].into_boxed_slice();
        let ptr = memory.as_mut_ptr();
        // SAFETY: the boxed slice's heap bytes do not move with the box, and `keep` owns them
        // (with the tag) for as long as the storage lives.
        unsafe { Fresh::external(ptr, len, Box::new((tag, memory))) }
    }

    #[test]
    fn provided_destinations_are_read_into_in_any_order() {
        let (path, tensors) = sample("provided", 40, 512 << 10);
        let source = open(&path);
        let budget = 4 << 20;
        let ahead = ReadAhead::new(
            source.clone(),
            Mode::Provided,
            ReadOptions::default(),
            budget,
        );
        assert!(
            owned(&source, budget).wanted(0).is_empty(),
            "only provided mode asks"
        );
        // Backwards over the odd tensors, then forwards over the even ones.
        let order: Vec<usize> = (0..40)
            .rev()
            .filter(|i| i % 2 == 1)
            .chain((0..40).filter(|i| i % 2 == 0))
            .collect();
        let mut asked = 0;
        for &i in &order {
            let wanted = ahead.wanted(i);
            asked += wanted.len();
            let size = |j: usize| source.header.tensors[j].nbytes() as u64;
            // The tensor asked for first (unless provided already), then no more than the
            // window beyond what is held.
            if let Some(at) = wanted.iter().position(|&j| j == i) {
                assert_eq!(at, 0);
            }
            let dests = wanted.iter().map(|&j| external(j, size(j) as usize));
            ahead.provide(&wanted, Some(dests.collect())).unwrap();
            let bytes = ahead
                .take(i, true, &mut || false)
                .unwrap()
                .expect("provided just now");
            assert_eq!(bytes.as_slice(), &tensors[i].1[..], "tensor {i}");
            // The bytes are in the destination provided for this tensor, not a copy.
            let keep = bytes.keep().expect("external memory");
            let (tag, _) = keep.downcast_ref::<(usize, Box<[u8]>)>().unwrap();
            assert_eq!(*tag, i);
            assert!(ahead.held_bytes() <= budget, "held {}", ahead.held_bytes());
        }
        // Every tensor was provided once, and nothing is held once all were taken.
        assert_eq!(asked, 40);
        assert_eq!(ahead.held_bytes(), 0);
        assert!(ahead.take(3, true, &mut || false).unwrap().is_none());
        // A destination of the wrong size is refused, and the tensor goes back to its caller.
        let source2 = open(&path);
        let fresh = ReadAhead::new(source2, Mode::Provided, ReadOptions::default(), budget);
        let wanted = fresh.wanted(5);
        let mut dests: Vec<Fresh> = wanted.iter().map(|&j| external(j, 512 << 10)).collect();
        dests[0] = external(5, 7);
        let err = fresh.provide(&wanted, Some(dests)).unwrap_err();
        assert!(err.to_string().contains("t005"), "{err}");
        assert_eq!(fresh.held_bytes(), 0);
        assert!(fresh.take(5, true, &mut || false).unwrap().is_none());
        drop(fresh);
        remove(&path, source, ahead);
    }

    #[test]
    fn a_prefetch_reads_in_file_order_whatever_the_request_order() {
        let (path, tensors) = sample("eager", 24, 256 << 10);
        let source = open(&path);
        let items = source.header.tensors.clone();
        // A window as large as the file: every request, backwards, waits for the walk (none is
        // read on demand, which would return None here).
        let ahead = ReadAhead::eager(
            source.clone(),
            items.clone(),
            Mode::Owned(Strategy::Pread),
            ReadOptions::default(),
            64 << 20,
        );
        for i in (0..24).rev() {
            let bytes = ahead.take(i, true, &mut || false).unwrap();
            let bytes = bytes.expect("served by the walk");
            assert_eq!(bytes.as_slice(), &tensors[i].1[..], "tensor {i}");
        }
        assert_eq!(ahead.totals().bytes_read, 24 * (256 << 10));
        drop(ahead);
        // A window of two tensors: requests beyond it are the caller's, nothing waits forever.
        let small = ReadAhead::eager(
            source.clone(),
            items,
            Mode::Owned(Strategy::Pread),
            ReadOptions::default(),
            512 << 10,
        );
        let mut own = 0;
        for i in (0..24).rev() {
            match small.take(i, true, &mut || false).unwrap() {
                Some(bytes) => assert_eq!(bytes.as_slice(), &tensors[i].1[..]),
                None => own += 1,
            }
        }
        assert!(own > 0);
        remove(&path, source, small);
    }

    #[test]
    fn a_finished_walk_serves_every_tensor() {
        let (path, tensors) = sample("all", 20, 300_000);
        let source = open(&path);
        let ahead = owned(&source, 1 << 20);
        ahead.want_all();
        ahead.finish();
        assert_eq!(ahead.held_bytes(), 20 * 300_000);
        for i in (0..20).rev() {
            let bytes = ahead
                .take(i, true, &mut || false)
                .unwrap()
                .expect("read ahead");
            assert_eq!(bytes.as_slice(), &tensors[i].1[..]);
        }
        assert_eq!(ahead.held_bytes(), 0);
        assert_eq!(ahead.totals().bytes_read, 20 * 300_000);
        remove(&path, source, ahead);
    }

    #[test]
    fn threads_share_one_read_ahead() {
        let (path, tensors) = sample("threads", 64, 256 << 10);
        let source = open(&path);
        let ahead = owned(&source, 4 << 20);
        let tensors = &tensors;
        let served = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for worker in 0..4 {
                let (ahead, source, served) = (&ahead, &source, &served);
                s.spawn(move || {
                    // Each thread takes every fourth tensor, from the end of the file.
                    for i in (0..64).rev().filter(|i| i % 4 == worker) {
                        let index = source.header.index_of(&tensors[i].0).unwrap();
                        if let Some(bytes) = ahead.take(index, true, &mut || false).unwrap() {
                            assert_eq!(bytes.as_slice(), &tensors[i].1[..]);
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        remove(&path, source, ahead);
    }

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
    fn page_cache_mode_hands_nothing_over() {
        let (path, _) = sample("map", 8, 64 << 10);
        let source = open(&path);
        let ahead = ReadAhead::new(
            source.clone(),
            Mode::PageCache,
            ReadOptions::default(),
            1 << 20,
        );
        // Every tensor asked for is made resident once: by a worker ahead of the request, or by
        // the request itself.
        for i in (0..8).rev() {
            assert!(ahead.take(i, true, &mut || false).unwrap().is_none());
        }
        ahead.want_all();
        ahead.finish();
        assert_eq!(ahead.totals().hinted, 8 * (64 << 10));
        assert_eq!(ahead.totals().bytes_read, 0);
        assert_eq!(ahead.held_bytes(), 0);
        remove(&path, source, ahead);
    }
}
