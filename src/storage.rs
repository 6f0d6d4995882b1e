//! What the file lives on, and the backend that reads it fastest: filesystem kind (`fstatfs`),
//! page-cache residency (`mincore`), and available memory.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Where a file's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    /// A local block-device filesystem (ext4, xfs, btrfs, overlay ...).
    Local,
    /// Memory-backed (tmpfs, ramfs): already in RAM, O_DIRECT pointless or refused.
    Memory,
    /// Network or userspace: FUSE (hf-mount, s3fs, virtiofs ...), NFS, SMB, Lustre, CephFS, GPFS, 9p.
    Network(&'static str),
}

/// Filesystem magic numbers (linux/magic.h and the filesystems' own headers).
const MAGICS: &[(u64, FsKind)] = &[
    (0x0102_1994, FsKind::Memory),            // tmpfs
    (0x8584_58f6, FsKind::Memory),            // ramfs
    (0x6573_5546, FsKind::Network("fuse")),   // FUSE (s3fs, hf-mount, virtiofs, ...)
    (0x6969, FsKind::Network("nfs")),         // NFS
    (0x517b, FsKind::Network("smb")),         // SMB
    (0xfe53_4d42, FsKind::Network("smb2")),   // SMB2
    (0xff53_4d42, FsKind::Network("cifs")),   // CIFS
    (0x0bd0_0bd0, FsKind::Network("lustre")), // Lustre
    (0x00c3_6400, FsKind::Network("ceph")),   // CephFS
    (0x4750_4653, FsKind::Network("gpfs")),   // GPFS
    (0x0102_1997, FsKind::Network("9p")),     // v9fs
    (0x5346_414f, FsKind::Network("afs")),    // AFS
    (0x1983_0326, FsKind::Network("beegfs")), // BeeGFS
];

impl FsKind {
    pub fn of(file: &File) -> FsKind {
        // SAFETY: fstatfs writes into the zeroed struct we pass; the fd is open.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
            return FsKind::Local;
        }
        let magic = st.f_type as u64 & 0xffff_ffff;
        MAGICS
            .iter()
            .find(|(m, _)| *m == magic)
            .map_or(FsKind::Local, |&(_, kind)| kind)
    }

    pub fn name(self) -> &'static str {
        match self {
            FsKind::Local => "local",
            FsKind::Memory => "memory",
            FsKind::Network(name) => name,
        }
    }
}

/// Pages checked per residency sample, and the number of samples spread over a file.
const SAMPLE_PAGES: usize = 16;
const SAMPLES: usize = 64;

/// Fraction (0..=1) of `len` bytes from `offset` that sit in the page cache, estimated with
/// `mincore` on up to 64 windows of 16 pages spread evenly over a temporary read-only map (a
/// whole-file scan costs ~50 ms on a 2.5 GiB file; this costs microseconds). None when it cannot
/// be told.
pub fn cached_fraction(file: &File, offset: u64, len: u64) -> Option<f64> {
    if len == 0 {
        return Some(1.0);
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let start = offset / page * page;
    let map_len = (offset + len - start) as usize;
    // SAFETY: a fresh shared read-only mapping of the file, never dereferenced, unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            start as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return None;
    }
    let pages = map_len.div_ceil(page as usize);
    let windows = SAMPLES.min(pages.div_ceil(SAMPLE_PAGES));
    let mut vec = [0u8; SAMPLE_PAGES];
    let (mut seen, mut resident, mut failed) = (0usize, 0usize, false);
    for w in 0..windows {
        let first = w * pages / windows;
        let count = SAMPLE_PAGES.min(pages - first);
        let at = first * page as usize;
        let bytes = (count * page as usize).min(map_len - at);
        // SAFETY: [addr+at, addr+at+bytes) lies inside the mapping; `vec` has a byte per page.
        let rc =
            unsafe { libc::mincore(addr.cast::<u8>().add(at).cast(), bytes, vec.as_mut_ptr()) };
        if rc != 0 {
            failed = true;
            break;
        }
        seen += count;
        resident += vec[..count].iter().filter(|b| **b & 1 == 1).count();
    }
    // SAFETY: unmapping exactly what was mapped above.
    unsafe { libc::munmap(addr, map_len) };
    if failed || seen == 0 {
        return None;
    }
    Some(resident as f64 / seen as f64)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
    /// Accepted names, for error messages.
    pub const NAMES: &'static str = "\"auto\", \"direct\", \"mmap\", \"pread\"";

    pub fn parse(name: &str) -> Option<Backend> {
        match name {
            "auto" => Some(Backend::Auto),
            "mmap" => Some(Backend::Mmap),
            "pread" => Some(Backend::Pread),
            "direct" => Some(Backend::Direct),
            _ => None,
        }
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

/// Below this fraction of the file in the page cache, a local file counts as cold.
pub const COLD_BELOW: f64 = 0.5;

/// Cold local files with more data than this are read with O_DIRECT by "auto":
/// `SAFELOAD_DIRECT_ABOVE` (bytes) when set, else half of the available memory.
pub fn direct_above() -> Option<u64> {
    match std::env::var("SAFELOAD_DIRECT_ABOVE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(bytes) => Some(bytes),
        None => available_memory().map(|free| free / 2),
    }
}

/// The backend "auto" picks for a file of `data_len` bytes (see [`direct_above`]).
///
/// - Network and FUSE filesystems: parallel pread with many requests in flight, never mmap (every
///   page fault would be a small remote read, and truncation under a map is SIGBUS).
/// - Memory filesystems and warm local files: parallel pread (the copy out of the page cache runs
///   at memory bandwidth).
/// - Cold local files: parallel buffered pread too, unless the data is more than half of the
///   available memory; then O_DIRECT, so that a load does not push the rest of the page cache (or
///   its own tensors) out. Measured on the dev VM (README, "Tuning"): cold buffered pread ran
///   1.3-2.8 GiB/s where O_DIRECT ran 1.1-1.2 GiB/s for every chunk size and thread count, since
///   kernel readahead keeps more requests in flight than the workers do.
pub fn choose(
    kind: FsKind,
    cached: Option<f64>,
    data_len: u64,
    direct_above: Option<u64>,
) -> Strategy {
    match kind {
        FsKind::Network(_) | FsKind::Memory => Strategy::Pread,
        FsKind::Local => match (cached, direct_above) {
            (Some(f), Some(limit)) if f < COLD_BELOW && data_len > limit => Strategy::Direct,
            _ => Strategy::Pread,
        },
    }
}

/// Workers for a strategy on a filesystem: network reads wait on round trips, so many more
/// requests are kept in flight than there are cores.
pub fn threads_for(kind: FsKind, cores: usize) -> usize {
    match kind {
        FsKind::Network(_) => 16.max(cores),
        _ => cores.clamp(2, 8),
    }
}

/// Bytes per read request: 8 MiB locally; 4 MiB on network filesystems, where the kernel cuts
/// each read into 128 KiB FUSE requests sent concurrently. Measured through slowfs (2 ms per
/// request, 0.4 GiB sharded sample, GiB/s): 16 workers x 4 MiB 0.51-0.53, x 8 MiB 0.47,
/// x 1 MiB 0.34; 32 x 4 MiB 0.45; 8 x 4 MiB 0.41.
pub fn chunk_bytes_for(kind: FsKind) -> usize {
    match kind {
        FsKind::Network(_) => 4 << 20,
        _ => crate::plan::DEFAULT_CHUNK_BYTES,
    }
}

/// Drops a file's clean pages from the page cache (load-once hygiene).
pub fn drop_cached(file: &File) {
    // SAFETY: advisory call on an open fd.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn residency_follows_fadvise() {
        let path = std::env::temp_dir().join(format!("safeload-storage-{}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![1u8; 4 << 20]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let mut sink = Vec::new();
        std::io::Read::read_to_end(&mut &f, &mut sink).unwrap();
        let warm = cached_fraction(&f, 0, 4 << 20).unwrap();
        drop_cached(&f);
        let cold = cached_fraction(&f, 0, 4 << 20).unwrap();
        assert!(warm > 0.9, "{warm}");
        assert!(cold < 0.5, "{cold}");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn choices() {
        const GIB: u64 = 1 << 30;
        assert_eq!(
            choose(FsKind::Network("fuse"), Some(0.0), 100 * GIB, Some(GIB)),
            Strategy::Pread
        );
        assert_eq!(
            choose(FsKind::Local, Some(0.0), 2 * GIB, Some(10 * GIB)),
            Strategy::Pread
        );
        assert_eq!(
            choose(FsKind::Local, Some(0.0), 12 * GIB, Some(10 * GIB)),
            Strategy::Direct
        );
        assert_eq!(
            choose(FsKind::Local, Some(1.0), 12 * GIB, Some(10 * GIB)),
            Strategy::Pread
        );
        assert_eq!(
            choose(FsKind::Memory, Some(0.0), 12 * GIB, Some(GIB)),
            Strategy::Pread
        );
        assert!(threads_for(FsKind::Network("nfs"), 2) >= 16);
    }
}
