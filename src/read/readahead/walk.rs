//! The walk over the items in file order: the window it may hold, whether it reaches an item,
//! the batches it claims, and callers waiting on it.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::read::buffer::Fresh;

use super::{Mode, Shared, Slot, State};

impl Shared {
    /// Starts the walk at item `index`, the first one asked for. A walk goes in file order,
    /// except when the first request is for the first name in the order of `keys()` but not for
    /// the file's first tensor: then the caller loops over `keys()` (`for k in f.keys():
    /// f.get_tensor(k)`, as vLLM, ltx-core and transformers' `load_state_dict` do) through a
    /// file whose tensors are not in name order (safetensors writes them grouped by dtype, so a
    /// checkpoint of several dtypes has a run of each), and the walk follows the names: a file
    /// order walk would read one dtype's run while the loop asks for all of them, one after
    /// another, and reads each tensor of the others itself. A batch in name order is a few runs
    /// of the file, read in file order.
    pub(super) fn begin(&self, state: &mut State, index: usize) {
        let name = &self.items[index].name;
        let first_name = index != 0 && self.items.iter().all(|t| t.name >= *name);
        if first_name && !self.eager {
            state.by_name = true;
            state.start = 0;
        } else {
            state.start = index;
        }
    }

    /// The item at position `pos` of the walk (from its start, wrapping at the end).
    pub(super) fn item_at(&self, state: &State, pos: usize) -> usize {
        let at = (state.start + pos) % state.slots.len();
        if state.by_name {
            self.name_order()[at]
        } else {
            at
        }
    }

    /// Indices of the items in the order `keys()` gives their names (made once).
    pub(super) fn name_order(&self) -> &[usize] {
        (self.name_order).get_or_init(|| crate::format::header::keys_order(&self.items))
    }

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
            let i = self.item_at(state, pos);
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
            let i = self.item_at(state, state.scanned);
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
            // A wrap back to the walk's first tensor starts a new batch.
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
    use crate::format::dtype::Dtype;
    use crate::format::serialize;
    use crate::read::readahead::tests::{open, owned, remove, sample};

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

    #[test]
    fn a_loop_over_the_names_of_a_file_of_dtype_runs_is_walked_in_name_order() {
        // Four layers of an F32 and a U8 tensor each: the file holds one dtype's run, then the
        // other's (safetensors' order); the names (keys()' order) alternate between them.
        let dir = std::env::temp_dir().join(format!("safeload-ra-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        let names: Vec<String> = (0..4)
            .flat_map(|l| [format!("layer{l}.a.u8"), format!("layer{l}.b.f32")])
            .collect();
        let data = vec![7u8; 64];
        let (f32_shape, u8_shape) = ([16usize], [64usize]);
        let specs: Vec<serialize::TensorIn<'_>> = (names.iter())
            .map(|name| {
                let f32 = name.ends_with("f32");
                serialize::TensorIn {
                    name,
                    dtype: if f32 { Dtype::F32 } else { Dtype::U8 },
                    shape: if f32 { &f32_shape } else { &u8_shape },
                    data: &data,
                }
            })
            .collect();
        crate::storage::write::to_file(&path, &specs, None, false).unwrap();
        let source = open(&path);
        let file: Vec<&str> = (source.header.tensors.iter())
            .map(|t| t.name.as_str())
            .collect();
        assert_ne!(file, names, "the file's order is not the names'");
        let walk = |first: &str| {
            let ahead = owned(&source, 64 << 20);
            let shared = &*ahead.shared;
            let mut state = shared.lock();
            shared.begin(&mut state, source.header.index_of(first).unwrap());
            let batch = shared.claim(&mut state).expect("a batch");
            let walked: Vec<&str> = (batch.iter())
                .map(|(i, _)| source.header.tensors[*i].name.as_str())
                .collect();
            walked.join(" ")
        };
        // The loop's first request, the first name: the walk follows the names.
        assert_eq!(walk(&names[0]), names.join(" "));
        // Any other first request: file order from there to the end (the wrap is a new batch).
        let at = file.iter().position(|n| *n == names[1]).unwrap();
        assert_eq!(walk(&names[1]), file[at..].join(" "));
        assert_eq!(walk(file[0]), file.join(" "));
        drop(source);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
