//! The walk over the items in file order: the window it may hold, whether it reaches an item,
//! the batches it claims, and callers waiting on it.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use crate::buffer::Fresh;
use crate::error::{Error, Result};

use super::{Mode, Shared, Slot, State};

impl Shared {
    /// Waits a while for the workers, then checks for cancellation. `poll` may wait for the
    /// GIL, whose holder may be waiting for this lock (`wanted`, `provide`, the stats): it is
    /// never called holding it.
    pub(super) fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        poll: &mut dyn FnMut() -> bool,
    ) -> Result<MutexGuard<'a, State>> {
        drop(self.wait_a_while(state));
        if poll() {
            return Err(Error::Cancelled);
        }
        Ok(self.lock())
    }

    /// Whether the walk reaches item `index` within the window as things stand: the bytes held
    /// and those of the items it will claim before it fit (the walk advances on its own then).
    pub(super) fn reaches(&self, state: &State, index: usize) -> bool {
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

    pub(super) fn window(&self, state: &State) -> u64 {
        if state.want_all {
            return u64::MAX;
        }
        self.budget.min(self.first_window.max(state.taken))
    }

    /// Whether a worker claims a batch now: there is room in the window for a batch (or half
    /// the window, when that is less), nothing is held, a caller waits, or tensors are provided
    /// (counted when provided). A walk that claimed whatever room each take freed would read
    /// a small tensor or two a batch, with a wake-up and a read each, once it is a window ahead
    /// of a loop of small tensors.
    pub(super) fn worth_claiming(&self, state: &State) -> bool {
        if self.mode == Mode::Provided || state.held == 0 || state.waiters > 0 {
            return true;
        }
        let window = self.window(state);
        window.saturating_sub(state.held) >= self.batch_limit.min(window / 8)
    }

    /// Claims the next tensors of the walk that fit the window (with their destinations in
    /// [`Mode::Provided`], where the walk waits at a tensor not provided yet); None when the
    /// window has no room worth claiming or the walk is over (`state.scanned` says which).
    pub(super) fn claim(&self, state: &mut State) -> Option<Vec<(usize, Option<Fresh>)>> {
        let n = state.slots.len();
        let provided = self.mode == Mode::Provided;
        if !self.worth_claiming(state) {
            return None;
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readahead::tests::{open, owned, remove, sample};

    #[test]
    fn a_walk_a_window_ahead_claims_again_once_a_batch_fits_not_at_every_take() {
        // 64 tensors of 16 KiB and a window of 512 KiB (32 of them): the walk claims again once
        // an eighth of the window (4 tensors) is free. No worker runs: the test claims.
        let (path, _) = sample("hysteresis", 64, 16 << 10);
        let source = open(&path);
        let ahead = owned(&source, 512 << 10);
        let shared = &*ahead.shared;
        let mut state = shared.lock();
        let first = shared
            .claim(&mut state)
            .expect("an empty window is claimed");
        assert_eq!(first.len(), 32);
        for (i, _) in &first {
            state.slots[*i] = Slot::Ready(None); // read
        }
        drop(state);
        for i in 0..3 {
            ahead.take(i, false, &mut || false).unwrap();
            let claimed = shared.claim(&mut shared.lock()).map(|b| b.len());
            assert_eq!(claimed, None, "claimed after {} takes", i + 1);
        }
        ahead.take(3, false, &mut || false).unwrap();
        let claimed = shared.claim(&mut shared.lock()).map(|b| b.len());
        assert_eq!(claimed, Some(4));
        remove(&path, source, ahead);
    }
}
