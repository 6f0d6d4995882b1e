//! The operating system, behind one small safe API. Every call into the OS that the reader
//! needs lives here, one file per platform chosen by `cfg` (memmap2's `unix.rs` / `windows.rs`
//! split): the rest of the crate never names `libc` or a Windows API.
//!
//! | need | Linux | macOS | Windows |
//! |---|---|---|---|
//! | positional vectored read | `preadv` | `preadv` | `seek_read` per segment |
//! | positional write, space reserved | `pwrite`, `posix_fallocate` | `pwrite`, `set_len` | `seek_write`, `set_len` |
//! | a renamed file's entry made durable | `fsync` of the directory | `fsync` of the directory | none (NTFS journals it) |
//! | uncached read handle | `O_DIRECT` (4 KiB aligned) | `F_NOCACHE` (no alignment) | `FILE_FLAG_NO_BUFFERING` (4 KiB aligned) |
//! | cache hints / drop | `posix_fadvise` | `F_RDADVISE`, `F_RDAHEAD` / none | none |
//! | filesystem kind | `fstatfs` magic | `statfs.f_fstypename` | `GetDriveTypeW`, UNC paths |
//! | page-cache residency | `mincore` | `mincore` | unknown |
//! | available memory | `/proc/meminfo` | `host_statistics64` | `GlobalMemoryStatusEx` |
//! | destination memory | `mmap`, 2 MiB aligned, THP advice | `mmap` | `VirtualAlloc` |
//! | file identity | `fstat`: dev, ino, size, mtime, ctime | `fstat` | volume serial, file index, `LastWriteTime`, `ChangeTime` |

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::path::Path;
use std::ptr::NonNull;

#[cfg(not(any(target_os = "linux", target_os = "android")))]
mod elsewhere;
mod kinds;
#[cfg(unix)]
mod unix;

#[cfg_attr(any(target_os = "linux", target_os = "android"), path = "linux.rs")]
#[cfg_attr(target_vendor = "apple", path = "macos.rs")]
#[cfg_attr(windows, path = "windows.rs")]
mod os;

pub use kinds::{FileIdentity, FsKind, Uncached};

/// The identity of the file open as `file`.
pub fn file_identity(file: &File) -> io::Result<FileIdentity> {
    os::file_identity(file)
}

/// Whether several threads reading one handle at once run in parallel. Windows serialises
/// synchronous reads on a handle, so there every worker opens its own.
pub const PARALLEL_READS_SHARE_HANDLE: bool = os::PARALLEL_READS_SHARE_HANDLE;

/// Whether `auto` may map files: not on Windows, where a mapped file cannot be replaced or
/// deleted and safetensors 0.8's mmap path crashes (0xC0000005) on some large files.
pub const MAP_IS_SAFE: bool = os::MAP_IS_SAFE;

/// Reads at `offset` into `bufs` in order; returns how many bytes were read (0 at end of file;
/// short reads are possible, the caller continues).
pub fn read_vectored_at(
    file: &File,
    bufs: &mut [IoSliceMut<'_>],
    offset: u64,
) -> io::Result<usize> {
    os::read_vectored_at(file, bufs, offset)
}

/// Reads at `offset` into `buf`; returns how many bytes were read (0 at end of file).
pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    os::read_at(file, buf, offset)
}

/// `read_at` until `buf` is full or the file ends, retrying interrupted reads; returns the bytes
/// read.
pub fn read_fully_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match read_at(file, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Writes all of `buf` at `offset`, retrying short and interrupted writes.
pub fn write_all_at(file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
    os::write_all_at(file, buf, offset)
}

/// Reserves `len` bytes for `file` (just created, empty), so a full disk is an error before
/// anything is written and the writes that follow do not extend the file one by one. Where the
/// filesystem cannot reserve, the file is only extended (`set_len`).
pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    os::preallocate(file, len)
}

/// Makes the entries of directory `dir` durable (after a rename into it), where the OS needs it.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    os::sync_dir(dir)
}

/// Opens `path` to read, refusing at once what is not a regular file: a directory ("Is a
/// directory", as the OS says it), a FIFO (opened without waiting for a writer, which would
/// block for ever), a character or block device (`/dev/zero` reads without end), a socket. The
/// file is checked after it is opened, so a path swapped between a check and the open is caught.
pub fn open_regular(path: &Path) -> io::Result<File> {
    os::open_read(path, 0)
}

/// Opens `path` for reads that bypass the page cache, or None where the OS or the filesystem
/// refuses (a read may still fail later with `InvalidInput`: then read buffered).
pub fn open_uncached(path: &Path) -> Option<Uncached> {
    os::open_uncached(path)
}

/// Whether an error from an uncached read means "this filesystem does not take uncached reads"
/// (EINVAL / ERROR_INVALID_PARAMETER), so buffered reads should take over.
pub fn uncached_refused(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::InvalidInput
}

/// Tells the OS that `len` bytes at `offset` will be read soon (a hint; errors are ignored).
pub fn prefetch(file: &File, offset: u64, len: u64) {
    os::prefetch(file, offset, len)
}

/// Tells the OS to read all `len` bytes at `offset` into its cache now, without waiting for
/// them (a hint): [`prefetch`] where one call asks for the whole range, else in pieces (Linux
/// reads at most a read-ahead window per call).
pub fn prefetch_all(file: &File, offset: u64, len: u64) {
    os::prefetch_all(file, offset, len)
}

/// Whether [`ready_pages_for_writes`] does anything here: on Linux, where reading ahead over
/// blocks reserved but not yet written (or a hole) fills the pages with zeros without I/O. macOS
/// and Windows: not measured (their caches may read what a reservation holds), so nothing.
pub const READIES_PAGES_FOR_WRITES: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// Puts the page-cache pages of `[offset, offset+len)` of a file being written in place now,
/// zero-filled, so that the writes that follow copy into pages already there (a hint; errors are
/// ignored). Only for ranges whose blocks are reserved and not yet written, or holes, and only
/// where [`READIES_PAGES_FOR_WRITES`]: anything else would read the disk.
pub fn ready_pages_for_writes(file: &File, offset: u64, len: u64) {
    if READIES_PAGES_FOR_WRITES {
        os::prefetch_all(file, offset, len)
    }
}

/// Tells the OS that `file` will be read front to back (larger read-ahead; a hint).
pub fn advise_sequential(file: &File) {
    os::advise_sequential(file)
}

/// Tells the OS that `file` is read at scattered places: read only what is asked, nothing
/// around it (a hint; parts of a file read by range, as a tensor-parallel rank reads its slices).
pub fn advise_random(file: &File) {
    os::advise_random(file)
}

/// Faults in `map` (a file's) read the page they need, nothing around it (a hint).
pub fn advise_map_random(map: &memmap2::MmapMut) {
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    #[cfg(not(unix))]
    let _ = map; // Windows: the memory manager's read-around has no per-view advice
}

/// Undoes [`advise_random`]: `file` is read ahead again as the OS sees fit (a hint).
pub fn advise_normal(file: &File) {
    os::advise_normal(file)
}

/// Drops a file's clean pages from the page cache where the OS allows it (a hint).
pub fn drop_cache(file: &File) {
    os::drop_cache(file)
}

/// What kind of filesystem holds `file` (opened from `path`).
pub fn fs_kind(file: &File, path: &Path) -> FsKind {
    os::fs_kind(file, path)
}

/// How many requests the kernel keeps in flight to the FUSE daemon serving `file` (Linux
/// `max_background`), where it can be read.
pub fn fuse_requests_in_flight(file: &File) -> Option<usize> {
    os::fuse_requests_in_flight(file)
}

/// Fraction (0..=1) of `len` bytes from `offset` of `file` in the page cache, sampled; None where
/// it cannot be told.
pub fn cached_fraction(file: &File, offset: u64, len: u64) -> Option<f64> {
    if len == 0 {
        return Some(1.0);
    }
    os::cached_fraction(file, offset, len)
}

/// Memory the OS can hand out without swapping, in bytes.
pub fn available_memory() -> Option<u64> {
    os::available_memory()
}

/// Windows: what the job object the process runs in still lets it commit (see
/// `windows::job_memory_headroom`); elsewhere None (Linux containers are cgroups, read by
/// [`crate::read::memory`] from their files).
pub fn job_memory_headroom() -> Option<u64> {
    #[cfg(windows)]
    return os::job_memory_headroom();
    #[cfg(not(windows))]
    None
}

/// The cores this process may run on (`available_parallelism`; 1 when unknown), found once:
/// on Linux the standard library reads the cgroup's files (/proc/self/cgroup, mountinfo,
/// cpu.max) at every call, which cost a demand read of a small tensor (a `get_tensor` the
/// read-ahead had handed out before) 37 us where the read takes a few.
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How many times this process has been forked, as seen from inside it: 0 in the process that
/// first asked, more in a child forked after that (its threads stayed in the parent). One load of
/// an atomic, where comparing `std::process::id()` costs a `getpid` system call each time (2-3 %
/// of a loop taking 20,000 small tensors from a prefetch).
pub fn fork_generation() -> u64 {
    os::fork_generation()
}

/// How long `file` is now. Unix: `lseek` to its end, a third of what `fstat` costs (no
/// attributes gathered or copied out); it moves the descriptor's offset, which no read of this
/// crate uses. Asked before every view of a map is handed out ([`crate::read::buffer::TensorBytes::checked`]).
pub fn file_len(file: &File) -> io::Result<u64> {
    os::file_len(file)
}

/// The VM page size.
pub fn page_size() -> usize {
    os::page_size()
}

/// Alignment of [`map_anonymous`] memory: 2 MiB where huge pages exist (Linux), else a page (64
/// KiB allocation granularity on Windows).
#[cfg(test)]
pub const MAP_ALIGN: usize = os::MAP_ALIGN;

/// `len` bytes (rounded up to pages) of fresh, zeroed, writable memory aligned to [`MAP_ALIGN`],
/// reserved lazily (pages are committed on first touch where the OS allows it).
pub fn map_anonymous(len: usize) -> io::Result<NonNull<u8>> {
    os::map_anonymous(len)
}

/// Gives back memory from [`map_anonymous`].
///
/// # Safety
/// `ptr` and `len` must be exactly what one `map_anonymous(len)` call returned and took, and
/// nothing may use the memory afterwards.
pub unsafe fn unmap_anonymous(ptr: NonNull<u8>, len: usize) {
    // SAFETY: forwarded contract.
    unsafe { os::unmap_anonymous(ptr, len) }
}

/// Reads the file pages behind `[ptr, ptr+len)` of a private file map into the page cache and
/// maps them (so the first touch does not fault), waiting for them. False where the OS cannot
/// (then [`prefetch`] is the hint to give). A page past the file's end is an error, not SIGBUS.
pub fn populate_mapped(ptr: NonNull<u8>, len: usize) -> bool {
    os::populate_mapped(ptr, len)
}

/// Maps the pages of `[ptr, ptr+len)` writable ahead of the writes that fill them, as their
/// first writes would but in one call, where the OS can (Linux 5.14); bytes are unchanged.
pub fn prefault(ptr: *mut u8, len: usize) {
    os::prefault(ptr, len)
}

/// Advises the OS to back `[ptr, ptr+len)` with huge pages (a hint; no-op where there are none).
pub fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    os::advise_huge_pages(ptr, len)
}

/// Whether a huge-page fault can stall (compaction) on this machine; see `buffer`.
pub fn huge_page_faults_cannot_stall() -> bool {
    os::huge_page_faults_cannot_stall()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(bytes: &[u8], tag: &str) -> (std::path::PathBuf, File) {
        let path =
            std::env::temp_dir().join(format!("safeload-platform-{}-{tag}", std::process::id()));
        File::create(&path).unwrap().write_all(bytes).unwrap();
        let file = File::open(&path).unwrap();
        (path, file)
    }

    /// The length now, after the file shrank under an open descriptor; asking leaves positional
    /// reads as they were.
    #[test]
    fn file_len_follows_a_file_that_shrinks() {
        let (path, file) = temp_file(b"0123456789", "len");
        assert_eq!(file_len(&file).unwrap(), 10);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4)
            .unwrap();
        assert_eq!(file_len(&file).unwrap(), 4);
        let mut buf = [0u8; 8];
        assert_eq!(read_fully_at(&file, &mut buf, 1).unwrap(), 3);
        assert_eq!(&buf[..3], b"123");
        std::fs::remove_file(path).unwrap();
    }

    /// A forked child sees a generation its parent never had; the parent's stays as it was.
    #[cfg(unix)]
    #[test]
    fn a_forked_child_has_its_own_fork_generation() {
        let before = fork_generation();
        // SAFETY: the child only reads an atomic (the handler is registered by the call above)
        // and leaves with `_exit`, running nothing of the parent's.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if fork_generation() != before { 0 } else { 1 };
            // SAFETY: ends the child at once, without the parent's atexit work.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just made.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child saw {before}"
        );
        assert_eq!(fork_generation(), before);
    }

    #[test]
    fn vectored_reads_fill_segments_in_order() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let (path, file) = temp_file(&data, "vectored");
        let (mut a, mut b, mut c) = (vec![0u8; 10], vec![0u8; 0], vec![0u8; 5000]);
        let mut bufs = [
            IoSliceMut::new(&mut a),
            IoSliceMut::new(&mut b),
            IoSliceMut::new(&mut c),
        ];
        let n = read_vectored_at(&file, &mut bufs, 100).unwrap();
        assert!(n > 0 && n <= 5010);
        assert_eq!(a, data[100..110]);
        assert_eq!(&c[..n - 10], &data[110..100 + n]);
        let mut tail = vec![0u8; 100];
        assert_eq!(read_fully_at(&file, &mut tail, 9950).unwrap(), 50);
        assert_eq!(tail[..50], data[9950..]);
        assert_eq!(read_at(&file, &mut tail, 20_000).unwrap(), 0);
        drop(file);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn prefault_leaves_every_byte_as_it_was() {
        // Unaligned ends, a written head, untouched zero pages and a range shorter than a page.
        let len = page_size() * 5 + 123;
        let mut buf: Vec<u8> = vec![0u8; len];
        for (i, b) in buf[..3000].iter_mut().enumerate() {
            *b = (i % 249) as u8 + 1;
        }
        let before = buf.clone();
        prefault(buf.as_mut_ptr().wrapping_add(7), len - 7);
        prefault(buf.as_mut_ptr().wrapping_add(10), 100);
        prefault(buf.as_mut_ptr(), 0);
        assert_eq!(buf, before);
    }

    #[test]
    fn uncached_handle_reads_aligned_spans() {
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 241) as u8).collect();
        let (path, file) = temp_file(&data, "uncached");
        if let Some(u) = open_uncached(&path) {
            assert!(u.align.is_power_of_two());
            let span = 64 << 10;
            let ptr = map_anonymous(span).unwrap();
            assert_eq!(ptr.as_ptr() as usize % MAP_ALIGN, 0);
            // SAFETY: `span` bytes just mapped, zeroed, used only here.
            let buf = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), span) };
            match read_fully_at(&u.file, buf, 4096 * 3) {
                Ok(n) => {
                    assert_eq!(n, span);
                    assert_eq!(&buf[..], &data[4096 * 3..4096 * 3 + span]);
                }
                Err(e) => assert!(uncached_refused(&e), "{e}"),
            }
            // SAFETY: exactly the mapping made above, no longer used.
            unsafe { unmap_anonymous(ptr, span) };
        }
        prefetch(&file, 0, 4096);
        drop_cache(&file);
        drop(file);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn memory_and_kinds_answer() {
        assert!(page_size() >= 4096 && page_size().is_power_of_two());
        assert!(available_memory().is_some_and(|m| m > 0));
        let (path, file) = temp_file(b"x", "kind");
        // The test directory is on a local or memory filesystem on every CI machine.
        assert!(!matches!(fs_kind(&file, &path), FsKind::Network(_)));
        assert_eq!(cached_fraction(&file, 0, 0), Some(1.0));
        drop(file);
        std::fs::remove_file(path).unwrap();
    }
}
