//! Cancellation of waits that block the calling thread (an object store's response at open, an
//! index fetch, a listing, a slice's rows): the caller installs a poll for the call's duration
//! with [`with_poll`]; a wait asks [`requested`] between its steps and gives up when it says so.
//!
//! The engine's reads are cancelled otherwise, through the `poll` they are given and the stop
//! flag their workers share (`engine`); this covers the waits outside it, which run on the
//! caller's own thread. A poll is a plain function (the binding's checks for Ctrl-C), so nothing
//! borrowed outlives the call. Once it has said "stop", every later [`requested`] in the same
//! call says so too: a wait that swallowed one error cannot start another.

use std::cell::Cell;

/// The poll installed on a thread, and whether it has asked to stop.
type Installed = (Option<fn() -> bool>, bool);

thread_local! {
    static POLL: Cell<Installed> = const { Cell::new((None, false)) };
}

/// Runs `f` with `poll` installed on this thread (and restores what was there before).
pub fn with_poll<T>(poll: fn() -> bool, f: impl FnOnce() -> T) -> T {
    struct Restore(Installed);
    impl Drop for Restore {
        fn drop(&mut self) {
            POLL.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(POLL.with(|p| p.replace((Some(poll), false))));
    f()
}

/// Whether the call running on this thread was asked to stop (false where no poll is installed,
/// as on the engine's workers).
pub fn requested() -> bool {
    POLL.with(|p| match p.get() {
        (_, true) => true,
        (None, false) => false,
        (Some(poll), false) => {
            let stop = poll();
            if stop {
                p.set((Some(poll), true));
            }
            stop
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    fn third_call_stops() -> bool {
        CALLS.fetch_add(1, Ordering::Relaxed) + 1 >= 3
    }

    #[test]
    fn a_stop_sticks_for_the_call_and_ends_with_it() {
        assert!(!requested(), "nothing installed: never stop");
        with_poll(third_call_stops, || {
            assert!(!requested());
            assert!(!requested());
            assert!(requested());
            CALLS.store(0, Ordering::Relaxed); // the poll would now say "go on": the stop sticks
            assert!(requested());
        });
        assert!(!requested(), "restored after the call");
        let nested = with_poll(|| false, || with_poll(|| true, requested));
        assert!(nested);
        with_poll(
            || false,
            || assert!(!requested(), "an inner call's stop is its own"),
        );
    }

    #[test]
    fn other_threads_see_no_poll() {
        with_poll(
            || true,
            || std::thread::scope(|s| assert!(!s.spawn(requested).join().unwrap())),
        );
    }
}
