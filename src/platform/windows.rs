//! Windows: `seek_read` per segment (each worker keeps its own handle: synchronous reads on one
//! handle are serialised), `FILE_FLAG_NO_BUFFERING` for uncached reads (sector aligned, through
//! the engine's bounce buffer), `GetDriveTypeW` / UNC paths for the filesystem kind,
//! `GlobalMemoryStatusEx` for memory, `VirtualAlloc` for destinations.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::windows::ffi::OsStrExt;
use std::os::windows::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

use windows_sys::Win32::Storage::FileSystem::{
    BY_HANDLE_FILE_INFORMATION, FILE_BASIC_INFO, FILE_FLAG_NO_BUFFERING, FileBasicInfo,
    GetDriveTypeW, GetFileInformationByHandle, GetFileInformationByHandleEx, GetVolumePathNameW,
};
use windows_sys::Win32::System::JobObjects::{
    IsProcessInJob, JOB_OBJECT_LIMIT_JOB_MEMORY, JOB_OBJECT_LIMIT_PROCESS_MEMORY,
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION, JOBOBJECT_LIMIT_VIOLATION_INFORMATION,
    JobObjectExtendedLimitInformation, JobObjectLimitViolationInformation,
    QueryInformationJobObject,
};
use windows_sys::Win32::System::Memory::{
    MEM_COMMIT, MEM_RELEASE, MEM_RESERVE, PAGE_READWRITE, VirtualAlloc, VirtualFree,
};
use windows_sys::Win32::System::ProcessStatus::{K32GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS};
use windows_sys::Win32::System::SystemInformation::{
    GetSystemInfo, GlobalMemoryStatusEx, MEMORYSTATUSEX, SYSTEM_INFO,
};
use windows_sys::Win32::System::Threading::GetCurrentProcess;
use windows_sys::Win32::System::WindowsProgramming::{DRIVE_RAMDISK, DRIVE_REMOTE};

use super::kinds::{self, FileIdentity, FsKind, Uncached};

pub const PARALLEL_READS_SHARE_HANDLE: bool = false;
pub const MAP_IS_SAFE: bool = false;
/// VirtualAlloc's allocation granularity.
#[cfg(test)]
pub const MAP_ALIGN: usize = 64 << 10;
/// FILE_FLAG_NO_BUFFERING wants sector-aligned offsets, lengths and addresses; 4 KiB covers
/// 512-byte and 4Kn sectors.
const UNCACHED_ALIGN: u64 = 4096;

/// One `seek_read` per segment, in order, stopping at the first short read (std has no
/// vectored positional read on Windows).
pub fn read_vectored_at(
    file: &File,
    bufs: &mut [IoSliceMut<'_>],
    offset: u64,
) -> io::Result<usize> {
    let mut done = 0usize;
    for buf in bufs.iter_mut() {
        if buf.is_empty() {
            continue;
        }
        let n = match file.seek_read(buf, offset + done as u64) {
            Ok(n) => n,
            // What was read stands; the caller's next read reports the error.
            Err(_) if done > 0 => return Ok(done),
            Err(e) => return Err(e),
        };
        done += n;
        if n < buf.len() {
            break;
        }
    }
    Ok(done)
}

pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    file.seek_read(buf, offset)
}

pub fn write_all_at(file: &File, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match file.seek_write(buf, offset) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub fn preallocate(file: &File, len: u64) -> io::Result<()> {
    file.set_len(len)
}

/// NTFS journals a rename; a directory cannot be opened to flush it without backup semantics.
pub fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// Opens `path` to read with the `flags` of `CreateFileW`, refusing what is not a regular file
/// ([`kinds::regular`]): a device or a pipe (opening one does not wait on Windows).
pub fn open_read(path: &Path, flags: u32) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)?;
    kinds::regular(&file, special_kind)?;
    Ok(file)
}

/// What a file that is neither regular nor a directory is, for messages.
pub fn special_kind(_kind: &std::fs::FileType) -> &'static str {
    "a device or a pipe"
}

pub fn open_uncached(path: &Path) -> Option<Uncached> {
    let file = open_read(path, FILE_FLAG_NO_BUFFERING).ok()?;
    Some(Uncached {
        file,
        align: UNCACHED_ALIGN,
    })
}

/// No per-file read-ahead hint worth its cost on Windows: the cache manager reads ahead on
/// sequential access by itself.
pub fn prefetch(_file: &File, _offset: u64, _len: u64) {}

pub fn prefetch_all(_file: &File, _offset: u64, _len: u64) {}

/// Sequential access is a flag at open on Windows (`FILE_FLAG_SEQUENTIAL_SCAN`), not a hint
/// for an open handle; the cache manager detects sequential reads by itself.
pub fn advise_sequential(_file: &File) {}

/// Random access is a flag at open on Windows (`FILE_FLAG_RANDOM_ACCESS`), not a hint for an
/// open handle.
pub fn advise_random(_file: &File) {}

pub fn advise_normal(_file: &File) {}

/// Windows has no call that evicts one file's pages.
pub fn drop_cache(_file: &File) {}

fn wide(path: &Path) -> Vec<u16> {
    path.as_os_str().encode_wide().chain([0]).collect()
}

/// UNC paths (`\\server\share\...`, `\\?\UNC\...`) and mapped network drives count as network.
pub fn fs_kind(_file: &File, path: &Path) -> FsKind {
    let Ok(path) = std::path::absolute(path) else {
        return FsKind::Local;
    };
    if is_unc(&path.to_string_lossy()) {
        return FsKind::Network("smb");
    }
    let name = wide(&path);
    let mut root = vec![0u16; 1024];
    // SAFETY: `name` is NUL-terminated; `root` has `root.len()` u16s of room.
    let ok = unsafe { GetVolumePathNameW(name.as_ptr(), root.as_mut_ptr(), root.len() as u32) };
    if ok == 0 {
        return FsKind::Local;
    }
    // SAFETY: GetVolumePathNameW wrote a NUL-terminated root path.
    match unsafe { GetDriveTypeW(root.as_ptr()) } {
        DRIVE_REMOTE => FsKind::Network("smb"),
        DRIVE_RAMDISK => FsKind::Memory,
        _ => FsKind::Local,
    }
}

fn is_unc(path: &str) -> bool {
    let upper = path.to_ascii_uppercase();
    upper.starts_with(r"\\?\UNC\")
        || (upper.starts_with(r"\\") && !upper.starts_with(r"\\?\") && !upper.starts_with(r"\\.\"))
}

/// The cache manager does not say which pages of a file it holds.
pub fn cached_fraction(_file: &File, _offset: u64, _len: u64) -> Option<f64> {
    None
}

pub fn available_memory() -> Option<u64> {
    // SAFETY: MEMORYSTATUSEX is plain data; dwLength must be set before the call.
    let mut status: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
    status.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
    // SAFETY: the struct is ours and sized as dwLength says.
    (unsafe { GlobalMemoryStatusEx(&mut status) } != 0).then_some(status.ullAvailPhys)
}

/// What the job object this process runs in still lets it commit, where the job limits memory:
/// the per-process limit less this process's commit charge, and the job's limit less the job's
/// commit, whichever is smaller. None outside a job, or in a job without a memory limit.
pub fn job_memory_headroom() -> Option<u64> {
    // SAFETY: a pseudo-handle; never closed.
    let process = unsafe { GetCurrentProcess() };
    let mut in_job = 0;
    // SAFETY: a null job handle asks about any job; `in_job` is ours.
    if unsafe { IsProcessInJob(process, std::ptr::null_mut(), &mut in_job) } == 0 || in_job == 0 {
        return None;
    }
    /// Queries the calling process's job (a null handle) for `class` into a `T`.
    fn query<T>(class: i32) -> Option<T> {
        // SAFETY: plain data, filled by the call below.
        let mut info: T = unsafe { std::mem::zeroed() };
        // SAFETY: the buffer is ours and sized as passed.
        let ok = unsafe {
            QueryInformationJobObject(
                std::ptr::null_mut(),
                class,
                (&mut info as *mut T).cast(),
                std::mem::size_of::<T>() as u32,
                std::ptr::null_mut(),
            )
        };
        (ok != 0).then_some(info)
    }
    let limits: JOBOBJECT_EXTENDED_LIMIT_INFORMATION = query(JobObjectExtendedLimitInformation)?;
    let flags = limits.BasicLimitInformation.LimitFlags;
    let mut room: Option<u64> = None;
    if flags & JOB_OBJECT_LIMIT_PROCESS_MEMORY != 0 {
        // SAFETY: plain data; cb must be set before the call.
        let mut counters: PROCESS_MEMORY_COUNTERS = unsafe { std::mem::zeroed() };
        counters.cb = std::mem::size_of::<PROCESS_MEMORY_COUNTERS>() as u32;
        // SAFETY: the struct is ours and sized as cb says.
        let used = if unsafe { K32GetProcessMemoryInfo(process, &mut counters, counters.cb) } != 0 {
            counters.PagefileUsage as u64
        } else {
            0
        };
        room = Some((limits.ProcessMemoryLimit as u64).saturating_sub(used));
    }
    if flags & JOB_OBJECT_LIMIT_JOB_MEMORY != 0 {
        let used =
            query::<JOBOBJECT_LIMIT_VIOLATION_INFORMATION>(JobObjectLimitViolationInformation)
                .map_or(limits.PeakJobMemoryUsed as u64, |v| v.JobMemory);
        let job = (limits.JobMemoryLimit as u64).saturating_sub(used);
        room = Some(room.map_or(job, |r| r.min(job)));
    }
    room
}

/// Windows has no fork: no process ever copies this one's threads.
pub fn fork_generation() -> u64 {
    0
}

pub fn file_len(file: &File) -> io::Result<u64> {
    Ok(file.metadata()?.len())
}

/// The volume serial number and file index (`GetFileInformationByHandle`; ReFS's 128-bit file
/// ids are not always unique in those 64 bits), the size, and `LastWriteTime` and `ChangeTime`
/// (`FILE_BASIC_INFO`; the change time is NTFS's ctime).
pub fn file_identity(file: &File) -> io::Result<FileIdentity> {
    use std::os::windows::io::AsRawHandle;
    let handle = file.as_raw_handle();
    let mut ids = BY_HANDLE_FILE_INFORMATION::default();
    // SAFETY: `handle` stays open while `file` is borrowed; `ids` is the writable struct the call
    // fills.
    if unsafe { GetFileInformationByHandle(handle, &mut ids) } == 0 {
        return Err(io::Error::last_os_error());
    }
    let mut times = FILE_BASIC_INFO::default();
    // SAFETY: as above; the size given is that of `times`, the struct `FileBasicInfo` fills.
    let filled = unsafe {
        GetFileInformationByHandleEx(
            handle,
            FileBasicInfo,
            (&raw mut times).cast(),
            std::mem::size_of::<FILE_BASIC_INFO>() as u32,
        )
    };
    if filled == 0 {
        return Err(io::Error::last_os_error());
    }
    let halves = |high: u32, low: u32| u64::from(high) << 32 | u64::from(low);
    Ok(FileIdentity {
        device: u64::from(ids.dwVolumeSerialNumber),
        inode: halves(ids.nFileIndexHigh, ids.nFileIndexLow),
        size: halves(ids.nFileSizeHigh, ids.nFileSizeLow),
        mtime_ns: unix_ns(times.LastWriteTime),
        ctime_ns: unix_ns(times.ChangeTime),
    })
}

/// A FILETIME count (100 ns since 1601-01-01) as ns since the Unix epoch.
fn unix_ns(filetime: i64) -> i128 {
    const UNIX_EPOCH_AS_FILETIME: i128 = 116_444_736_000_000_000;
    (i128::from(filetime) - UNIX_EPOCH_AS_FILETIME) * 100
}

pub fn page_size() -> usize {
    // SAFETY: GetSystemInfo fills the struct we pass.
    let mut info: SYSTEM_INFO = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable SYSTEM_INFO.
    unsafe { GetSystemInfo(&mut info) };
    (info.dwPageSize as usize).max(4096)
}

pub fn map_anonymous(len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh allocation at an address of the system's choosing; checked below.
    let ptr = unsafe {
        VirtualAlloc(
            std::ptr::null(),
            len.max(1),
            MEM_RESERVE | MEM_COMMIT,
            PAGE_READWRITE,
        )
    };
    NonNull::new(ptr.cast::<u8>()).ok_or_else(io::Error::last_os_error)
}

/// # Safety
/// `ptr` is one `map_anonymous` result, no longer used.
pub unsafe fn unmap_anonymous(ptr: NonNull<u8>, _len: usize) {
    // SAFETY: the caller's contract; MEM_RELEASE frees the whole allocation (size must be 0).
    unsafe { VirtualFree(ptr.as_ptr().cast(), 0, MEM_RELEASE) };
}

pub use super::elsewhere::{
    advise_huge_pages, fuse_requests_in_flight, huge_page_faults_cannot_stall, populate_mapped,
    prefault,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unc_paths_are_network() {
        assert!(is_unc(r"\\server\share\model.safetensors"));
        assert!(is_unc(r"\\?\UNC\server\share\model.safetensors"));
        assert!(!is_unc(r"\\?\C:\models\model.safetensors"));
        assert!(!is_unc(r"C:\models\model.safetensors"));
    }

    #[test]
    fn short_vectored_read_stops_at_end_of_file() {
        let path = std::env::temp_dir().join(format!("safeload-win-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let file = File::open(&path).unwrap();
        let (mut a, mut b) = ([0u8; 4], [0u8; 10]);
        let mut bufs = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
        assert_eq!(read_vectored_at(&file, &mut bufs, 2).unwrap(), 8);
        assert_eq!(&a, b"2345");
        assert_eq!(&b[..4], b"6789");
        drop(file);
        std::fs::remove_file(path).unwrap();
    }
}
