//! macOS: `F_NOCACHE` for uncached reads (no alignment rules), `F_RDADVISE` read-ahead hints,
//! `statfs.f_fstypename` for the filesystem kind, `host_statistics64` for memory. No
//! `posix_fadvise`, no huge-page advice.

use std::ffi::CStr;
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
/// 16 KiB: the page size of Apple silicon (a multiple of Intel Macs' 4 KiB).
pub const MAP_ALIGN: usize = 16 << 10;

pub fn open_uncached(path: &Path) -> Option<Uncached> {
    let file = open_read(path, 0).ok()?;
    // SAFETY: fcntl on an open fd with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
        return None;
    }
    Some(Uncached { file, align: 1 })
}

/// Extended only: `F_PREALLOCATE` reserves space but a later write can still fail for quota.
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    file.set_len(len)
}

pub fn prefetch(file: &File, offset: u64, len: u64) {
    let advice = libc::radvisory {
        ra_offset: offset as libc::off_t,
        ra_count: len.min(i32::MAX as u64) as libc::c_int,
    };
    // SAFETY: F_RDADVISE reads the struct we pass; advisory only.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDADVISE, &advice) };
}

/// `F_RDADVISE` asks for the whole range in one call.
pub fn prefetch_all(file: &File, offset: u64, len: u64) {
    prefetch(file, offset, len)
}

pub fn advise_sequential(file: &File) {
    // SAFETY: fcntl on an open fd with an integer argument; advisory only.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDAHEAD, 1) };
}

pub fn advise_random(file: &File) {
    // SAFETY: fcntl on an open fd with an integer argument; advisory only.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDAHEAD, 0) };
}

pub fn advise_normal(file: &File) {
    advise_sequential(file) // F_RDAHEAD on: the default
}

/// macOS has no call that evicts one file's pages (`posix_fadvise` does not exist); reads made
/// through [`open_uncached`] do not fill the cache in the first place.
pub fn drop_cache(_file: &File) {}

/// `f_fstypename` values of network and userspace filesystems. hf-mount's default backend is
/// NFS on 127.0.0.1: still `nfs`, so still network.
const NETWORK: &[&str] = &[
    "nfs", "smbfs", "afpfs", "webdav", "macfuse", "osxfuse", "fuse-t", "fusefs", "cifs", "ftp",
];
const MEMORY: &[&str] = &["devfs", "tmpfs"];

pub fn fs_kind(file: &File, _path: &Path) -> FsKind {
    // SAFETY: fstatfs writes into the zeroed struct we pass; the fd is open.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open for the call (borrowed from `file`) and `st` is a valid,
    // writable statfs.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return FsKind::Local;
    }
    // SAFETY: the kernel writes a NUL-terminated name into the 16-byte array.
    let name = unsafe { CStr::from_ptr(st.f_fstypename.as_ptr()) }.to_string_lossy();
    kind_of(&name)
}

fn kind_of(fstypename: &str) -> FsKind {
    let name = fstypename.to_ascii_lowercase();
    if let Some(known) = NETWORK
        .iter()
        .find(|n| name == **n || (name.starts_with(**n) && name.contains("fuse")))
    {
        return FsKind::Network(known);
    }
    if name.contains("fuse") {
        return FsKind::Network("fuse");
    }
    if MEMORY.contains(&name.as_str()) {
        return FsKind::Memory;
    }
    FsKind::Local
}

unsafe extern "C" {
    // In libSystem; libc marks its binding deprecated in favour of the mach2 crate.
    fn mach_host_self() -> libc::mach_port_t;
}

/// Free, inactive, purgeable and speculative pages (what the kernel hands out without
/// swapping), else the physical memory size.
pub fn available_memory() -> Option<u64> {
    // SAFETY: host_statistics64 fills at most `count` natural_t's of the zeroed struct.
    let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `stats` and `count` are valid and writable; `count` is the struct's size in
    // natural_t's, so the call writes within it.
    let rc = unsafe {
        libc::host_statistics64(
            mach_host_self(),
            libc::HOST_VM_INFO64,
            (&mut stats as *mut libc::vm_statistics64).cast(),
            &mut count,
        )
    };
    if rc == libc::KERN_SUCCESS {
        let pages = stats.free_count as u64
            + stats.inactive_count as u64
            + stats.purgeable_count as u64
            + stats.speculative_count as u64;
        return Some(pages * page_size() as u64);
    }
    let mut size = 0u64;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: hw.memsize is a u64; `len` says how much room `size` has.
    let rc = unsafe {
        libc::sysctlbyname(
            c"hw.memsize".as_ptr(),
            (&mut size as *mut u64).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0).then_some(size)
}

pub fn map_anonymous(len: usize) -> io::Result<NonNull<u8>> {
    super::unix::map_anonymous_aligned(len, MAP_ALIGN)
}

pub use super::elsewhere::{
    advise_huge_pages, fuse_requests_in_flight, huge_page_faults_cannot_stall, populate_mapped,
    prefault,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fstypenames() {
        assert_eq!(kind_of("apfs"), FsKind::Local);
        assert_eq!(kind_of("nfs"), FsKind::Network("nfs"));
        assert_eq!(kind_of("smbfs"), FsKind::Network("smbfs"));
        assert_eq!(kind_of("macfuse"), FsKind::Network("macfuse"));
        assert_eq!(kind_of("fuse-t"), FsKind::Network("fuse-t"));
        assert_eq!(kind_of("osxfuse_custom"), FsKind::Network("osxfuse"));
        assert_eq!(kind_of("devfs"), FsKind::Memory);
    }
}
