//! Objects in object storage (`s3://`, `gs://`, `az://`/`abfs://`, `http(s)://`, `hf://`) as
//! something a [`crate::read::source::Source`] reads from: ranged GETs through Apache Arrow's
//! `object_store`.
//!
//! Here: what a URL's text says in `address` (always built, so a build without the `remote`
//! feature can say which paths are URLs), an object opened ([`open`]) and a store as a place to list ([`place`]) for
//! `storage::location` (which makes the object a `Backing`: nothing here names the modules
//! that use this one); retries and option values both the store and its client read in `config`; the stores and their runtime in `store` (AWS's shared profile files:
//! `profile`), their HTTP client in `connector` (its proxies: `proxy`; its TLS: `tls`), one
//! object's reads (retries, resumes) in `object`, a store as a [`Place`] (index.json, "directory"
//! listings, the Hub's tree) in `listing`, the SHA-256 a store reports of an object it opens
//! (the Hub's) in `reported`.

use std::path::Path;

mod address;
#[cfg(feature = "remote")]
mod config;
#[cfg(feature = "remote")]
mod connector;
#[cfg(feature = "remote")]
mod listing;
#[cfg(feature = "remote")]
pub(crate) mod object;
#[cfg(feature = "remote")]
mod profile;
#[cfg(feature = "remote")]
mod proxy;
#[cfg(feature = "remote")]
mod reported;
#[cfg(feature = "remote")]
pub(crate) mod store;
#[cfg(feature = "remote")]
mod tls;

pub use address::{Options, is_url};
#[cfg(feature = "remote")]
pub use object::Object;

use super::place::Place;
use crate::error::Result;
#[cfg(feature = "remote")]
use crate::platform::FsKind;

/// The error for a URL in a build without the `remote` feature.
#[cfg(not(feature = "remote"))]
pub fn unavailable(url: &Path) -> crate::error::Error {
    crate::error::Error::Remote(format!(
        "{}: this build of safeload reads no object storage (cargo feature `remote`)",
        url.display()
    ))
}

/// The object at `url`, opened with one ranged GET of its start (see [`Object::open`]), with
/// the store's kind and the bytes that GET brought (the object's start). Errors by
/// [`crate::error::Error::remote`].
#[cfg(feature = "remote")]
pub fn open(url: &Path, options: &Options) -> Result<(Object, FsKind, Vec<u8>)> {
    let text = url.to_string_lossy();
    let (object, start) =
        Object::open(&text, options).map_err(|e| crate::error::Error::remote(url, e))?;
    Ok((object, FsKind::Network(scheme_name(&text)), start))
}

/// The store `url` names, with the caller's options, as a place to list and read a
/// checkpoint's files.
#[cfg(feature = "remote")]
pub fn place<'a>(_url: &Path, options: &'a Options) -> Result<Box<dyn Place + 'a>> {
    Ok(Box::new(listing::Store::new(options)))
}

#[cfg(not(feature = "remote"))]
pub fn place<'a>(url: &Path, _: &'a Options) -> Result<Box<dyn Place + 'a>> {
    Err(unavailable(url))
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
