//! Sources that are objects in a store (`crate::storage::remote`): opened with one ranged GET of the
//! object's start (a second when the header is longer), read by the engine's workers with ranged
//! GETs; the read settings they get by default; the SHA-256 the store reported at open.

use std::path::Path;

#[cfg(feature = "remote")]
use super::Backing;
use super::Source;
#[cfg(feature = "remote")]
use crate::error::Error;
use crate::error::Result;
use crate::format::digest::Digest;
#[cfg(feature = "remote")]
use crate::format::header;
#[cfg(feature = "remote")]
use crate::platform::FsKind;

impl Source {
    #[cfg(feature = "remote")]
    pub(super) fn open_remote(
        path: &Path,
        options: &crate::storage::remote::Options,
    ) -> Result<Source> {
        let url = path.to_string_lossy();
        let remote_err = |e| Error::remote(path, e);
        let (object, mut bytes) =
            crate::storage::remote::Object::open(&url, options).map_err(remote_err)?;
        let size = object.size();
        let header_err = |reason| Error::header(Some(path), reason);
        let json_len =
            header::header_len(&bytes[..bytes.len().min(8)], size).map_err(header_err)?;
        let header_end = 8 + json_len as usize;
        if bytes.len() < header_end {
            let have = bytes.len();
            bytes.resize(header_end, 0);
            let got = object
                .read_fully_at(&mut bytes[have..], have as u64)
                .map_err(remote_err)?;
            if have + got < header_end {
                return Err(header_err(header::HeaderError::InvalidHeaderLength));
            }
        }
        // The opening GET may have brought some of the data too: the source keeps the prefix
        // and header alone (what a digest of the object starts with).
        bytes.truncate(header_end);
        bytes.shrink_to_fit();
        let kind = FsKind::Network(scheme_name(&url));
        Source::new(path, kind, Backing::Remote(object), size, bytes)
    }

    #[cfg(not(feature = "remote"))]
    pub(super) fn open_remote(path: &Path, _: &crate::storage::remote::Options) -> Result<Source> {
        Err(crate::storage::remote::unavailable(path))
    }

    /// The SHA-256 the file's store reported when it was opened, and which of its headers said
    /// it (`hf://` and Hub `resolve` URLs: the Hub's `X-Linked-Etag` of an LFS or Xet file);
    /// taken from the opening request's answer, never asked for again. None for a local file,
    /// for stores that report none, and for a Hub file kept in git (its ETag is a git blob id).
    pub fn reported_digest(&self) -> Option<(Digest, String)> {
        #[cfg(feature = "remote")]
        if let Backing::Remote(object) = &self.backing {
            return (object.reported_digest()).map(|r| (r.digest, r.from.to_string()));
        }
        None
    }
}

/// The storage name a URL's objects report (`f.stats.storage`).
#[cfg(feature = "remote")]
fn scheme_name(url: &str) -> &'static str {
    match url.split_once("://").map(|(s, _)| s.to_ascii_lowercase()) {
        Some(s) if s.starts_with("s3") => "s3",
        Some(s) if s == "gs" => "gcs",
        Some(s) if s.starts_with("http") => "http",
        Some(s) if s == "hf" => "hf",
        _ => "azure",
    }
}
