//! Anonymous destination memory, and freed destination memory kept for the next load.
//!
//! A process that loads, frees and loads again (a pipeline rebuilding a model per stage, a
//! benchmark loop, a server swapping adapters) would otherwise fault fresh pages in on every load:
//! on the dev VM preads into fresh memory run at 1-4 GiB/s, into memory already faulted in at
//! 9-15 GiB/s. So a freed mapping goes to a pool, bounded in bytes, instead of back to the OS;
//! the next allocation of a similar size takes it. Pooled memory goes back to the OS after an
//! idle period (a reaper thread), when the bound is reached (oldest first), or on
//! [`release`]. A mapping is only pooled once every tensor using it is gone, so no live tensor's
//! bytes ever change.
//!
//! Every pool access uses `try_lock` and bypasses the pool when it is busy: allocation never
//! waits on it, and a child forked while another thread held the lock cannot deadlock.

use std::io;
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::platform;
use crate::read::memory;

/// An anonymous mapping of `capacity` bytes, aligned to [`platform::MAP_ALIGN`]; its memory is
/// zeroed when fresh, or holds a previous owner's bytes when it came from the pool.
pub struct Mapping {
    ptr: NonNull<u8>,
    capacity: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for Mapping {}
// SAFETY: as above; writers go through pointers whose disjointness the read plan guarantees.
unsafe impl Sync for Mapping {}

struct Pooled {
    mapping: Mapping,
    freed: Instant,
}

#[derive(Default)]
struct Pool {
    free: Vec<Pooled>,
    bytes: usize,
    reaper: bool,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    bytes: 0,
    reaper: false,
});

/// Bytes the pool may hold: `SAFELOAD_POOL_BYTES` when set (0 turns it off), else a quarter of
/// what the process may take (see [`crate::read::memory`]: the host's available memory, the cgroup's
/// headroom, `SAFELOAD_MEMORY_LIMIT`), counting what the pool holds as its own, at most 16 GiB.
/// Worked out again at every free and by the reaper, so the pool shrinks with the headroom.
pub fn limit() -> usize {
    let available = memory::available();
    limit_with(POOL.try_lock().map_or(0, |p| p.bytes), available)
}

/// [`limit`] when the pool holds `pooled` bytes and the process may take `available` more
/// (read by the caller before it takes the pool's lock: it may read a few files).
fn limit_with(pooled: usize, available: Option<u64>) -> usize {
    static FIXED: OnceLock<Option<usize>> = OnceLock::new();
    let fixed = *FIXED.get_or_init(|| {
        std::env::var("SAFELOAD_POOL_BYTES")
            .ok()
            .and_then(|v| memory::parse_bytes(&v))
            .map(|b| b as usize)
    });
    if let Some(bytes) = fixed {
        return bytes;
    }
    available.map_or(0, |m| ((m + pooled as u64) / 4).min(16 << 30) as usize)
}

/// How long freed memory stays pooled: `SAFELOAD_POOL_IDLE_S` (seconds), else 10 s.
fn idle() -> Duration {
    static IDLE: OnceLock<Duration> = OnceLock::new();
    *IDLE.get_or_init(|| {
        let secs = std::env::var("SAFELOAD_POOL_IDLE_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .unwrap_or(10.0);
        Duration::from_secs_f64(secs)
    })
}

/// A pooled mapping fits a request when it is at least as large and wastes at most an eighth
/// plus one huge page.
fn fits(capacity: usize, need: usize) -> bool {
    capacity >= need && capacity - need <= need / 8 + (2 << 20)
}

impl Mapping {
    /// At least `len` bytes: the best-fitting pooled mapping, else a fresh one.
    pub fn take(len: usize) -> io::Result<Mapping> {
        let need = len.max(1).next_multiple_of(platform::page_size());
        let mut evicted = Vec::new();
        let available = memory::available();
        if let Ok(mut pool) = POOL.try_lock() {
            if let Some(mapping) = pool.take_fit(need) {
                return Ok(mapping);
            }
            // New memory is about to be taken: the pool keeps no more than the headroom left
            // for it (the rest goes back to the OS first, outside the lock).
            if pool.bytes > 0 {
                let limit = limit_with(pool.bytes, available);
                evicted = pool.evict_over(limit);
            }
        }
        evicted.into_iter().for_each(Mapping::unmap);
        Self::fresh(need)
    }

    /// A new mapping of `need` bytes (a multiple of the page size), bypassing the pool.
    fn fresh(need: usize) -> io::Result<Mapping> {
        let ptr = platform::map_anonymous(need)?;
        memory::account(need as i64);
        Ok(Mapping {
            ptr,
            capacity: need,
        })
    }

    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.capacity == 0 {
            return; // unmapped already, or moved into the pool
        }
        // The bound counts this mapping as pooled (the memory the process has either way).
        let available = memory::available();
        if let Ok(mut pool) = POOL.try_lock()
            && let limit = limit_with(pool.bytes + self.capacity, available)
            && self.capacity <= limit
        {
            let mapping = Mapping {
                ptr: self.ptr,
                capacity: self.capacity,
            };
            self.capacity = 0; // ownership moved to the pool
            // Over the bound: the oldest go back to the OS (they are dropped with capacity 0
            // after being unmapped here, outside this recursion).
            let evicted = pool.put(mapping, limit);
            if !pool.reaper {
                pool.reaper = start_reaper();
            }
            drop(pool);
            evicted.into_iter().for_each(Mapping::unmap);
            return;
        }
        self.release();
    }
}

impl Mapping {
    /// Gives the memory back to the OS, bypassing the pool.
    fn unmap(mut self) {
        self.release();
    }

    /// Unmaps the memory now; the mapping is empty afterwards (its drop does nothing).
    fn release(&mut self) {
        if self.capacity > 0 {
            // SAFETY: ptr/capacity are exactly one map_anonymous result, used by no one now.
            unsafe { platform::unmap_anonymous(self.ptr, self.capacity) };
            memory::account(-(self.capacity as i64));
        }
        self.capacity = 0;
    }
}

impl Pool {
    /// The best-fitting pooled mapping for `need` bytes, taken out of the pool.
    fn take_fit(&mut self, need: usize) -> Option<Mapping> {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, p)| fits(p.mapping.capacity, need))
            .min_by_key(|(_, p)| p.mapping.capacity)
            .map(|(i, _)| i)?;
        let p = self.free.swap_remove(best);
        self.bytes -= p.mapping.capacity;
        Some(p.mapping)
    }

    /// Pools `mapping`, then takes the oldest out until at most `limit` bytes are pooled; the
    /// caller unmaps what comes back (outside the lock).
    fn put(&mut self, mapping: Mapping, limit: usize) -> Vec<Mapping> {
        self.bytes += mapping.capacity;
        self.free.push(Pooled {
            mapping,
            freed: Instant::now(),
        });
        self.evict_over(limit)
    }

    /// Takes the oldest mappings out until at most `limit` bytes are pooled; the caller unmaps
    /// them (outside the lock).
    fn evict_over(&mut self, limit: usize) -> Vec<Mapping> {
        let mut evicted = Vec::new();
        while self.bytes > limit {
            let oldest = self
                .free
                .iter()
                .enumerate()
                .min_by_key(|(_, p)| p.freed)
                .map(|(i, _)| i)
                .expect("bytes > 0 means entries");
            let p = self.free.swap_remove(oldest);
            self.bytes -= p.mapping.capacity;
            evicted.push(p.mapping);
        }
        evicted
    }
}

/// Starts the thread that returns idle pooled memory; false if it could not be started (then
/// the next free tries again).
fn start_reaper() -> bool {
    std::thread::Builder::new()
        .name("safeload-pool".into())
        .spawn(|| {
            loop {
                let idle = idle();
                std::thread::sleep(idle.max(Duration::from_millis(50)) / 2);
                let mut expired = Vec::new();
                let available = memory::available();
                let Ok(mut pool) = POOL.lock() else { return };
                let now = Instant::now();
                let mut i = 0;
                while i < pool.free.len() {
                    if now.duration_since(pool.free[i].freed) >= idle {
                        let p = pool.free.swap_remove(i);
                        pool.bytes -= p.mapping.capacity;
                        expired.push(p.mapping);
                    } else {
                        i += 1;
                    }
                }
                // The headroom may have shrunk since these were pooled.
                let limit = limit_with(pool.bytes, available);
                expired.extend(pool.evict_over(limit));
                let empty = pool.free.is_empty();
                if empty {
                    pool.reaper = false;
                }
                drop(pool);
                expired.into_iter().for_each(Mapping::unmap);
                if empty {
                    return;
                }
            }
        })
        .is_ok()
}

/// Gives every pooled mapping back to the OS now; returns the bytes released.
pub fn release() -> usize {
    let drained: Vec<Pooled> = match POOL.lock() {
        Ok(mut pool) => {
            pool.bytes = 0;
            std::mem::take(&mut pool.free)
        }
        Err(_) => return 0,
    };
    let bytes = drained.iter().map(|p| p.mapping.capacity).sum();
    drained.into_iter().for_each(|p| p.mapping.unmap());
    bytes
}

/// Bytes held by the pool now.
pub fn pooled_bytes() -> usize {
    POOL.lock().map_or(0, |p| p.bytes)
}

/// Checks that `needed` bytes of new owned memory fit what is available, giving the pool's
/// memory back first when that makes them fit; else an error naming `what` is loaded, the bytes
/// needed and available, and what to do instead. Nothing has been read when it fails.
pub fn ensure_fits(needed: u64, what: impl FnOnce() -> String) -> Result<()> {
    let fits = |b: &memory::Budget| b.available().is_none_or(|a| needed <= a);
    if fits(&memory::snapshot()) {
        return Ok(());
    }
    if pooled_bytes() > 0 {
        release();
        memory::forget_snapshot();
    }
    let budget = memory::snapshot();
    if fits(&budget) {
        return Ok(());
    }
    let available = budget.available().unwrap_or(0);
    Err(Error::Memory(format!(
        "loading {} needs {needed} bytes ({:.2} GiB) of new memory, but {available} bytes \
         ({:.2} GiB) are available ({}): map it instead (backend=\"mmap\" or \"auto\", which \
         shares the page cache), stream it (safeload.torch.iter_checkpoint, with a \
         max_inflight_bytes below what is available), or raise the limit",
        what(),
        needed as f64 / (1u64 << 30) as f64,
        available as f64 / (1u64 << 30) as f64,
        budget.source(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_rule() {
        assert!(fits(8 << 20, 8 << 20));
        assert!(fits(10 << 20, 8 << 20));
        assert!(!fits(12 << 20, 8 << 20));
        assert!(!fits(4 << 20, 8 << 20));
        assert!(fits(512 << 20, 480 << 20));
    }

    #[test]
    fn freed_memory_is_reused_then_released() {
        // A pool of its own: the process-wide one is shared with every other test's loads.
        let mut pool = Pool::default();
        let len = 24 << 20;
        let first = Mapping::fresh(len).unwrap();
        let addr = first.as_ptr();
        // SAFETY: the mapping is ours and `len` bytes long.
        unsafe { addr.as_ptr().write_bytes(7, len) };
        assert!(pool.put(first, 1 << 30).is_empty());
        assert_eq!(pool.bytes, len);
        let second = pool.take_fit(len - 4096).expect("a similar size fits");
        assert_eq!(
            second.as_ptr(),
            addr,
            "a similar size reuses the freed mapping"
        );
        // SAFETY: in bounds; the pooled memory keeps what was written (already faulted in).
        assert_eq!(unsafe { *second.as_ptr().as_ptr().add(len / 2) }, 7);
        assert!(pool.put(second, 1 << 30).is_empty());
        assert!(
            pool.take_fit(len * 4).is_none(),
            "a much larger size gets fresh memory"
        );
        assert!(pool.take_fit(len / 4).is_none(), "a much smaller one too");
        // Over the bound: the oldest goes back.
        let other = Mapping::fresh(len).unwrap();
        let evicted = pool.put(other, len);
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0].as_ptr(), addr, "the oldest is evicted first");
        assert_eq!(pool.bytes, len);
        evicted.into_iter().for_each(Mapping::unmap);
        for p in std::mem::take(&mut pool.free) {
            p.mapping.unmap();
        }
    }
}
