//! What reads moved, counted: [`ReadCounts`] (one read's, as the engine counts it, or several
//! added up) and [`SharedTotals`] (a checkpoint's, added up across the threads that read for it).
//! The statistics types, one per layer: these two here; `checkpoint::ReadStats` (what a read or
//! the totals did, with the strategy and storage callers are told); the binding's `Stats` and
//! `StagingStats` (the same for Python, and a device staging ring's own figures).

use std::sync::Mutex;

use crate::read::strategy::Strategy;

/// What reads moved, as the engine counts them: the bytes read from files, the seconds spent,
/// the most workers one ran, and whether uncached reads were refused (and buffered reads used
/// instead). One read's, or several added up ([`ReadCounts::add`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadCounts {
    pub bytes: u64,
    pub seconds: f64,
    pub threads: usize,
    /// Uncached reads were refused (EINVAL) and buffered reads were used instead.
    pub direct_refused: bool,
}

impl ReadCounts {
    /// The strategy a read asked to use `asked` ran with (`strategy::ran_with`).
    pub fn ran_with(&self, asked: Strategy) -> Strategy {
        crate::read::strategy::ran_with(asked, self.direct_refused)
    }

    /// Adds `other` in: bytes and seconds add up, the most workers either used.
    pub fn add(&mut self, other: &ReadCounts) {
        self.bytes += other.bytes;
        self.seconds += other.seconds;
        self.threads = self.threads.max(other.threads);
        self.direct_refused |= other.direct_refused;
    }
}

/// A checkpoint's [`ReadCounts`] added up as its reads finish, on whichever thread (its
/// read-aheads' and prefetch loaders' included, so a handle's stats count every read made for
/// it), with the strategy of the latest read that moved bytes (the first read's while none has).
#[derive(Debug, Default)]
pub struct SharedTotals(Mutex<(ReadCounts, Option<Strategy>)>);

impl SharedTotals {
    /// Counts one read that asked for `strategy`.
    pub fn add(&self, strategy: Strategy, report: &ReadCounts) {
        let strategy = report.ran_with(strategy);
        let mut tally = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (sum, latest) = &mut *tally;
        sum.add(&ReadCounts {
            direct_refused: false,
            ..*report
        });
        if report.bytes > 0 || latest.is_none() {
            *latest = Some(strategy);
        }
    }

    /// The reads so far, and the strategy of the latest that moved bytes.
    pub fn get(&self) -> (ReadCounts, Option<Strategy>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
