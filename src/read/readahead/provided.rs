//! Provided memory ([`Mode::Provided`]): the caller makes the destinations the walk names
//! ([`ReadAhead::wanted`]) and hands them over ([`ReadAhead::provide`]); the workers read into them.

use crate::error::{Error, Result};
use crate::read::buffer::Fresh;

use super::{Mode, ReadAhead, Shared, Slot};

impl ReadAhead {
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
            shared.begin(&mut state, index);
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
            let i = shared.item_at(&state, pos);
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
        shared.wake(&state);
        result
    }
}

impl Shared {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::read::readahead::tests::{odd_back_then_even, open, owned, remove, sample};
    use crate::read::source::ReadOptions;

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
            Default::default(),
            Mode::Provided,
            ReadOptions::default(),
            budget,
        );
        assert!(
            owned(&source, budget).wanted(0).is_empty(),
            "only provided mode asks"
        );
        let order = odd_back_then_even(40);
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
        let fresh = ReadAhead::new(
            source2,
            Default::default(),
            Mode::Provided,
            ReadOptions::default(),
            budget,
        );
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
}
