//! Read-ahead for tensors pulled one at a time (`get_tensor` loops, `get_slice(k)[...]` from
//! several threads, in any order): background workers read the file's tensors in file order (or
//! in name order, for a loop over `keys()` through a file not in name order: [`Shared::begin`])
//! with the parallel engine, within a memory budget, and hand each one over when it is asked for.
//!
//! - Owned memory (`pread`, `direct`): each tensor is read into memory it will own, as a demand
//!   read would; [`ReadAhead::take`] hands those bytes over (no copy). A tensor asked for before
//!   the read-ahead reached it is read by the caller (the demand path) and skipped here.
//! - Page cache (`mmap`): the map's views need no copy; the workers make the tensors' pages
//!   resident ahead of the touches ([`crate::platform::populate_mapped`], else
//!   [`crate::platform::prefetch`]), in file order, and a request they have not reached
//!   populates its own tensor.
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
//!
//! Here: the state and the requests ([`ReadAhead::take`]); the budgets in `budget`, the walk's
//! window and claims in `walk`, the workers and their reads in `worker`, and the provided
//! memory's calls in `provided`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::Result;
use crate::format::header::TensorInfo;
use crate::platform;
use crate::read::buffer::{Fresh, TensorBytes};
use crate::read::counts::SharedTotals;
use crate::read::source::{self, ReadOptions, Source};
pub use crate::read::strategy::Mode;
use crate::read::strategy::Strategy;

mod budget;
mod provided;
mod walk;
mod worker;

/// Makes the pages of every tensor of each of `sources` resident in its map, in the background,
/// one file after another in file order: what the read plan leaves to read ahead after a
/// checkpoint's whole read of mapped shards whose pages are not resident
/// ([`strategy::Purpose::All`]), which has no handle to keep a read-ahead in (a handle's
/// `get_tensors()` uses its own). A cold `load_checkpoint`'s touches then find pages read ahead
/// of them instead of faulting each window in, so it reads each shard as fast as `load_file` of
/// that shard does. The walk ends on its own at the last shard; `SAFELOAD_READAHEAD_BYTES=0`
/// turns it off, as it turns off every read-ahead.
pub fn populate_in_background(
    sources: Vec<Arc<Source>>,
    tally: Arc<SharedTotals>,
    opts: ReadOptions,
) {
    let budget = budget_from_env();
    if budget == 0 || sources.is_empty() {
        return;
    }
    let walk = move || {
        for source in sources {
            let ahead = ReadAhead::new(source, tally.clone(), Mode::PageCache, opts, budget);
            ahead.want_all();
            ahead.finish();
        }
    };
    // Without a thread there is no read-ahead: the touches fault the pages in.
    let _ = std::thread::Builder::new()
        .name("safeload-populate".into())
        .spawn(walk);
}

// Only the binding asks for the budgets (see the crate's dead-code note).
#[cfg_attr(not(feature = "python"), allow(unused_imports))]
pub(crate) use budget::{budget_from_env, prefetch_budget_from_env};

/// Maps read ahead into the page cache, which the OS can reclaim: this many times the budget.
const PAGE_CACHE_FACTOR: u64 = 4;
/// The window before anything was taken.
const FIRST_WINDOW: u64 = 64 << 20;
/// Workers reading batches into memory: two batches in flight, so one's tail overlaps the next
/// one's start. They share the handle's read threads (each batch's engine runs half of them), so
/// a prefetch runs no more threads than `get_tensors()` does and reads a warm file as fast: with
/// every batch running all of them, twice the handle's threads contend for the cores and the
/// prefetch reads more slowly.
const BATCH_WORKERS: usize = 2;
/// Page-cache hints are given this many bytes at a time.
const PREFETCH_BYTES: u64 = 16 << 20;
/// How often a waiting caller polls for cancellation.
const WAIT: Duration = Duration::from_millis(20);

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
    /// The read-ahead walks the positions of its order from `start` to the end, then from the
    /// first to `start` ([`Shared::item_at`]).
    start: usize,
    /// The walk's order is the names' ([`Shared::begin`]), not the file's.
    by_name: bool,
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
    /// Callers waiting on `cv` for their tensors now ([`Shared::wait_a_while`]).
    waiters: usize,
    /// Workers waiting on `room` for room in the window now ([`Shared::wait_for_room`]).
    room_waiters: usize,
}

struct Shared {
    source: Arc<Source>,
    /// Where every read counts (the checkpoint's: its handle's stats include them).
    tally: Arc<SharedTotals>,
    /// What is read ahead, in file order: the file's tensors, or a plan's (parts of) tensors.
    items: Vec<TensorInfo>,
    mode: Mode,
    opts: ReadOptions,
    budget: u64,
    /// The window before anything was taken.
    first_window: u64,
    /// Whether anything is read ahead at all (not where the read plan reads nothing ahead: a
    /// prefetch of a file whose map is resident already, whose views need nothing; see
    /// [`ReadAhead::eager`]).
    populate: bool,
    /// A prefetch ([`ReadAhead::eager`]): a request for a tensor the walk will reach within
    /// the window waits for it, so the file is read in file order whatever the request order.
    eager: bool,
    /// Workers running now (none: every request reads on demand).
    running: AtomicUsize,
    /// The most bytes one batch claims (see [`batch_limit`]).
    batch_limit: u64,
    /// Indices of `items` in the order of their names, made when a walk first needs it.
    name_order: OnceLock<Vec<usize>>,
    stop: AtomicBool,
    /// [`platform::fork_generation`] + 1 of the process the workers were started in (0: not
    /// started). A child forked while they ran has no workers, and its copy of `state` may be
    /// locked by a thread it does not have: it never touches either.
    started_in: AtomicU64,
    state: Mutex<State>,
    /// Callers wait on it for their tensors.
    cv: Condvar,
    /// Workers wait on it for room to claim a batch in ([`Shared::worth_claiming`]).
    room: Condvar,
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
    pub fn new(
        source: Arc<Source>,
        tally: Arc<SharedTotals>,
        mode: Mode,
        opts: ReadOptions,
        budget: u64,
    ) -> ReadAhead {
        let items = source.header.tensors.clone();
        Self::build(
            (source, tally),
            items,
            (mode, true),
            opts,
            budget,
            FIRST_WINDOW,
            false,
        )
    }

    /// Read-ahead of `items` (parts of `source`'s tensors: name, dtype and shape of what is
    /// read, data offsets of its bytes; in file order, disjoint), started now from the first
    /// with the whole `budget` as its window: what a prefetch plan asks for. Indices in the
    /// other calls are indices into `items`. `mode` None: the read plan reads nothing ahead (views
    /// of a map whose pages are resident): no worker runs and every take maps its own view.
    pub fn eager(
        source: Arc<Source>,
        tally: Arc<SharedTotals>,
        items: Vec<TensorInfo>,
        mode: Option<Mode>,
        opts: ReadOptions,
        budget: u64,
    ) -> ReadAhead {
        let populate = mode.is_some();
        let mode = mode.unwrap_or(Mode::PageCache);
        let at = (source, tally);
        let ahead = Self::build(at, items, (mode, populate), opts, budget, budget, true);
        let mut state = ahead.shared.lock();
        if !ahead.shared.populate {
            state.started = true; // and nothing runs: every take maps its own view
        } else if !ahead.shared.items.is_empty() {
            ahead.spawn(&mut state);
        }
        drop(state);
        ahead
    }

    /// The read-ahead of `items` in `mode`, reading ahead only where `populate` says.
    fn build(
        (source, tally): (Arc<Source>, Arc<SharedTotals>),
        items: Vec<TensorInfo>,
        (mode, populate): (Mode, bool),
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
            by_name: false,
            scanned: 0,
            held: 0,
            taken: 0,
            want_all: false,
            started: false,
            bytes_read: 0,
            seconds: 0.0,
            direct_refused: false,
            hinted: 0,
            waiters: 0,
            room_waiters: 0,
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
                tally,
                items,
                first_window,
                populate,
                eager,
                running: AtomicUsize::new(0),
                mode,
                opts,
                budget,
                batch_limit,
                name_order: OnceLock::new(),
                stop: AtomicBool::new(false),
                started_in: AtomicU64::new(0),
                state: Mutex::new(state),
                cv: Condvar::new(),
                room: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
        }
    }

    /// Whether anything is read ahead at all (not where the read plan reads nothing ahead: a
    /// prefetch of a resident file's map).
    pub fn reads(&self) -> bool {
        self.shared.populate
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
            shared.begin(&mut state, index);
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
                    shared.wake(&state);
                    drop(state);
                    let info = &shared.items[index];
                    let (mut read, report) = shared.read_provided(&[info], vec![fresh], poll)?;
                    shared.tally.add(Strategy::Pread, &report);
                    let mut state = shared.lock();
                    state.bytes_read += report.bytes;
                    state.seconds += report.seconds;
                    return Ok(read.pop());
                }
                Slot::Ready(_) => return self.hand_over(state, index),
                // Page cache: the view needs nothing from the worker; the caller's touches of
                // pages it is reading wait for those pages only.
                Slot::Reading if shared.mode == Mode::PageCache => {
                    // Taken now; the worker's populate goes on and leaves the slot as it is.
                    state.slots[index] = Slot::Done;
                    state.held -= size;
                    state.taken += size;
                    shared.wake(&state);
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
                    shared.wake(&state);
                    if self.shared.mode == Mode::PageCache && shared.populate {
                        // Page cache: the caller maps it; its pages are read here, beside the
                        // workers' (several callers' threads read in parallel).
                        drop(state);
                        let info = &shared.items[index];
                        shared.populate(info);
                        shared.lock().hinted += size;
                    }
                    return Ok(None);
                }
                Slot::Done => return Ok(None),
            }
        }
    }

    /// [`ReadAhead::take`] of a tensor the workers have read already, without waiting (so a
    /// caller holding Python's GIL need not release it: a prefetch loader's takes of thousands of
    /// small tensors); None when it is not ready, for `take` to wait for.
    pub fn take_ready(&self, index: usize) -> Option<Result<Option<TensorBytes>>> {
        if self.forked() {
            return None;
        }
        let state = self.shared.lock();
        if !matches!(state.slots[index], Slot::Ready(_)) {
            return None;
        }
        Some(self.hand_over(state, index))
    }

    /// Hands over the bytes of `index`, a [`Slot::Ready`] one.
    fn hand_over(
        &self,
        mut state: MutexGuard<'_, State>,
        index: usize,
    ) -> Result<Option<TensorBytes>> {
        let shared = &*self.shared;
        let Slot::Ready(bytes) = std::mem::replace(&mut state.slots[index], Slot::Done) else {
            unreachable!("the caller checked the slot is ready")
        };
        let size = shared.items[index].nbytes() as u64;
        state.held -= size;
        state.taken += size;
        shared.wake(&state);
        drop(state);
        // Views of the map were made when the worker got here: handed out only while the file
        // still covers them.
        let name = &shared.items[index].name;
        bytes.map(|b| b.checked(name)).transpose()
    }

    /// Whether this is a child forked after the workers started (see [`Shared::started_in`]).
    fn forked(&self) -> bool {
        let started_in = self.shared.started_in.load(Ordering::Relaxed);
        started_in != 0 && started_in != platform::fork_generation() + 1
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
            self.shared.begin(&mut state, 0);
            self.spawn(&mut state);
        }
        self.shared.wake(&state);
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
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A caller's wait on `cv` for at most [`WAIT`], counted in [`State::waiters`] meanwhile.
    /// A waiting caller makes claiming worth it (see [`Shared::worth_claiming`]): the workers
    /// are woken to claim what it waits for.
    fn wait_a_while<'a>(&'a self, mut state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        state.waiters += 1;
        if state.room_waiters > 0 {
            self.room.notify_all();
        }
        let (mut state, _) = (self.cv.wait_timeout(state, WAIT)).unwrap_or_else(|p| p.into_inner());
        state.waiters -= 1;
        state
    }

    /// A worker's wait on `room` for at most [`WAIT`], counted in [`State::room_waiters`].
    fn wait_for_room<'a>(&'a self, mut state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        state.room_waiters += 1;
        let (mut state, _) =
            (self.room.wait_timeout(state, WAIT)).unwrap_or_else(|p| p.into_inner());
        state.room_waiters -= 1;
        state
    }

    /// Wakes whoever waits (callers for their tensors, workers for room in the window) after
    /// `state` changed, holding its lock: callers when any waits, workers when claiming is worth
    /// it now. A wake is a system call, and a loop taking thousands of small tensors the workers
    /// have read finds no one to wake at almost every take.
    fn wake(&self, state: &State) {
        if state.waiters > 0 {
            self.cv.notify_all();
        }
        if state.room_waiters > 0 && self.worth_claiming(state) {
            self.room.notify_all();
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::dtype::Dtype;
    use crate::format::serialize;

    /// A file of `n` U8 tensors of `size` bytes each, every byte a function of tensor and
    /// position; returns its path and each tensor's bytes.
    pub(super) fn sample(
        tag: &str,
        n: usize,
        size: usize,
    ) -> (std::path::PathBuf, Vec<(String, Vec<u8>)>) {
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
        let specs: Vec<serialize::TensorIn<'_>> = tensors
            .iter()
            .zip(&shapes)
            .map(|((name, data), shape)| serialize::TensorIn {
                name,
                dtype: Dtype::U8,
                shape,
                data,
            })
            .collect();
        crate::storage::write::to_file(&path, &specs, None, false).unwrap();
        (path, tensors)
    }

    pub(super) fn open(path: &std::path::Path) -> Arc<Source> {
        Arc::new(Source::open(path).unwrap())
    }

    pub(super) fn owned(source: &Arc<Source>, budget: u64) -> ReadAhead {
        ReadAhead::new(
            source.clone(),
            Default::default(),
            Mode::Owned(Strategy::Pread),
            ReadOptions::default(),
            budget,
        )
    }

    /// Indices `0..n`: the odd ones backwards, then the even ones forwards.
    pub(super) fn odd_back_then_even(n: usize) -> Vec<usize> {
        (0..n)
            .rev()
            .filter(|i| i % 2 == 1)
            .chain((0..n).filter(|i| i % 2 == 0))
            .collect()
    }

    /// Stops the read-ahead and closes the file before removing the sample (Windows cannot
    /// delete a file still open).
    pub(super) fn remove(path: &std::path::Path, source: Arc<Source>, ahead: ReadAhead) {
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
        // Most requests are not the next in file order. What the read-ahead hands over must be
        // the file's bytes, and anything it does not have is the caller's to read (None).
        let order = odd_back_then_even(48);
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
    #[test]
    fn a_prefetch_reads_in_file_order_whatever_the_request_order() {
        let (path, tensors) = sample("eager", 24, 256 << 10);
        let source = open(&path);
        let items = source.header.tensors.clone();
        // A window as large as the file: every request, backwards, waits for the walk (none is
        // read on demand, which would return None here).
        let tally = Arc::new(SharedTotals::default());
        let ahead = ReadAhead::eager(
            source.clone(),
            tally.clone(),
            items.clone(),
            Some(Mode::Owned(Strategy::Pread)),
            ReadOptions::default(),
            64 << 20,
        );
        for i in (0..24).rev() {
            let bytes = ahead.take(i, true, &mut || false).unwrap();
            let bytes = bytes.expect("served by the walk");
            assert_eq!(bytes.as_slice(), &tensors[i].1[..], "tensor {i}");
        }
        assert_eq!(ahead.totals().bytes_read, 24 * (256 << 10));
        // Every read counted where the checkpoint's totals are (a handle's stats).
        let (counted, strategy) = tally.get();
        assert_eq!(counted.bytes, 24 * (256 << 10));
        assert_eq!(strategy, Some(Strategy::Pread));
        assert!(counted.threads >= 1);
        drop(ahead);
        // A window of two tensors: requests beyond it are the caller's, nothing waits forever.
        let small = ReadAhead::eager(
            source.clone(),
            Default::default(),
            items,
            Some(Mode::Owned(Strategy::Pread)),
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
    fn page_cache_mode_hands_nothing_over() {
        let (path, _) = sample("map", 8, 64 << 10);
        let source = open(&path);
        let ahead = ReadAhead::new(
            source.clone(),
            Default::default(),
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
