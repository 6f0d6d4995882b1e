//! POSIX calls shared by Linux and macOS: `preadv`, `pread`, `mincore` residency sampling,
//! anonymous maps.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use super::kinds::{self, FileIdentity};

pub fn read_vectored_at(
    file: &File,
    bufs: &mut [IoSliceMut<'_>],
    offset: u64,
) -> io::Result<usize> {
    // At most IOV_MAX (1024 on Linux and macOS) segments per call; the caller continues.
    let count = bufs.len().min(1024) as libc::c_int;
    // SAFETY: IoSliceMut is ABI-compatible with iovec (std guarantees it on unix); each one
    // describes memory the caller lent us mutably for the duration of the call.
    let n = unsafe {
        libc::preadv(
            file.as_raw_fd(),
            bufs.as_mut_ptr().cast::<libc::iovec>(),
            count,
            offset as libc::off_t,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Opens `path` read-only with `flags`, without waiting (`O_NONBLOCK`: a FIFO's open returns at
/// once instead of waiting for a writer), refuses what is not a regular file
/// ([`kinds::regular`]), then reads block again.
pub fn open_read(path: &std::path::Path, flags: libc::c_int) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK)
        .open(path)?;
    kinds::regular(&file, special_kind)?;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    let cleared = unsafe {
        let status = libc::fcntl(fd, libc::F_GETFL);
        status >= 0 && libc::fcntl(fd, libc::F_SETFL, status & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// What a file that is neither regular nor a directory is, for messages.
pub fn special_kind(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a special file"
    }
}

pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, offset)
}

pub fn sync_dir(dir: &std::path::Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Forks of this process seen so far (see [`super::fork_generation`]): counted in the child by a
/// `pthread_atfork` handler, registered on the first call; where it cannot be registered (no
/// memory), the process id, which a child does not share either (a `getpid` each call).
pub fn fork_generation() -> u64 {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static FORKS: AtomicU64 = AtomicU64::new(0);
    static COUNTED: OnceLock<bool> = OnceLock::new();
    extern "C" fn child() {
        FORKS.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: the handler only bumps an atomic, which is async-signal-safe, as code run in the
    // child of a multithreaded fork must be.
    let counted =
        *COUNTED.get_or_init(|| unsafe { libc::pthread_atfork(None, None, Some(child)) } == 0);
    if counted {
        FORKS.load(Ordering::Relaxed)
    } else {
        1 << 32 | u64::from(std::process::id())
    }
}

pub fn file_len(file: &File) -> io::Result<u64> {
    // SAFETY: lseek on a descriptor we own; it moves only the descriptor's offset, which no
    // read of this crate uses (every read is positional).
    let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(end as u64)
    }
}

/// `fstat`'s device, inode, size, mtime and ctime.
pub fn file_identity(file: &File) -> io::Result<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    let ns = |secs: i64, nanos: i64| i128::from(secs) * 1_000_000_000 + i128::from(nanos);
    Ok(FileIdentity {
        device: meta.dev(),
        inode: meta.ino(),
        size: meta.size(),
        mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
        ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
    })
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}

/// Pages checked per residency sample, and the number of samples spread over a file.
const SAMPLE_PAGES: usize = 16;
const SAMPLES: usize = 64;

/// Residency estimated with `mincore` on up to 64 windows of 16 pages spread evenly over a
/// temporary read-only map (a whole-file scan costs ~50 ms on a 2.5 GiB file; this costs
/// microseconds).
pub fn cached_fraction(file: &File, offset: u64, len: u64) -> Option<f64> {
    let page = page_size() as u64;
    let start = offset / page * page;
    let map_len = usize::try_from(offset + len - start).ok()?;
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
        // SAFETY: [addr+at, addr+at+bytes) lies inside the mapping; `vec` has a byte per page
        // (its element type is u8 on Linux and c_char on macOS: same size, hence the cast).
        let rc = unsafe {
            libc::mincore(
                addr.cast::<u8>().add(at).cast(),
                bytes,
                vec.as_mut_ptr().cast(),
            )
        };
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

/// Anonymous memory aligned to `align` (a power of two, at least a page): over-map by `align`,
/// then give back the unaligned head and the tail.
pub fn map_anonymous_aligned(len: usize, align: usize) -> io::Result<NonNull<u8>> {
    let kept = len.max(1).next_multiple_of(page_size());
    let padded = kept.checked_add(align).ok_or_else(oom)?;
    // SAFETY: anonymous private mapping, no file; the result is checked below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANON | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(align);
    let head = aligned - start;
    let tail = padded - head - kept;
    // SAFETY: both ranges lie inside the mapping just made and outside [aligned, aligned+kept).
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + kept) as *mut libc::c_void, tail);
        }
    }
    NonNull::new(aligned as *mut u8).ok_or_else(oom)
}

/// # Safety
/// `ptr`/`len` are exactly one `map_anonymous_aligned` result and its length, no longer used.
pub unsafe fn unmap_anonymous(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller's contract; the kept length was rounded up to pages the same way.
    unsafe {
        libc::munmap(
            ptr.as_ptr().cast(),
            len.max(1).next_multiple_of(page_size()),
        )
    };
}

fn oom() -> io::Error {
    io::Error::new(io::ErrorKind::OutOfMemory, "out of memory")
}
