//! A location (a path or a URL) told apart once, here: what a source reads from ([`open`]: the
//! backing, its filesystem kind, its length, the bytes of its start already fetched) and where a
//! checkpoint's files are listed and read ([`place`]). Nothing above the storage layer asks
//! whether a location is a URL: it asks what these return.

use std::io;
use std::path::Path;

use super::backing::Backing;
use super::place::{Local, Place};
use super::remote::{self, Options};
use crate::error::{Error, Result};
use crate::platform::{self, FsKind};

/// A file or an object, opened: what a reader needs to start reading it.
pub struct Opened {
    pub backing: Backing,
    /// The filesystem it is on ("local", "fuse", "nfs" ...), or the store's ("s3", "hf" ...).
    pub kind: FsKind,
    /// Its length at open.
    pub len: u64,
    /// Its first bytes, as far as they were fetched: what an object's opening ranged GET
    /// brought (its header, often some data); none of a file's.
    pub start: Vec<u8>,
}

impl Opened {
    /// Reads on in [`Opened::start`] to its first `upto` bytes (fewer where it ends before);
    /// what is there already is not read again. An error as [`open`] gives it. A file's start
    /// is read exactly, the kernel told not to read around it: a read-ahead there leaves pages
    /// marked to read further ahead when touched, and the file's first tensors, read later by
    /// range (a tensor-parallel rank's slices), would then read on through the rows around them.
    pub fn read_start(&mut self, at: &Path, upto: usize) -> Result<()> {
        let upto = upto.min(usize::try_from(self.len).unwrap_or(usize::MAX));
        let have = self.start.len();
        if have >= upto {
            return Ok(());
        }
        self.start.resize(upto, 0);
        if let Some(file) = self.backing.file() {
            platform::advise_random(file);
        }
        let read = self
            .backing
            .read_fully_at(&mut self.start[have..], have as u64);
        if let Some(file) = self.backing.file() {
            platform::advise_normal(file);
        }
        let got = read.map_err(|e| failed(&self.backing, at, e))?;
        self.start.truncate(have + got);
        Ok(())
    }
}

/// Opens the file or object at `at` (a path, or a URL: `s3://`, `gs://`, `az://`,
/// `http(s)://`, `hf://`) with the store's `storage_options` (ignored for a path). A FIFO, a
/// device or a directory is refused at once (a FIFO's open would wait for a writer for ever,
/// `/dev/zero` has no end). Errors: a file's as [`Error::Open`]; an object's by
/// [`Error::remote`]; a URL in a build without the `remote` feature, [`remote::unavailable`].
pub fn open(at: &Path, options: &Options) -> Result<Opened> {
    if remote::is_url(at) {
        return open_object(at, options);
    }
    let open_err = |source| Error::Open {
        path: at.to_path_buf(),
        source,
    };
    let file = platform::open_regular(at).map_err(open_err)?;
    let len = file.metadata().map_err(open_err)?.len();
    Ok(Opened {
        kind: platform::fs_kind(&file, at),
        backing: Backing::File(file),
        len,
        start: Vec::new(),
    })
}

/// The object at URL `at` ([`remote::open`]), as a backing.
#[cfg(feature = "remote")]
fn open_object(at: &Path, options: &Options) -> Result<Opened> {
    let (object, kind, start) = remote::open(at, options)?;
    Ok(Opened {
        kind,
        len: object.size(),
        backing: Backing::Remote(object),
        start,
    })
}

#[cfg(not(feature = "remote"))]
fn open_object(at: &Path, _: &Options) -> Result<Opened> {
    Err(remote::unavailable(at))
}

/// Where the checkpoint at `at` (a path, or a URL or URL prefix) has its files listed and its
/// index read: the file system, or the store the URL names, reached with `options`.
pub fn place<'a>(at: &Path, options: &'a Options) -> Result<Box<dyn Place + 'a>> {
    if remote::is_url(at) {
        return remote::place(at, options);
    }
    Ok(Box::new(Local))
}

/// An error reading `backing` (at `at`) at open, as [`open`]'s own.
fn failed(backing: &Backing, at: &Path, source: io::Error) -> Error {
    match backing {
        Backing::File(_) => Error::Open {
            path: at.to_path_buf(),
            source,
        },
        #[cfg(feature = "remote")]
        Backing::Remote(_) => Error::remote(at, source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_opens_a_file_with_nothing_fetched_and_reads_its_start() {
        let path = std::env::temp_dir().join(format!("safeload-location-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let mut opened = open(&path, &[]).unwrap();
        assert!(opened.backing.can_map());
        assert_eq!((opened.len, opened.start.len()), (10, 0));
        opened.read_start(&path, 4).unwrap();
        assert_eq!(opened.start, b"0123");
        // Past the end: as far as it goes.
        opened.read_start(&path, 64).unwrap();
        assert_eq!(opened.start, b"0123456789");
        assert!(place(&path, &[]).unwrap().may_look_beside());
        drop(opened); // closed first: Windows keeps an open file's name until it is closed
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(open(&path, &[]), Err(Error::Open { .. })));
    }

    #[cfg(not(feature = "remote"))]
    #[test]
    fn a_url_without_the_remote_feature_is_refused_by_name() {
        let url = Path::new("s3://bucket/model.safetensors");
        for err in [open(url, &[]).err(), place(url, &[]).err()] {
            let err = err.unwrap().to_string();
            assert!(err.contains("cargo feature `remote`"), "{err}");
        }
    }

    #[cfg(feature = "remote")]
    #[test]
    fn a_url_is_a_store_where_nothing_beside_is_looked_for() {
        let url = Path::new("s3://bucket/dir");
        assert!(!place(url, &[]).unwrap().may_look_beside());
    }
}
