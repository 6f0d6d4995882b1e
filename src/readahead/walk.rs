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

    /// Claims the next tensors of the walk that fit the window (with their destinations in
    /// [`Mode::Provided`], where the walk waits at a tensor not provided yet); None when the
    /// window is full or the walk is over (`state.scanned` says which).
    pub(super) fn claim(&self, state: &mut State) -> Option<Vec<(usize, Option<Fresh>)>> {
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
}
