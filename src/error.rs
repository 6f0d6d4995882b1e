//! The one error type of the core. Messages keep safetensors 0.8's wording for the same mistake
//! and add the file, the tensor and the offset where 0.8 leaves them out.
//! The Python binding turns it into exceptions in exactly one place (`py::errors`).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::format::header::HeaderError;

#[derive(Debug)]
pub enum Error {
    /// The file could not be opened (missing, no permission, ...).
    Open { path: PathBuf, source: io::Error },
    /// Reading bytes failed or came up short.
    Read {
        path: PathBuf,
        tensor: String,
        offset: u64,
        source: io::Error,
    },
    /// Writing a file failed; nothing was left at the destination.
    Write { path: PathBuf, source: io::Error },
    /// The header breaks a rule of the format.
    Header {
        path: Option<PathBuf>,
        reason: HeaderError,
    },
    /// `get_tensor` / `get_slice` of a name the file does not have.
    TensorNotFound { name: String },
    /// A slice that cannot be taken; the message is complete (0.8's wording).
    Slice(String),
    /// An index out of range (or more indices than dimensions) under torch's bounds
    /// (`crate::format::slice::Bounds::Clamp`): a `SafetensorError` that is also an `IndexError`, as
    /// torch indexing raises. The message is complete (0.8's wording).
    SliceIndex(String),
    /// An accelerator load's staging ring that cannot be set up as asked; the message is
    /// complete.
    Staging(String),
    /// Input to a writer that the format cannot hold.
    Serialize(String),
    /// Memory handed over to read into that cannot take the tensor (size, dtype, overlap,
    /// device); the message is complete.
    Destination(String),
    /// Shards that do not make one checkpoint (a tensor in more than one of them); the message
    /// is complete.
    Checkpoint(String),
    /// A directory (or a URL prefix) named as a checkpoint holds no `.safetensors` file and no
    /// index (FileNotFoundError, as a missing file).
    NoShards(PathBuf),
    /// A prefetch plan, or a request of a prefetch loader, that cannot be served; the message
    /// is complete (safetensors 0.9's wording).
    Prefetch(String),
    /// A load into new memory that would not fit what the process may still take (see
    /// `crate::read::memory`); the message is complete. Raised before anything is read.
    Memory(String),
    /// A handle, checkpoint or loader used after it was closed; names what was closed.
    Closed(&'static str),
    /// An argument the reader cannot take (a backend, a dtype name, a count); the message is
    /// complete.
    Argument(String),
    /// An object in a store could not be opened or listed (a bad endpoint, a store that ignores
    /// `Range`, an unknown storage option ...): the message names the URL and what the store said.
    Remote(String),
    /// The file is shorter now than when it was opened (rewritten under an open handle): what
    /// it held past its new end cannot be read, nor handed out as a view of its map.
    Shrank {
        path: PathBuf,
        tensor: String,
        len: u64,
        was: u64,
    },
    /// A file's SHA-256 asked for when the reads since it was started did not cover every byte
    /// in file order: bytes `from..to` (of `len`) were not hashed.
    Unhashed {
        path: PathBuf,
        from: u64,
        to: u64,
        len: u64,
    },
    /// A file whose bytes are not the ones pinned (`verify=`), or with no digest to check
    /// against; the message names the file, the digests and where the expectation came from.
    Verify(String),
    /// A manifest of digests (`sha256sum`'s format) with a line that is not one.
    Manifest {
        path: PathBuf,
        error: crate::format::digest::ManifestError,
    },
    /// The reader itself failed (a panic caught at a thread or binding boundary); the message
    /// names what failed.
    Internal(String),
    /// The caller asked to stop (Ctrl-C) while reading.
    Cancelled,
}

pub type Result<T> = std::result::Result<T, Error>;

/// Runs `f`, turning a panic in it (a bug of the reader, on this thread or one it joined) into
/// [`Error::Internal`] naming `what` and the panic's message: a load fails, the process and its
/// other loads go on, and Python gets a `SafetensorError`, not a `PanicException` (a
/// `BaseException` that `except Exception` lets through).
pub fn catch_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = (panic.downcast_ref::<&str>().copied())
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic without a message");
        Err(Error::Internal(format!("{what}: {message}")))
    })
}

impl Error {
    pub fn header(path: Option<&Path>, reason: HeaderError) -> Self {
        Error::Header {
            path: path.map(Path::to_path_buf),
            reason,
        }
    }

    /// An object in a store that cannot be read: a missing one or refused access as
    /// [`Error::Open`] (FileNotFoundError, PermissionError), anything else as [`Error::Remote`].
    pub fn remote(url: &Path, source: io::Error) -> Self {
        match source.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied => Error::Open {
                path: url.to_path_buf(),
                source,
            },
            _ => Error::Remote(source.to_string()),
        }
    }

    /// The OS error behind this one, for mapping to `FileNotFoundError`/`PermissionError`.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Error::Open { source, .. } | Error::Write { source, .. } => Some(source.kind()),
            Error::NoShards(_) => Some(io::ErrorKind::NotFound),
            _ => None,
        }
    }
}

/// Every message names URLs without their secrets (user info, signature and token query values:
/// `crate::redact::redact`), whichever part of it carries them: a path, a store's own error.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let message = Unredacted(self).to_string();
        f.write_str(&crate::redact::redact(&message))
    }
}

/// The message as the parts say it.
struct Unredacted<'a>(&'a Error);

impl fmt::Display for Unredacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Error::Open { path, source } if source.kind() == io::ErrorKind::NotFound => {
                write!(f, "No such file or directory: {}", path.display())
            }
            Error::Open { path, source } => {
                write!(f, "Could not open {}: {source}", path.display())
            }
            Error::Read {
                path,
                tensor,
                offset,
                source,
            } => write!(
                f,
                "pread failed for tensor {tensor}: {source} (file {}, offset {offset})",
                path.display()
            ),
            Error::Write { path, source } => {
                write!(
                    f,
                    "Error while serializing: I/O error: {source} (file {})",
                    path.display()
                )
            }
            Error::Header { path, reason } => {
                write!(f, "Error while deserializing header: {reason}")?;
                if let Some(path) = path {
                    write!(f, " (file {})", path.display())?;
                }
                Ok(())
            }
            Error::TensorNotFound { name } => write!(f, "File does not contain tensor {name}"),
            Error::NoShards(path) => {
                write!(f, "No .safetensors files in directory: {}", path.display())
            }
            Error::Slice(message)
            | Error::SliceIndex(message)
            | Error::Staging(message)
            | Error::Serialize(message)
            | Error::Destination(message)
            | Error::Checkpoint(message)
            | Error::Prefetch(message)
            | Error::Memory(message)
            | Error::Argument(message)
            | Error::Remote(message)
            | Error::Verify(message) => f.write_str(message),
            Error::Shrank {
                path,
                tensor,
                len,
                was,
            } => write!(
                f,
                "file {} shrank to {len} bytes while open (it had {was}): tensor {tensor} cannot \
                 be read",
                path.display()
            ),
            Error::Unhashed {
                path,
                from,
                to,
                len,
            } => write!(
                f,
                "the SHA-256 of {} is not known: bytes {from}..{to} of its {len} were not read in \
                 file order (a digest covers every byte of the file)",
                path.display()
            ),
            Error::Manifest { path, error } => {
                write!(f, "manifest {}, {error}", path.display())
            }
            Error::Internal(message) => write!(f, "internal error in safeload: {message}"),
            Error::Closed(what) => write!(f, "{what} is closed"),
            Error::Cancelled => f.write_str("load cancelled"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Open { source, .. }
            | Error::Read { source, .. }
            | Error::Write { source, .. } => Some(source),
            Error::Header { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_naming_what_failed() {
        let err = catch_panic::<()>("a worker", || panic!("bad index {}", 7)).unwrap_err();
        assert!(
            matches!(&err, Error::Internal(m) if m == "a worker: bad index 7"),
            "{err}"
        );
        let err = catch_panic::<()>("a read", || panic!("static")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "internal error in safeload: a read: static"
        );
        assert_eq!(catch_panic("fine", || Ok(3)).unwrap(), 3);
    }
}
