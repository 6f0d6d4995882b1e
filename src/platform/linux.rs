//! Linux: `O_DIRECT`, `posix_fadvise`, `fstatfs` magic numbers, `/proc/meminfo`, transparent
//! huge pages.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use super::kinds::{FsKind, Uncached};

pub use super::unix::{
    cached_fraction, file_identity, file_len, fork_generation, open_read, page_size, read_at,
    read_vectored_at, sync_dir, unmap_anonymous, write_all_at,
};

pub const PARALLEL_READS_SHARE_HANDLE: bool = true;
pub const MAP_IS_SAFE: bool = true;
/// 2 MiB, so large destinations can be backed by transparent huge pages.
pub const MAP_ALIGN: usize = 2 << 20;
/// O_DIRECT wants offset, length and address aligned to the logical block size; a page is safe
/// for 512e and 4Kn disks.
const DIRECT_ALIGN: u64 = 4096;

pub fn open_uncached(path: &Path) -> Option<Uncached> {
    let file = open_read(path, libc::O_DIRECT).ok()?;
    let align = if accepts_unaligned(&file) {
        1
    } else {
        DIRECT_ALIGN
    };
    Some(Uncached { file, align })
}

/// Whether O_DIRECT reads on this file need no alignment (FUSE and NFS pass them through as
/// they are): probed with a one-byte read at offset 1 into an odd address, which block
/// filesystems refuse with EINVAL.
fn accepts_unaligned(file: &File) -> bool {
    let mut probe = [0u8; 2];
    match read_at(file, &mut probe[1..], 1) {
        Ok(n) => n == 1,
        Err(_) => false,
    }
}

/// `posix_fallocate`; a filesystem that cannot reserve space (EOPNOTSUPP, EINVAL) gets `set_len`.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    let Ok(size) = libc::off_t::try_from(len) else {
        return Err(io::ErrorKind::InvalidInput.into());
    };
    if size == 0 {
        return Ok(());
    }
    // SAFETY: a valid open descriptor; the call only reserves blocks.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size) } {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len),
        code => Err(io::Error::from_raw_os_error(code)),
    }
}

pub fn prefetch(file: &File, offset: u64, len: u64) {
    // SAFETY: advisory call on an open fd.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_WILLNEED,
        )
    };
}

/// `POSIX_FADV_WILLNEED` reads at most the file's read-ahead window (or the device's request
/// size) per call and drops the rest: [`prefetch_all`] asks in pieces no longer than the
/// smallest usual window.
const WILLNEED_PIECE: u64 = 128 << 10;

pub fn prefetch_all(file: &File, offset: u64, len: u64) {
    let end = offset.saturating_add(len);
    let mut at = offset;
    while at < end {
        let piece = WILLNEED_PIECE.min(end - at);
        prefetch(file, at, piece);
        at += piece;
    }
}

pub fn advise_sequential(file: &File) {
    // SAFETY: advisory call on an open fd.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
}

pub fn advise_random(file: &File) {
    // SAFETY: advisory call on an open fd.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
}

pub fn advise_normal(file: &File) {
    // SAFETY: advisory call on an open fd.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_NORMAL) };
}

pub fn drop_cache(file: &File) {
    // SAFETY: advisory call on an open fd.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
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

pub fn fs_kind(file: &File, _path: &Path) -> FsKind {
    // SAFETY: fstatfs writes into the zeroed struct we pass; the fd is open.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open for the call (borrowed from `file`) and `st` is a valid,
    // writable statfs.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return FsKind::Local;
    }
    let magic = st.f_type as u64 & 0xffff_ffff;
    let kind = MAGICS
        .iter()
        .find(|(m, _)| *m == magic)
        .map_or(FsKind::Local, |&(_, kind)| kind);
    match kind {
        // FUSE and NFS say little by magic: the mount table names the daemon.
        FsKind::Network("fuse" | "nfs") => mount_of(file)
            .and_then(|(fstype, source)| refine(&fstype, &source))
            .map_or(kind, FsKind::Network),
        _ => kind,
    }
}

/// The most asynchronous requests the kernel keeps in flight to the FUSE daemon serving `file`
/// (`/sys/fs/fuse/connections/<minor of st_dev>/max_background`; needs the fusectl mount, and
/// root to read it on most systems). None for anything else, or when it cannot be read.
pub fn fuse_requests_in_flight(file: &File) -> Option<usize> {
    use std::os::unix::fs::MetadataExt;
    let dev = file.metadata().ok()?.dev();
    let path = format!(
        "/sys/fs/fuse/connections/{}/max_background",
        libc::minor(dev)
    );
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// (filesystem type, source) of the mount holding `file`, from /proc/self/mountinfo.
fn mount_of(file: &File) -> Option<(String, String)> {
    use std::os::unix::fs::MetadataExt;
    let dev = file.metadata().ok()?.dev();
    let id = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    table.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.nth(2)? != id {
            return None;
        }
        // After the optional fields, " - " separates: fstype, source, super options.
        let (_, tail) = line.split_once(" - ")?;
        let mut tail = tail.split(' ');
        Some((tail.next()?.to_string(), tail.next()?.to_string()))
    })
}

/// Names for the mounts users load checkpoints from (`f.stats.storage`).
fn refine(fstype: &str, source: &str) -> Option<&'static str> {
    const DAEMONS: &[(&str, &str)] = &[
        ("hf-mount", "hf-mount"),
        ("s3fs", "s3fs"),
        ("gcsfuse", "gcsfuse"),
        ("rclone", "rclone"),
        ("ceph", "ceph"),
        ("goofys", "goofys"),
        ("mountpoint-s3", "mountpoint-s3"),
        ("blobfuse", "blobfuse"),
        ("juicefs", "juicefs"),
        ("sshfs", "sshfs"),
    ];
    let subtype = fstype.strip_prefix("fuse.").unwrap_or(fstype);
    if fstype == "virtiofs" {
        return Some("virtiofs");
    }
    if let Some(&(_, name)) = DAEMONS
        .iter()
        .find(|(key, _)| subtype.contains(key) || source.contains(key))
    {
        return Some(name);
    }
    if fstype.starts_with("nfs") {
        // hf-mount's default backend: an NFSv3 server on loopback.
        let host = source.split(':').next().unwrap_or("");
        return Some(
            if host == "127.0.0.1" || host == "localhost" || host == "::1" {
                "nfs-loopback"
            } else {
                "nfs"
            },
        );
    }
    None
}

/// `MemAvailable` from /proc/meminfo.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

pub fn map_anonymous(len: usize) -> io::Result<NonNull<u8>> {
    super::unix::map_anonymous_aligned(len, MAP_ALIGN)
}

pub fn populate_mapped(ptr: NonNull<u8>, len: usize) -> bool {
    // MADV_POPULATE_READ (Linux 5.14): read faults on every page, reported as an error code
    // instead of a signal. The range is widened to whole pages.
    let page = page_size();
    let start = ptr.as_ptr() as usize / page * page;
    let end = (ptr.as_ptr() as usize + len).next_multiple_of(page);
    // SAFETY: the range lies within a live mapping the caller holds; populating only reads.
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_READ,
        ) == 0
    }
}

pub fn prefault(ptr: *mut u8, len: usize) {
    // MADV_POPULATE_WRITE (Linux 5.14) over the whole pages inside the range: the page faults
    // a first write would take, in one call, without changing a byte; an older kernel (EINVAL)
    // or memory that cannot be populated leaves the faults to the writes.
    let page = page_size();
    let start = (ptr as usize).next_multiple_of(page);
    let end = (ptr as usize + len) / page * page;
    if end > start {
        // SAFETY: advisory; the range lies within memory the caller is about to write.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
    }
}

pub fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: advisory call on memory the caller owns.
    unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
}

/// Reads the kernel's THP `defrag` setting: faults cannot stall on compaction only with
/// `defer` or `never`.
pub fn huge_page_faults_cannot_stall() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/defrag")
        .is_ok_and(|s| defrag_cannot_stall(&s))
}

/// The selected value of a THP `defrag` file is in brackets.
fn defrag_cannot_stall(defrag: &str) -> bool {
    let selected = defrag
        .split('[')
        .nth(1)
        .and_then(|s| s.split(']').next())
        .unwrap_or("");
    matches!(selected, "defer" | "never")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn huge_page_policy_reads_selected_defrag() {
        assert!(!defrag_cannot_stall(
            "always defer defer+madvise [madvise] never"
        ));
        assert!(defrag_cannot_stall(
            "always [defer] defer+madvise madvise never"
        ));
        assert!(!defrag_cannot_stall(
            "always defer [defer+madvise] madvise never"
        ));
    }

    #[test]
    fn mount_names() {
        assert_eq!(refine("fuse.hf-mount", "hf-mount"), Some("hf-mount"));
        assert_eq!(refine("fuse", "hf-mount"), Some("hf-mount"));
        assert_eq!(refine("fuse.s3fs", "s3fs"), Some("s3fs"));
        assert_eq!(refine("fuse", "gcsfuse"), Some("gcsfuse"));
        assert_eq!(refine("fuse.rclone", "remote:"), Some("rclone"));
        assert_eq!(refine("fuse.ceph-fuse", "ceph-fuse"), Some("ceph"));
        assert_eq!(refine("virtiofs", "myfs"), Some("virtiofs"));
        assert_eq!(refine("nfs", "127.0.0.1:/repo"), Some("nfs-loopback"));
        assert_eq!(refine("nfs4", "server:/export"), Some("nfs"));
        assert_eq!(refine("fuse.slowfs", "slowfs"), None);
    }

    #[test]
    fn residency_follows_fadvise() {
        let path = std::env::temp_dir().join(format!("safeload-residency-{}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![1u8; 4 << 20]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let mut sink = Vec::new();
        std::io::Read::read_to_end(&mut &f, &mut sink).unwrap();
        let warm = cached_fraction(&f, 0, 4 << 20).unwrap();
        drop_cache(&f);
        let cold = cached_fraction(&f, 0, 4 << 20).unwrap();
        assert!(warm > 0.9, "{warm}");
        assert!(cold < 0.5, "{cold}");
        std::fs::remove_file(path).unwrap();
    }
}
