//! The backend asked for and the strategy that reads a file fastest, from what it lives on
//! (`platform::FsKind`), its page-cache residency (`mincore`) and available memory; workers
//! and request sizes per filesystem.

use std::fs::File;

use crate::platform;

use crate::platform::FsKind;

/// Fraction (0..=1) of `len` bytes from `offset` that sit in the page cache, sampled (see
/// [`platform::cached_fraction`]); None when it cannot be told.
pub fn cached_fraction(file: &File, offset: u64, len: u64) -> Option<f64> {
    platform::cached_fraction(file, offset, len)
}

/// What the caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Auto,
    Mmap,
    Pread,
    Direct,
}

impl Backend {
    /// Every name a caller may give, with its backend.
    pub const ALL: [(&'static str, Backend); 4] = [
        ("auto", Backend::Auto),
        ("direct", Backend::Direct),
        ("mmap", Backend::Mmap),
        ("pread", Backend::Pread),
    ];
    /// Accepted names, for error messages.
    pub const NAMES: &'static str = "\"auto\", \"direct\", \"mmap\", \"pread\"";
    /// Environment variable that replaces the default backend ("auto") for every load.
    pub const ENV: &'static str = "SAFELOAD_BACKEND";

    pub fn parse(name: &str) -> Option<Backend> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
    }

    /// The backend a call asks for by `name`: "auto" (the default) gives way to
    /// `$SAFELOAD_BACKEND` where that is set; a name that is none of [`Backend::NAMES`] is an
    /// error saying which are.
    pub fn requested(name: &str) -> crate::error::Result<Backend> {
        let from_env = std::env::var(Self::ENV).ok().filter(|v| !v.is_empty());
        let name = match (name, &from_env) {
            ("auto", Some(env)) => env.as_str(),
            _ => name,
        };
        Self::parse(name).ok_or_else(|| {
            crate::error::Error::Argument(format!(
                "backend {name:?} is invalid (expected one of: {})",
                Self::NAMES
            ))
        })
    }

    /// Refuses a backend that cannot do what the read options ask: a map reads nothing, so it
    /// has no pages of its own to drop after reading (`drop_cache`), and no bytes pass through
    /// the reader to be hashed (`hash`). "auto" with either reads instead
    /// ([`crate::read::source::Source::resolve_measured`]).
    pub fn check(self, drop_cache: bool, hash: bool) -> crate::error::Result<Backend> {
        let asked = match (drop_cache, hash) {
            (true, _) => {
                "drop_cache=True drops a file's pages from the page cache after reading them"
            }
            (_, true) => "hashing a file needs the reader to read its bytes",
            _ => return Ok(self),
        };
        if self != Backend::Mmap {
            return Ok(self);
        }
        Err(crate::error::Error::Argument(format!(
            "{asked}, and backend \"mmap\" reads none (its tensors are the mapped pages): use \
             backend=\"auto\" (which then reads), \"pread\" or \"direct\""
        )))
    }
}

/// A concrete way of reading a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Mmap,
    Pread,
    Direct,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Mmap => "mmap",
            Strategy::Pread => "pread",
            Strategy::Direct => "direct",
        }
    }
}

/// What a read is for: with the backend's resolution for the file, what decides how it is done
/// ([`for_purpose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Whole tensors into new memory as the file holds them: views of the map where the
    /// backend maps.
    Views,
    /// Parts of tensors (`get_slice(k)[...]`): cut out of the map where the backend maps, else
    /// only the rows they need read.
    Parts,
    /// Bytes copied into memory that is not the map's: the caller's tensors (`load_into`,
    /// `load_model`), a device's staging buffers or host alias, tensors converted on the way.
    Copies,
}

/// How a read for `purpose` is done: the one place that turns a backend's resolution for a file
/// (`resolved`, with the page-cache residency measured for it, `cached`) into the strategy that
/// reads. Every read of a [`crate::checkpoint::Checkpoint`] asks it; nothing else rewrites a
/// strategy.
///
/// - A map gives views and parts; a copy out of it would fault every page in and then copy, so
///   copies read instead: from the page cache when warm (pread), around it when cold (uncached
///   reads keep the disk's queue full where buffered reads wait on readahead a window at a time:
///   docs/backends.md, "Reading into a model"). Not measured (an explicit `"mmap"`): pread.
/// - Uncached reads the filesystem refused (`direct_refused`, seen by an earlier read): pread.
/// - Otherwise what was resolved (`pread`, `direct`) reads for every purpose.
pub fn for_purpose(
    resolved: Strategy,
    cached: Option<f64>,
    purpose: Purpose,
    direct_refused: bool,
) -> Strategy {
    let strategy = match (resolved, purpose) {
        (Strategy::Mmap, Purpose::Copies) => match cached {
            Some(fraction) if fraction < COLD_BELOW => Strategy::Direct,
            _ => Strategy::Pread,
        },
        (strategy, _) => strategy,
    };
    match strategy {
        Strategy::Direct if direct_refused => Strategy::Pread,
        strategy => strategy,
    }
}

/// Whether views of a map have their pages made resident ahead of the caller's touches (the
/// read-ahead in page-cache mode), from the fraction of the data in the page cache (`cached`,
/// measured when the read-ahead would start): only where some of it is not. A resident file's
/// pages are there already; making them resident would only fill page tables for pages the
/// caller may never touch, a cost that grows with the file where safetensors 0.8's map costs
/// nothing (measured: `load_file` of a warm 0.5 GiB file, 8.8 ms against 0.8's 1.6 ms, all of
/// it in `MADV_POPULATE_READ` and `WILLNEED`). Unknown: read ahead.
pub fn populate_ahead(cached: Option<f64>) -> bool {
    cached.is_none_or(|fraction| fraction < RESIDENT)
}

/// At or above this fraction of its data in the page cache (as sampled), a file counts as
/// resident.
pub const RESIDENT: f64 = 0.99;

/// Below this fraction of the file in the page cache, a local file counts as cold.
pub const COLD_BELOW: f64 = 0.5;

/// Cold local files with more data than this are read with O_DIRECT by "auto":
/// `SAFELOAD_DIRECT_ABOVE` (bytes) when set, else half of `available` (what the process may
/// take, [`crate::read::memory::available`]).
pub fn direct_above(available: Option<u64>) -> Option<u64> {
    match std::env::var("SAFELOAD_DIRECT_ABOVE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(bytes) => Some(bytes),
        None => available.map(|free| free / 2),
    }
}

/// Where "auto" may map files: [`platform::MAP_IS_SAFE`] (not on Windows), unless
/// `SAFELOAD_AUTO_MMAP=0`.
pub fn auto_may_map() -> bool {
    platform::MAP_IS_SAFE && std::env::var("SAFELOAD_AUTO_MMAP").as_deref() != Ok("0")
}

/// The backend "auto" picks for a file of `data_len` bytes (a read that copies, a device's
/// among them, reads instead of mapping: [`for_purpose`]).
///
/// - Network and FUSE filesystems, never mmap (every page fault would be a small remote read,
///   and truncation under a map is SIGBUS): cold, uncached reads (O_DIRECT), which the kernel
///   does not funnel through FUSE readahead and its `max_background` cap (12 requests in flight
///   by default): measured through a 2 ms FUSE mount, buffered readers stop near 0.6 GiB/s
///   however many threads they run, O_DIRECT readers reach 2.5 GiB/s. Where the mount refuses
///   O_DIRECT the engine falls back to buffered reads. Warm (the pages are already in this
///   machine's cache): buffered parallel pread, a memory copy.
/// - Local and memory filesystems: a private map, zero copy, as safetensors 0.8's default does
///   (with the same sequential read-ahead advice): warm, every other way copies what is already in
///   memory into fresh memory, 20-100x slower on the dev VM; cold, the page cache has to be filled
///   anyway and the map uses it without a second copy (docs/backends.md has the table).
/// - Except cold local files holding more than half of the available memory ([`direct_above`]):
///   O_DIRECT, so that a load does not push the rest of the page cache (or its own tensors) out;
///   unless they hold more than the process may take at all (`available`, see
///   [`crate::read::memory`]): then a map, whose pages the kernel can reclaim, where owned memory would
///   not fit.
/// - Where maps are not safe (`may_map` false: Windows, locked and crashing maps), parallel pread.
pub fn choose(
    kind: FsKind,
    cached: Option<f64>,
    data_len: u64,
    direct_above: Option<u64>,
    may_map: bool,
    available: Option<u64>,
) -> Strategy {
    let fits = available.is_none_or(|a| data_len <= a);
    if let FsKind::Network(_) = kind {
        return match cached {
            Some(f) if f >= COLD_BELOW => Strategy::Pread,
            _ => Strategy::Direct,
        };
    }
    match (cached, direct_above) {
        (Some(f), Some(limit))
            if kind == FsKind::Local
                && f < COLD_BELOW
                && data_len > limit
                && (fits || !may_map) =>
        {
            Strategy::Direct
        }
        _ if may_map => Strategy::Mmap,
        _ => Strategy::Pread,
    }
}

/// Workers for a strategy on a filesystem: network reads wait on round trips, so many more
/// requests are kept in flight than there are cores: 16, or as many as the FUSE connection lets
/// the kernel keep in flight (`max_background`, where it can be read), up to 8 per core and 64.
/// Measured through a 2 ms slowfs mount on 2 cores (docs/backends.md, "Storage"): uncached 1 MiB reads by
/// 16 workers 3.48 GiB/s, by 32 2.67, by 64 2.14 (the CPU is the limit there), by 8 2.74.
pub fn threads_for(kind: FsKind, cores: usize, in_flight: Option<usize>) -> usize {
    match kind {
        FsKind::Network(_) => 16
            .max(cores)
            .max(in_flight.unwrap_or(0).min(8 * cores).min(64)),
        _ => cores.clamp(2, 8),
    }
}

/// Bytes per read request: 8 MiB locally; 4 MiB on network filesystems. Measured through a
/// 2 ms slowfs mount, kernel defaults, 16 workers: safeload's default load in fresh processes
/// (5 interleaved rounds, medians) 2.05 GiB/s with 4 MiB, 1.80 with 1 MiB (fewer, larger reads
/// fault the fresh destination memory in with less overhead); raw uncached reads into reused
/// buffers 2.91 with 4 MiB, 3.48 with 1 MiB, 2.00 with 16 MiB; buffered 0.64 / 0.65 / 0.60
/// (readahead sends 128 KiB requests whatever the read size).
pub fn chunk_bytes_for(kind: FsKind) -> usize {
    match kind {
        FsKind::Network(_) => 4 << 20,
        _ => crate::read::plan::DEFAULT_CHUNK_BYTES,
    }
}

/// Drops a file's clean pages from the page cache (load-once hygiene) where the OS can.
pub fn drop_cached(file: &File) {
    platform::drop_cache(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_has_no_pages_of_its_own_to_drop_nor_bytes_to_hash() {
        // (drop_cache, hash) asked for, and how the refusal starts.
        for (drop_cache, hash, says) in [(true, false, "drop_cache=True"), (false, true, "hashing")]
        {
            let err = Backend::Mmap
                .check(drop_cache, hash)
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with(says) && err.contains("backend \"mmap\" reads none"),
                "{err}"
            );
            for backend in [Backend::Auto, Backend::Pread, Backend::Direct] {
                assert_eq!(backend.check(drop_cache, hash).unwrap(), backend);
            }
        }
        assert_eq!(Backend::Mmap.check(false, false).unwrap(), Backend::Mmap);
    }

    #[test]
    fn every_purpose_of_every_resolution() {
        use Purpose::*;
        use Strategy::*;
        // (resolved, cached, purpose, direct refused) -> strategy
        let table = [
            (Mmap, Some(1.0), Views, false, Mmap),
            (Mmap, Some(0.0), Views, false, Mmap),
            (Mmap, None, Parts, false, Mmap),
            (Mmap, Some(1.0), Copies, false, Pread),
            (Mmap, Some(0.2), Copies, false, Direct),
            (Mmap, Some(0.2), Copies, true, Pread),
            (Mmap, None, Copies, false, Pread),
            (Pread, Some(0.0), Views, false, Pread),
            (Pread, Some(0.0), Parts, false, Pread),
            (Pread, Some(0.0), Copies, false, Pread),
            (Direct, None, Views, false, Direct),
            (Direct, None, Parts, false, Direct),
            (Direct, None, Copies, false, Direct),
            (Direct, None, Views, true, Pread),
            (Direct, None, Copies, true, Pread),
        ];
        for (resolved, cached, purpose, refused, want) in table {
            assert_eq!(
                for_purpose(resolved, cached, purpose, refused),
                want,
                "{resolved:?} {cached:?} {purpose:?} refused={refused}"
            );
        }
    }

    #[test]
    fn a_map_is_populated_ahead_only_where_pages_are_missing() {
        assert!(!populate_ahead(Some(1.0)));
        assert!(!populate_ahead(Some(RESIDENT)));
        assert!(populate_ahead(Some(0.9)));
        assert!(populate_ahead(Some(0.0)));
        assert!(populate_ahead(None));
    }

    #[test]
    fn choices() {
        const GIB: u64 = 1 << 30;
        let fuse = FsKind::Network("fuse");
        // Network: uncached when cold (past FUSE readahead's cap), a copy from the cache when warm.
        assert_eq!(
            choose(fuse, Some(0.0), 100 * GIB, Some(GIB), true, None),
            Strategy::Direct
        );
        assert_eq!(
            choose(fuse, None, GIB, Some(GIB), true, None),
            Strategy::Direct
        );
        assert_eq!(
            choose(fuse, Some(1.0), GIB, Some(GIB), true, None),
            Strategy::Pread
        );
        // Local, warm or cold: the map, as safetensors' default.
        for cached in [Some(0.0), Some(1.0), None] {
            assert_eq!(
                choose(FsKind::Local, cached, 2 * GIB, Some(10 * GIB), true, None),
                Strategy::Mmap
            );
            assert_eq!(
                choose(FsKind::Memory, cached, 12 * GIB, Some(GIB), true, None),
                Strategy::Mmap
            );
        }
        // Cold and larger than half the available memory: around the page cache.
        assert_eq!(
            choose(
                FsKind::Local,
                Some(0.0),
                12 * GIB,
                Some(10 * GIB),
                true,
                None
            ),
            Strategy::Direct
        );
        assert_eq!(
            choose(
                FsKind::Local,
                Some(1.0),
                12 * GIB,
                Some(10 * GIB),
                true,
                None
            ),
            Strategy::Mmap
        );
        // Cold and larger than all the process may take (a container's limit): the map, whose
        // pages the kernel can reclaim; owned memory would not fit.
        assert_eq!(
            choose(
                FsKind::Local,
                Some(0.0),
                12 * GIB,
                Some(GIB),
                true,
                Some(2 * GIB)
            ),
            Strategy::Mmap
        );
        assert_eq!(
            choose(
                FsKind::Local,
                Some(0.0),
                3 * GIB,
                Some(GIB),
                true,
                Some(4 * GIB)
            ),
            Strategy::Direct
        );
        // No maps (Windows): the parallel reader.
        assert_eq!(
            choose(FsKind::Local, None, GIB, Some(10 * GIB), false, None),
            Strategy::Pread
        );
        assert_eq!(
            choose(
                FsKind::Local,
                Some(0.0),
                12 * GIB,
                Some(10 * GIB),
                false,
                None
            ),
            Strategy::Direct
        );
        assert!(threads_for(FsKind::Network("nfs"), 2, None) >= 16);
        assert_eq!(threads_for(FsKind::Network("fuse"), 2, Some(12)), 16);
        assert_eq!(threads_for(FsKind::Network("fuse"), 2, Some(128)), 16);
        assert_eq!(threads_for(FsKind::Network("fuse"), 16, Some(128)), 64);
        assert_eq!(threads_for(FsKind::Local, 2, Some(128)), 2);
    }
}
