//! Where a checkpoint's files are listed and read ([`Place`]): the local file system here
//! ([`Local`]), an object store in `remote::listing`. The checkpoint layer's rule (a file, a
//! directory, an index) asks a place; it never asks which kind it has.
//!
//! Also the one bounded read of a small file the caller names or an index gives
//! ([`read_bounded`], at most [`INDEX_BYTES`]): an index, a manifest.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where a checkpoint's files are listed and its index read.
pub trait Place {
    /// `at` as this place's other answers take it: as written on the file system; a prefix in a
    /// store without its trailing `/`.
    fn normal(&self, at: &Path) -> PathBuf {
        at.to_path_buf()
    }
    /// Whether `at` is a directory (a prefix to list) rather than one file.
    fn is_dir(&self, at: &Path) -> Result<bool>;
    /// The names directly in the directory `at`, sorted.
    fn names(&self, at: &Path) -> Result<Vec<String>>;
    /// Whether the file `at` is an index (`*.json`).
    fn is_index(&self, at: &Path) -> bool {
        at.to_string_lossy().ends_with(".json")
    }
    /// The whole of the index file `at` (at most [`INDEX_BYTES`]).
    fn read(&self, at: &Path) -> Result<Vec<u8>>;
    /// Why `name`, as an index or a listing of this place gives it, is not a file inside the
    /// folder it is joined to; None when it is. The file system takes names as they are written;
    /// a store also as its server decodes them (see `remote::listing`).
    fn refuse(&self, name: &str) -> Option<&'static str> {
        crate::format::names::outside(name)
    }
    /// `name` in the directory `dir`.
    fn join(&self, dir: &Path, name: &str) -> PathBuf;
    /// The directory that holds the file `at`.
    fn parent(&self, at: &Path) -> PathBuf;
    /// Whether a file the caller did not name (a `SHA256SUMS` beside the files) may be looked
    /// for and read here: locally yes; in a store no, it would be a request the caller did not
    /// point at (safeload requests only what it was pointed at, and what an index names).
    fn may_look_beside(&self) -> bool;
}

/// The most bytes of a small file read whole, local or remote (an index, a manifest, a Hub
/// listing): real ones are a few MiB (a weight_map of 100,000 names is ~10 MiB), and a file that
/// is not one (`/dev/zero`) is refused, not read until memory runs out.
pub const INDEX_BYTES: u64 = 64 << 20;

/// The whole of the local file `path`, when it has at most `limit` bytes; `too_large()` (the
/// caller's error, naming what the file should have been) when it has more. A FIFO, a device
/// or a directory is refused at open ([`crate::platform::open_regular`]); failing to open or
/// read it is an [`Error::Open`].
pub fn read_bounded(path: &Path, limit: u64, too_large: impl FnOnce() -> Error) -> Result<Vec<u8>> {
    let open_err = |source| Error::Open {
        path: path.to_path_buf(),
        source,
    };
    let file = crate::platform::open_regular(path).map_err(open_err)?;
    let mut bytes = Vec::new();
    (file.take(limit + 1))
        .read_to_end(&mut bytes)
        .map_err(open_err)?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The local file system.
pub struct Local;

impl Place for Local {
    fn is_dir(&self, at: &Path) -> Result<bool> {
        Ok(at.is_dir())
    }

    fn names(&self, at: &Path) -> Result<Vec<String>> {
        let open_err = |source| Error::Open {
            path: at.to_path_buf(),
            source,
        };
        let mut names: Vec<String> = std::fs::read_dir(at)
            .map_err(open_err)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        names.sort();
        Ok(names)
    }

    fn read(&self, at: &Path) -> Result<Vec<u8>> {
        read_bounded(at, INDEX_BYTES, || {
            Error::Checkpoint(format!(
                "{}: larger than {} MiB, not a safetensors index",
                at.display(),
                INDEX_BYTES >> 20
            ))
        })
    }

    fn join(&self, dir: &Path, name: &str) -> PathBuf {
        dir.join(name)
    }

    fn parent(&self, at: &Path) -> PathBuf {
        at.parent().unwrap_or(Path::new("")).to_path_buf()
    }

    fn may_look_beside(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_files_are_read_whole_up_to_the_limit_and_refused_past_it() {
        let path = std::env::temp_dir().join(format!("safeload-bounded-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let too_large = || Error::Verify("too large".into());
        assert_eq!(read_bounded(&path, 10, too_large).unwrap(), b"0123456789");
        let err = read_bounded(&path, 9, too_large).unwrap_err();
        assert_eq!(err.to_string(), "too large");
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            read_bounded(&path, 9, too_large),
            Err(Error::Open { .. })
        ));
        assert!(Local.may_look_beside());
    }
}
