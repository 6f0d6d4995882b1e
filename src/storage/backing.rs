//! What a [`crate::read::source::Source`] reads from: a local file (pread, uncached reads, maps),
//! or an object in a store read with ranged GETs (`remote`, the pread path only); what each can
//! do, asked rather than which it is. `location::open` makes one.
//!
//! The reader's one way in is a [`Reader`] (one per worker and input): it fills buffers from an
//! offset whatever holds the bytes (`preadv` of the file, ranged GETs of the object), so nothing
//! above this layer names a kind of storage.
//!
//! Also the one rule every read of a local file ends with ([`confirm_covered`]): a read that got
//! all its bytes still fails when the file no longer covers them.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::path::Path;
use std::sync::atomic::AtomicBool;

use crate::platform;

/// Workers for objects in a store: requests in flight, each waiting on a round trip.
pub const STORE_THREADS: usize = 32;
/// Bytes per ranged GET.
pub const STORE_CHUNK_BYTES: usize = 16 << 20;

pub enum Backing {
    File(File),
    #[cfg(feature = "remote")]
    Remote(crate::storage::remote::Object),
}

impl From<File> for Backing {
    fn from(file: File) -> Self {
        Backing::File(file)
    }
}

impl Backing {
    /// One worker's reader of this backing at `path`. `own_fd`: a file is read through a
    /// descriptor of the worker's own, opened on first use (network filesystems serialise reads
    /// on one descriptor); an object's requests are the worker's own already.
    pub fn reader<'a>(&'a self, path: &'a Path, own_fd: bool) -> Reader<'a> {
        Reader {
            backing: self,
            path,
            own_fd,
            fd: None,
        }
    }

    /// The local file; None for an object in a store.
    pub fn file(&self) -> Option<&File> {
        match self {
            Backing::File(file) => Some(file),
            #[cfg(feature = "remote")]
            Backing::Remote(_) => None,
        }
    }

    /// Whether it can be mapped or read around the page cache (a local file); an object in a
    /// store is read with ranged GETs only, whatever was asked for.
    pub fn can_map(&self) -> bool {
        self.file().is_some()
    }

    /// Whether a read may wait long (a request to a store, on a stalled server): such reads
    /// run on workers while the caller's thread polls for cancellation. A file's never do.
    pub fn may_wait_long(&self) -> bool {
        self.file().is_none()
    }

    /// The reader's defaults this storage asks for, `(workers, bytes per request)`, over the
    /// filesystem's: a store wants many requests in flight, each a round trip. None for a file.
    pub fn defaults(&self) -> Option<(usize, usize)> {
        self.file()
            .is_none()
            .then_some((STORE_THREADS, STORE_CHUNK_BYTES))
    }

    /// Fills `buf` from `offset`, retrying short reads: short only where the file or object
    /// ends (a header, read once at open; a read that must cover all of `buf` is
    /// [`Backing::read_exact_at`]). Returns the bytes read.
    pub fn read_fully_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        match self {
            Backing::File(file) => platform::read_fully_at(file, buf, offset),
            #[cfg(feature = "remote")]
            Backing::Remote(object) => object.read_fully_at(buf, offset),
        }
    }

    /// The SHA-256 the store reported of the object when it was opened and the header that said
    /// it (the Hub's); taken from the opening request's answer. None for a file, and for an
    /// object whose store reported none.
    pub fn reported_digest(&self) -> Option<(crate::format::digest::Digest, &'static str)> {
        match self {
            Backing::File(_) => None,
            #[cfg(feature = "remote")]
            Backing::Remote(object) => (object.reported_digest()).map(|r| (r.digest, r.from)),
        }
    }

    /// Fills `buf` from `offset`: a file or object that ends before, or no longer covers, all
    /// of it is an `UnexpectedEof` error ([`ended_early`]).
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Covered {
        match self {
            Backing::File(file) => read_exact_at(file, buf, offset),
            #[cfg(feature = "remote")]
            Backing::Remote(object) => {
                // An object's length is fixed when it is opened (a changed object fails its
                // requests): only a short answer needs telling.
                let got = object.read_fully_at(buf, offset).map_err(|e| (0, e))?;
                match buf.len() - got {
                    0 => Ok(()),
                    missing => Err((got, ended_early(missing))),
                }
            }
        }
    }
}

/// One worker's way of reading one input (made by [`Backing::reader`]): whatever holds the bytes,
/// the same calls.
pub struct Reader<'a> {
    backing: &'a Backing,
    path: &'a Path,
    own_fd: bool,
    /// The worker's own descriptor, once opened; None where opening it failed too (the shared
    /// one is read then).
    fd: Option<File>,
}

impl Reader<'_> {
    /// The file this worker reads through: the shared descriptor or its own. None for an object.
    fn file(&mut self) -> Option<&File> {
        let shared = self.backing.file()?;
        if !self.own_fd {
            return Some(shared);
        }
        if self.fd.is_none() {
            // A path swapped for a FIFO since the source opened it is refused, not waited on.
            self.fd = platform::open_regular(self.path).ok();
        }
        Some(self.fd.as_ref().unwrap_or(shared))
    }

    /// Tells the storage these bytes will be read soon, so it reads them while the caller does
    /// something else: the page cache is asked for a file's; an object's have nowhere to wait.
    pub fn ask_ahead(&mut self, offset: u64, len: u64) {
        if let Some(file) = self.file() {
            platform::prefetch(file, offset, len);
        }
    }

    /// Fills `bufs`, in order, with the bytes from `offset` on, retrying short reads and EINTR (a
    /// file) or resuming a failed request (an object); a file then confirms it still covers them
    /// ([`confirm_covered`]). An end before all of them is an `UnexpectedEof` error
    /// ([`ended_early`]); `stop` set makes an object's read give up (`Interrupted`). On failure
    /// returns how many bytes can be trusted.
    pub fn read_exact_into(
        &mut self,
        offset: u64,
        bufs: &mut [IoSliceMut<'_>],
        stop: &AtomicBool,
    ) -> Covered {
        #[cfg(feature = "remote")]
        if let Backing::Remote(object) = self.backing {
            let mut dests: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut **b).collect();
            return object.read_into(offset, &mut dests, stop);
        }
        let _ = stop; // a file's read is not stopped midway: each is MiB-sized
        let file = self.file().expect("a backing is a file or an object");
        read_exact_into(file, offset, bufs)
    }
}

/// Fills `bufs`, in order, from `offset` of `file`, retrying short reads and EINTR; then
/// [`confirm_covered`]. On failure returns how many bytes were read before it.
pub fn read_exact_into(file: &File, offset: u64, bufs: &mut [IoSliceMut<'_>]) -> Covered {
    let mut rest: &mut [IoSliceMut<'_>] = bufs;
    let mut done = 0usize;
    while !rest.is_empty() {
        match platform::read_vectored_at(file, rest, offset + done as u64) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((done, e)),
            Ok(0) => return Err((done, ended_early(rest.iter().map(|b| b.len()).sum()))),
            Ok(n) => {
                done += n;
                IoSliceMut::advance_slices(&mut rest, n);
            }
        }
    }
    confirm_covered(file, offset, done)
}

/// On failure: how many of the bytes asked for can be trusted (read, and still in the file),
/// and the error.
pub type Covered = Result<(), (usize, io::Error)>;

/// Fills `buf` from `offset` of `file`, retrying short reads; then [`confirm_covered`].
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> Covered {
    let got = platform::read_fully_at(file, buf, offset).map_err(|e| (0, e))?;
    if got < buf.len() {
        return Err((got, ended_early(buf.len() - got)));
    }
    confirm_covered(file, offset, buf.len())
}

/// After a read of `file` returned all `len` bytes at `offset`: fails, as a short read would,
/// unless the file still covers them.
///
/// A truncation lowers the file's size first, then zeroes in place the part past the new end of
/// the page that straddles it (on Linux with large folios, up to 2 MiB of it:
/// `truncate_inode_partial_folio`). A read that sampled the old size and holds that page copies
/// the zeros and returns full length (issue 52), so no byte count tells; the size asked after
/// the read does, since it was lowered before the zeros were written. One `lseek`
/// ([`platform::file_len`]) per call: callers ask once per chunk (MiB-sized), never per tensor.
pub fn confirm_covered(file: &File, offset: u64, len: usize) -> Covered {
    let end = offset + len as u64;
    let file_len = platform::file_len(file).map_err(|e| (0, e))?;
    if file_len >= end {
        return Ok(());
    }
    let kept = file_len.saturating_sub(offset);
    Err((kept as usize, ended_early(len - kept as usize)))
}

/// The error of a read that a file's end cut short: a short read, or one [`confirm_covered`]
/// found past the end.
pub fn ended_early(missing: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("file ended early, {missing} bytes missing (truncated while reading?)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn bytes_the_file_no_longer_covers_fail_as_a_short_read_does() {
        let path = std::env::temp_dir().join(format!("safeload-backing-{}", std::process::id()));
        File::create(&path).unwrap().write_all(&[7u8; 100]).unwrap();
        let file = File::open(&path).unwrap();
        let mut buf = [0u8; 50];
        read_exact_at(&file, &mut buf, 50).unwrap();
        assert_eq!(buf, [7u8; 50]);
        // Cut after the read returned: its bytes past the new end may be a truncation's zeros.
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(60)
            .unwrap();
        let message = "file ended early, 40 bytes missing (truncated while reading?)";
        let (kept, err) = confirm_covered(&file, 50, 50).unwrap_err();
        assert_eq!((kept, err.kind()), (10, io::ErrorKind::UnexpectedEof));
        assert_eq!(err.to_string(), message);
        // Read again now: short, and the same error.
        let (got, err) = read_exact_at(&file, &mut buf, 50).unwrap_err();
        assert_eq!((got, err.to_string().as_str()), (10, message));
        confirm_covered(&file, 0, 60).unwrap();
        confirm_covered(&file, 60, 0).unwrap();
        let backing = Backing::File(file);
        assert_eq!(
            backing.read_exact_at(&mut buf[..10], 50).map_err(|e| e.0),
            Ok(())
        );
        std::fs::remove_file(path).unwrap();
    }
}
