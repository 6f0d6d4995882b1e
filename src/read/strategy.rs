//! The read plan: how every read is done, decided here and nowhere else. From what the caller
//! asked (the [`Backend`], with `SAFELOAD_BACKEND` and a patch's forced backend: [`Backend::requested`]),
//! what the file is (what it lives on, `platform::FsKind`; whether it can be mapped; its size), what
//! is known of it (its page-cache residency, `mincore`; available memory; uncached reads refused
//! earlier; a pinned digest) and what the read is for ([`Purpose`]), [`resolve`] and [`plan`] give
//! the [`Plan`] every read path executes: the strategy that reads and what is read ahead around
//! it ([`Mode`]). Workers and request sizes per filesystem are here too ([`threads_for`],
//! [`chunk_bytes_for`]). The table tests at the end cover every case.

use std::fs::File;

use crate::platform;

use crate::platform::FsKind;

/// Fraction (0..=1) of `len` bytes from `offset` that sit in the page cache, sampled (see
/// [`platform::cached_fraction`]); None when it cannot be told.
pub fn cached_fraction(file: &File, offset: u64, len: u64) -> Option<f64> {
    platform::cached_fraction(file, offset, len)
}

/// What the caller asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
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

    /// The name a caller gives for this backend.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, b)| *b == self)
            .map_or("auto", |(n, _)| n)
    }

    pub fn parse(name: &str) -> Option<Backend> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
    }

    /// Environment variable that turns the patch on at interpreter start (`safeload.patch`); a
    /// backend name there also forces that backend on every load ([`Backend::forced`]).
    pub const PATCH_ENV: &'static str = "SAFELOAD_PATCH";

    /// The backend a call asks for by `name`, after the process's overrides, the one place they
    /// are read: a forced backend ([`Backend::forced`]) replaces whatever the call asks (a
    /// library's explicit `backend="mmap"` included); else "auto" (the default) gives way to
    /// `$SAFELOAD_BACKEND` where that is set. A name that is none of [`Backend::NAMES`] is an
    /// error saying which are, forced or not.
    pub fn requested(name: &str) -> crate::error::Result<Backend> {
        let env = std::env::var(Self::ENV).ok();
        Self::requested_with(name, Self::forced(), env.as_deref())
    }

    /// [`Backend::requested`] with the overrides given: `forced`, and `env`, the value of
    /// `$SAFELOAD_BACKEND` (empty: unset).
    fn requested_with(
        name: &str,
        forced: Option<Backend>,
        env: Option<&str>,
    ) -> crate::error::Result<Backend> {
        let asked = Self::named(name)?;
        if let Some(forced) = forced {
            return Ok(forced);
        }
        match env.filter(|v| !v.is_empty()) {
            Some(env) if asked == Backend::Auto => Self::named(env),
            _ => Ok(asked),
        }
    }

    fn named(name: &str) -> crate::error::Result<Backend> {
        Self::parse(name).ok_or_else(|| {
            crate::error::Error::Argument(format!(
                "backend {name:?} is invalid (expected one of: {})",
                Self::NAMES
            ))
        })
    }

    /// Forces `backend` on every load of this process from now on (None: no longer), over
    /// `$SAFELOAD_PATCH`'s: what `safeload.patch(backend=)` sets.
    pub fn force(backend: Option<Backend>) {
        *FORCED.lock().unwrap_or_else(|p| p.into_inner()) = Some(backend);
    }

    /// The backend forced on every load: the last [`Backend::force`], else the backend
    /// `$SAFELOAD_PATCH` names (case and spaces aside; "1", "true" and the like name none).
    pub fn forced() -> Option<Backend> {
        let set = *FORCED.lock().unwrap_or_else(|p| p.into_inner());
        Self::forced_by(set, &std::env::var(Self::PATCH_ENV).unwrap_or_default())
    }

    /// [`Backend::forced`] from what [`Backend::force`] `set` and `$SAFELOAD_PATCH`'s value.
    fn forced_by(set: Option<Option<Backend>>, patch_env: &str) -> Option<Backend> {
        set.unwrap_or_else(|| Self::parse(patch_env.trim().to_ascii_lowercase().as_str()))
    }

    /// The backend a load uses where `$SAFELOAD_VERIFY` pins its files: a verified file is read,
    /// never mapped, so a library's "mmap" (transformers passes it to every `safe_open`) becomes
    /// "auto"; the variable is the user's word over the library's. (The same two given by one
    /// caller are refused: [`Backend::check`].)
    pub fn pinned_by_env(self) -> Backend {
        match self {
            Backend::Mmap => Backend::Auto,
            other => other,
        }
    }

    /// Refuses a backend that cannot do what the read options ask: a map reads nothing, so it
    /// has no pages of its own to drop after reading (`drop_cache`), and no bytes pass through
    /// the reader to be hashed (`hash`). "auto" with either reads instead
    /// (`resolve`).
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

/// What [`Backend::force`] set: None until it is called (then `$SAFELOAD_PATCH` decides).
static FORCED: std::sync::Mutex<Option<Option<Backend>>> = std::sync::Mutex::new(None);

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
/// ([`plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Whole tensors into new memory as the file holds them: views of the map where the
    /// backend maps.
    Views,
    /// Every tensor of the files read, as [`Purpose::Views`]; a map's pages are then made
    /// resident ahead of the caller's touches, in file order, where they are not resident.
    All,
    /// Whole tensors pulled one at a time (`get_tensor` loops): read as [`Purpose::Views`], with
    /// a read-ahead ahead of the pulls.
    Pulls,
    /// A prefetch's plan, read in the background ahead of its takes, in file order.
    Prefetch,
    /// Whole tensors read ahead into destinations the caller provides (a device's host alias,
    /// MPS), with pread.
    Provided,
    /// Parts of tensors (`get_slice(k)[...]`): cut out of the map where the backend maps, else
    /// only the rows they need read.
    Parts,
    /// Bytes copied into memory that is not the map's: the caller's tensors (`load_into`,
    /// `load_model`), a device's staging buffers or host alias, tensors converted on the way.
    Copies,
}

/// The strategy a read for `purpose` runs: the part of [`plan`] that turns a backend's
/// resolution for a file (`resolved`, with the page-cache residency measured for it, `cached`)
/// into the strategy that reads.
///
/// - A map gives views and parts; a copy out of it would fault every page in and then copy, so
///   copies read instead: from the page cache when warm (pread), around it when cold (uncached
///   reads keep the disk's queue full where buffered reads wait on readahead a window at a time:
///   docs/backends.md, "Reading into a model"). Not measured (no residency known): pread.
/// - Uncached reads the filesystem refused (`direct_refused`, seen by an earlier read): pread.
/// - Otherwise what was resolved (`pread`, `direct`) reads for every purpose.
fn for_purpose(
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
    ran_with(strategy, direct_refused)
}

/// The strategy a read that asked for `asked` runs with: pread where uncached reads were refused.
pub fn ran_with(asked: Strategy, direct_refused: bool) -> Strategy {
    match asked {
        Strategy::Direct if direct_refused => Strategy::Pread,
        asked => asked,
    }
}

/// Below this many bytes a read of files runs on the calling thread.
const INLINE_BYTES: u64 = 4 << 20;

/// Whether a read of `bytes` by `threads` workers runs on the calling thread: small reads and
/// one-worker reads do, never one from a source that may wait long (an object store, whose
/// requests run on a worker while the caller polls for Ctrl-C and stops them).
pub fn runs_inline(may_wait_long: bool, threads: usize, bytes: u64) -> bool {
    !may_wait_long && (threads == 1 || bytes < INLINE_BYTES)
}

/// Readers of a read that also hashes `hashing` files, each on a thread of its own: a hash takes
/// a core, the readers keep to the cores left (at least one).
pub fn readers_beside(threads: usize, hashing: usize) -> usize {
    match hashing {
        0 => threads,
        n => threads.min(platform::cores().saturating_sub(n).max(1)),
    }
}

/// Files a read hashes side by side: a hash takes a core and one is kept for the readers. Three
/// shards hashed at once beside one reader on 2 cores starved the reader of a cold read (3 x 0.14
/// GiB, `load_checkpoint(verify=)`: see docs/verification.md).
pub fn files_hashed_at_once() -> usize {
    platform::cores().saturating_sub(1).max(1)
}

/// Worker count when the caller does not choose: one per core, at least 2, at most 8.
pub fn default_threads() -> usize {
    platform::cores().clamp(2, 8)
}

/// Where read-ahead puts the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Owned buffers, read with this strategy (`Pread` or `Direct`).
    Owned(Strategy),
    /// The page cache, for a mapped file.
    PageCache,
    /// Destinations the caller provides (`ReadAhead::provide`), read with pread.
    Provided,
}

impl Mode {
    /// The strategy reads of this mode ask for.
    pub fn strategy(self) -> Strategy {
        match self {
            Mode::Owned(strategy) => strategy,
            Mode::PageCache => Strategy::Mmap,
            Mode::Provided => Strategy::Pread,
        }
    }
}

/// How one read is done: what every read path executes and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// How the bytes are read (where uncached reads turn out to be refused, the engine reads
    /// them buffered and the checkpoint remembers it: [`Known::direct_refused`]).
    pub strategy: Strategy,
    /// What is read ahead of the caller's asks, and where (None: nothing).
    pub ahead: Option<Mode>,
}

/// What is known of a checkpoint's files when a read is planned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Known {
    /// The backend's resolution for the files ([`resolve`]) and the page-cache residency
    /// measured for it.
    pub resolved: Strategy,
    pub cached: Option<f64>,
    /// Uncached reads were asked for and the filesystem refused them.
    pub direct_refused: bool,
    /// The file must hash to a digest the caller gave (`verify=`): its tensors come from bytes
    /// read and hashed whole, never from anything read ahead.
    pub pinned: bool,
}

/// How a read for `purpose` is done, from what is `known` ([`Plan`]). `cached_now`: the
/// residency of the file the read-ahead would walk, measured only when a map's read-ahead
/// depends on it.
///
/// - The strategy: a map gives views and parts; copies read (see `for_purpose`); a read into
///   provided destinations reads with pread.
/// - Read ahead: nothing for views, parts and copies asked together, nor for a pinned file.
///   A mapped file's pages, for every tensor of it (`All`), tensors pulled one at a time (`Pulls`)
///   or a prefetch: made resident where they are not ([`populate_ahead`]), else nothing (views
///   of resident pages need nothing). Parts of a map that is not resident (`get_slice(k)[...]`,
///   a tensor-parallel rank's slices): exactly the pages each part touches, asked of the kernel
///   as the part is handed out, never the rows around it (as the map's faults would read:
///   `read::source::Source::read_slice`; the residency is the one measured at resolve). Owned reads pulled one at a time or prefetched: read into
///   owned memory ahead of the asks. Provided destinations are read into as the caller provides
///   them.
pub fn plan(known: &Known, purpose: Purpose, cached_now: impl FnOnce() -> Option<f64>) -> Plan {
    let strategy = strategy_of(known, purpose);
    let ahead = match (purpose, strategy) {
        _ if known.pinned => None,
        (Purpose::Parts, Strategy::Mmap) => populate_ahead(known.cached).then_some(Mode::PageCache),
        (Purpose::Views | Purpose::Parts | Purpose::Copies, _) => None,
        (Purpose::Provided, _) => Some(Mode::Provided),
        (Purpose::All | Purpose::Pulls | Purpose::Prefetch, Strategy::Mmap) => {
            populate_ahead(cached_now()).then_some(Mode::PageCache)
        }
        (Purpose::All, _) => None,
        (Purpose::Pulls | Purpose::Prefetch, owned) => Some(Mode::Owned(owned)),
    };
    Plan { strategy, ahead }
}

/// The strategy of [`plan`] alone, which needs nothing measured beyond what `known` holds (a
/// read that only needs the strategy does not measure residency for the read-ahead).
pub fn strategy_of(known: &Known, purpose: Purpose) -> Strategy {
    match purpose {
        Purpose::Provided => Mode::Provided.strategy(),
        _ => for_purpose(known.resolved, known.cached, purpose, known.direct_refused),
    }
}

/// What [`resolve`] needs to know of a file: its facts, as its source tells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// What the file lives on.
    pub kind: FsKind,
    /// Whether its storage can map it (an object in a store cannot).
    pub can_map: bool,
    /// Bytes of tensor data.
    pub data_len: u64,
    /// The read must pass the bytes through the reader (dropped from the page cache after
    /// reading, or hashed): a map reads none.
    pub reads_bytes: bool,
}

/// The strategy a backend request means for `file` ("auto" looks at the filesystem and at how
/// much of the data is in the page cache, `cached()`), with the residency measured for it (None
/// when it was not measured or cannot be told), so that a plan reuses the one probe.
///
/// - What cannot be mapped (an object in a store) is read, whatever was asked for.
/// - "mmap" maps, with the residency measured (for the plans of parts and copies).
/// - Never a map on a network filesystem, even when asked for one: every fault would be a small
///   remote read, and a file that shrinks under a map kills the process. The network reader
///   gives the same tensors ("mmap" there resolves as "auto" does).
/// - "auto" (and "mmap" on a network filesystem): [`choose`]; it does not map a read that must
///   pass the bytes through the reader.
pub fn resolve(
    backend: Backend,
    file: &Facts,
    cached: impl FnOnce() -> Option<f64>,
) -> (Strategy, Option<f64>) {
    if !file.can_map {
        return (Strategy::Pread, None);
    }
    match backend {
        // Residency is measured for a map too (microseconds): parts of a cold map are read, not
        // faulted in (`for_purpose`), and libraries ask for "mmap" by name (transformers).
        Backend::Mmap if !matches!(file.kind, FsKind::Network(_)) => (Strategy::Mmap, cached()),
        Backend::Pread => (Strategy::Pread, None),
        Backend::Direct => (Strategy::Direct, None),
        Backend::Auto | Backend::Mmap => {
            let cached = cached();
            let available = crate::read::memory::available();
            let strategy = choose(
                file.kind,
                cached,
                file.data_len,
                direct_above(available),
                auto_may_map() && !file.reads_bytes,
                available,
            );
            (strategy, cached)
        }
    }
}

/// Whether views of a map have their pages made resident ahead of the caller's touches (the
/// read-ahead in page-cache mode), from the fraction of the data in the page cache (`cached`,
/// measured when the read-ahead would start): only where some of it is not. A resident file's
/// pages are there already; making them resident would only fill page tables for pages the
/// caller may never touch, a cost that grows with the file where safetensors 0.8's map costs
/// nothing (docs/backends.md, "Tuning, as measured"). Unknown: read ahead.
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
///   by default), so buffered readers stop at that cap however many threads they run, where
///   uncached readers do not (docs/backends.md, "Storage"). Where the mount refuses O_DIRECT the
///   engine falls back to buffered reads. Warm (the pages are already in this
///   machine's cache): buffered parallel pread, a memory copy.
/// - Local and memory filesystems: a private map, zero copy, as safetensors 0.8's default does
///   (with the same sequential read-ahead advice): warm, every other way copies what is already in
///   memory into fresh memory, many times slower; cold, the page cache has to be filled
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
/// the kernel keep in flight (`max_background`, where it can be read), up to 8 per core and 64:
/// fewer leave the connection idle between round trips, more spend the cores on switching
/// (docs/backends.md, "Tuning, as measured").
pub fn threads_for(kind: FsKind, cores: usize, in_flight: Option<usize>) -> usize {
    match kind {
        FsKind::Network(_) => 16
            .max(cores)
            .max(in_flight.unwrap_or(0).min(8 * cores).min(64)),
        _ => cores.clamp(2, 8),
    }
}

/// Bytes per read request: 8 MiB locally; 4 MiB on network filesystems, where fewer, larger
/// reads fault the fresh destination memory in with less overhead than small ones and are still
/// many per file for the workers to share (docs/backends.md, "Tuning, as measured").
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
            (Mmap, Some(0.2), Parts, false, Mmap),
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

    /// [`plan`], every purpose of every resolution: (resolved, residency, purpose, refused,
    /// pinned) -> (strategy, read-ahead).
    #[test]
    fn the_read_plan_of_every_case() {
        use Purpose::*;
        use Strategy::{Direct, Mmap, Pread};
        let cold = Some(0.2);
        let resident = Some(1.0);
        let owned = |s| Some(Mode::Owned(s));
        let page = Some(Mode::PageCache);
        type Case = (
            Strategy,
            Option<f64>,
            Purpose,
            bool,
            bool,
            Strategy,
            Option<Mode>,
        );
        let table: [Case; 34] = [
            // Views, parts and copies asked together: nothing read ahead; but parts of a map
            // not resident, whose own pages are asked of the kernel as they are handed out.
            (Mmap, cold, Views, false, false, Mmap, None),
            (Mmap, cold, Parts, false, false, Mmap, page),
            (Mmap, resident, Parts, false, false, Mmap, None),
            (Mmap, None, Parts, false, false, Mmap, page),
            (Pread, cold, Parts, false, false, Pread, None),
            (Mmap, cold, Copies, false, false, Direct, None),
            (Mmap, resident, Copies, false, false, Pread, None),
            (Mmap, None, Copies, false, false, Pread, None),
            (Mmap, cold, Copies, true, false, Pread, None),
            (Pread, cold, Copies, false, false, Pread, None),
            (Direct, None, Views, false, false, Direct, None),
            (Direct, None, Views, true, false, Pread, None),
            // Every tensor: a map's pages made resident where they are not.
            (Mmap, cold, All, false, false, Mmap, page),
            (Mmap, None, All, false, false, Mmap, page),
            (Mmap, resident, All, false, false, Mmap, None),
            (Pread, cold, All, false, false, Pread, None),
            (Direct, cold, All, false, false, Direct, None),
            // Pulled one at a time: the read-ahead, in the strategy's memory.
            (Mmap, cold, Pulls, false, false, Mmap, page),
            (Mmap, None, Pulls, false, false, Mmap, page),
            (Mmap, resident, Pulls, false, false, Mmap, None),
            (Pread, resident, Pulls, false, false, Pread, owned(Pread)),
            (Direct, cold, Pulls, false, false, Direct, owned(Direct)),
            (Direct, cold, Pulls, true, false, Pread, owned(Pread)),
            // A prefetch: a map's pages where they are not resident, owned memory read ahead.
            (Mmap, resident, Prefetch, false, false, Mmap, None),
            (Mmap, cold, Prefetch, false, false, Mmap, page),
            (Pread, cold, Prefetch, false, false, Pread, owned(Pread)),
            (
                Direct,
                resident,
                Prefetch,
                false,
                false,
                Direct,
                owned(Direct),
            ),
            // Provided destinations: read into with pread.
            (
                Mmap,
                resident,
                Provided,
                false,
                false,
                Pread,
                Some(Mode::Provided),
            ),
            (
                Direct,
                cold,
                Provided,
                false,
                false,
                Pread,
                Some(Mode::Provided),
            ),
            // A pinned file: its tensors come from its hashed bytes, nothing is read ahead.
            (Mmap, cold, All, false, true, Mmap, None),
            (Mmap, cold, Pulls, false, true, Mmap, None),
            (Pread, cold, Pulls, false, true, Pread, None),
            (Pread, cold, Prefetch, false, true, Pread, None),
            (Mmap, cold, Provided, false, true, Pread, None),
        ];
        for (resolved, cached, purpose, direct_refused, pinned, strategy, ahead) in table {
            let known = Known {
                resolved,
                cached,
                direct_refused,
                pinned,
            };
            let got = plan(&known, purpose, || cached);
            let case = format!(
                "{resolved:?} {cached:?} {purpose:?} refused={direct_refused} pinned={pinned}"
            );
            assert_eq!(got, Plan { strategy, ahead }, "{case}");
        }
    }

    /// [`resolve`]: what cannot be mapped is read; an explicit backend stands, but no map on a
    /// network filesystem; "auto" asks [`choose`] and "mmap" maps, measuring residency only
    /// then, and "auto" reads what must pass through the reader.
    #[test]
    fn a_backend_resolves_by_the_file() {
        const GIB: u64 = 1 << 30;
        let facts = |kind, can_map, reads_bytes| Facts {
            kind,
            can_map,
            data_len: GIB,
            reads_bytes,
        };
        let local = facts(FsKind::Local, true, false);
        let unmeasured = || -> Option<f64> { panic!("residency measured for an explicit backend") };
        assert_eq!(
            resolve(Backend::Mmap, &local, || Some(0.25)),
            (Strategy::Mmap, Some(0.25))
        );
        assert_eq!(
            resolve(Backend::Pread, &local, unmeasured),
            (Strategy::Pread, None)
        );
        assert_eq!(
            resolve(Backend::Direct, &local, unmeasured),
            (Strategy::Direct, None)
        );
        let object = facts(FsKind::Network("s3"), false, false);
        for backend in [Backend::Auto, Backend::Mmap, Backend::Direct] {
            assert_eq!(
                resolve(backend, &object, unmeasured),
                (Strategy::Pread, None)
            );
        }
        let fuse = facts(FsKind::Network("fuse"), true, false);
        assert_eq!(
            resolve(Backend::Mmap, &fuse, || Some(0.0)),
            (Strategy::Direct, Some(0.0))
        );
        assert_eq!(
            resolve(Backend::Auto, &fuse, || Some(1.0)),
            (Strategy::Pread, Some(1.0))
        );
        if auto_may_map() {
            assert_eq!(
                resolve(Backend::Auto, &local, || Some(1.0)),
                (Strategy::Mmap, Some(1.0))
            );
        }
        let hashed = facts(FsKind::Local, true, true);
        assert_ne!(
            resolve(Backend::Auto, &hashed, || Some(1.0)).0,
            Strategy::Mmap
        );
    }

    /// [`Backend::requested`]: a forced backend over the call's, `SAFELOAD_BACKEND` over "auto"
    /// only, names checked either way; what forces one ([`Backend::forced`]).
    #[test]
    fn overrides_of_the_backend_asked_for() {
        use Backend::{Auto, Direct, Mmap, Pread};
        let asked = |name, forced, env| Backend::requested_with(name, forced, env).ok();
        // (name, forced, $SAFELOAD_BACKEND) -> backend (None: an error)
        let table = [
            ("auto", None, None, Some(Auto)),
            ("auto", None, Some(""), Some(Auto)),
            ("mmap", None, None, Some(Mmap)),
            ("fast", None, None, None),
            ("auto", None, Some("pread"), Some(Pread)),
            ("direct", None, Some("pread"), Some(Direct)),
            ("auto", None, Some("fast"), None),
            ("mmap", Some(Pread), None, Some(Pread)),
            ("auto", Some(Direct), Some("pread"), Some(Direct)),
            ("fast", Some(Pread), None, None),
        ];
        for (name, forced, env, want) in table {
            assert_eq!(asked(name, forced, env), want, "{name} {forced:?} {env:?}");
        }
        // (what force() set, $SAFELOAD_PATCH) -> forced
        let forced = [
            (None, "", None),
            (None, "1", None),
            (None, " Direct ", Some(Direct)),
            (None, "pread", Some(Pread)),
            (Some(None), "pread", None), // unpatched: the variable no longer forces
            (Some(Some(Mmap)), "pread", Some(Mmap)),
        ];
        for (set, env, want) in forced {
            assert_eq!(Backend::forced_by(set, env), want, "{set:?} {env:?}");
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
