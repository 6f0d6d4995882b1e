//! Digests for Python: whole files hashed with the parallel reader (`safeload hash`), digests
//! and `sha256sum` manifests read and written by the core's one parser and writer
//! (`crate::format::digest`), a checkpoint's shard files (what `hash` expands a directory to), and
//! where each pinned shard's digest came from (`pinned()` of a checkpoint and of a handle).

use std::ffi::OsString;
use std::path::PathBuf;

use pyo3::prelude::*;

use super::args::{BackendArg, options};
use super::errors::detached;
use super::remote::StorageOptions;
use crate::error::Error;
use crate::format::digest::{self, Digest};

/// The SHA-256 of each file (hex, in order), every byte read once with the parallel reader in
/// rounds of at most `max_bytes` into one buffer, several files side by side.
#[pyfunction]
#[pyo3(signature = (paths, *, max_bytes, backend=None, threads=None, chunk_bytes=None, storage_options=None))]
pub(super) fn hash_files(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    max_bytes: u64,
    backend: Option<BackendArg>,
    threads: Option<usize>,
    chunk_bytes: Option<usize>,
    storage_options: Option<StorageOptions>,
) -> PyResult<Vec<String>> {
    let backend = BackendArg::or_default(backend)?;
    let opts = options(threads, chunk_bytes, false);
    let store = storage_options.unwrap_or_default().0;
    let digests = detached(py, |poll| {
        crate::read::source::hash_files(&paths, backend, &opts, &store, max_bytes, poll)
            .map(|(d, _)| d)
    })?;
    Ok(digests.iter().map(Digest::to_string).collect())
}

/// The entries of the manifest at `path` (`sha256sum`'s format): `(name, hex digest)` in order,
/// names as written (relative to the manifest's folder unless absolute).
#[pyfunction]
pub(super) fn read_manifest(py: Python<'_>, path: PathBuf) -> PyResult<Vec<(String, String)>> {
    let text = py
        .detach(|| std::fs::read(&path))
        .map_err(|source| Error::Open {
            path: path.clone(),
            source,
        })?;
    let entries = digest::parse_manifest(&text).map_err(|error| Error::Manifest { path, error })?;
    Ok(entries
        .into_iter()
        .map(|e| (e.name, e.digest.to_string()))
        .collect())
}

/// The line `sha256sum` writes for `name` with `digest` (names with `\`, LF or CR escaped as it
/// escapes them), without the newline.
#[pyfunction]
pub(super) fn manifest_line(digest: &str, name: &str) -> PyResult<String> {
    Ok(digest::manifest_line(&parse(digest)?, name))
}

/// `digest` (`sha256:<64 hex>` or 64 hex digits, either case) as 64 lowercase hex digits; a
/// `SafetensorError` saying what was expected otherwise.
#[pyfunction]
pub(super) fn parse_digest(digest: &str) -> PyResult<String> {
    Ok(parse(digest)?.to_string())
}

fn parse(digest: &str) -> Result<Digest, Error> {
    digest.parse().map_err(Error::Argument)
}

/// The SHA-256 the source itself knows for the file at `path` (as `verify=True` finds it: the
/// Hugging Face cache's blob name, the Hub's reported digest, a `SHA256SUMS` beside it), as
/// `(hex digest, where it came from)`; None when none is known (`safeload verify` without a
/// manifest or a digest).
#[pyfunction]
#[pyo3(signature = (path, *, storage_options=None))]
pub(super) fn known_digest(
    py: Python<'_>,
    path: PathBuf,
    storage_options: Option<StorageOptions>,
) -> PyResult<Option<(String, String)>> {
    let store = storage_options.unwrap_or_default().0;
    let known = detached(py, |_| {
        let source = crate::read::source::Source::open_with(&path, &store)?;
        let reported = (source.reported_digest())
            .map(|(digest, from)| crate::checkpoint::verify::Expected { digest, from });
        let lenient = crate::checkpoint::verify::Pin::Known { strict: false };
        crate::checkpoint::verify::expectations(
            &lenient,
            None,
            std::slice::from_ref(&path),
            &[reported],
            &store,
        )
    })?;
    Ok((known.into_iter().next().flatten()).map(|e| (e.digest.to_string(), e.from)))
}

/// The shard files of the checkpoint at `at` (a file, a directory, an index.json, a URL or a
/// prefix), in order, as `Checkpoint(at)` opens them, each with its name in a manifest: relative
/// to the checkpoint's root (`checkpoint::files::root_of`: the directory, the index's folder, the
/// prefix), `at` itself for one file. Strings (a URL is not a path: a `pathlib.Path` would fold
/// its `//`).
#[pyfunction]
#[pyo3(signature = (at, *, storage_options=None))]
pub(super) fn checkpoint_files(
    py: Python<'_>,
    at: PathBuf,
    storage_options: Option<StorageOptions>,
) -> PyResult<Vec<(OsString, OsString)>> {
    let store = storage_options.unwrap_or_default().0;
    let files = detached(py, |_| crate::checkpoint::files::at(&at, &store))?;
    let root = crate::checkpoint::files::root_of(&at, &files);
    let named = |file: PathBuf| {
        let name = (root.as_deref())
            .and_then(|r| file.strip_prefix(r).ok())
            .map_or_else(
                || file.clone().into_os_string(),
                |n| n.as_os_str().to_owned(),
            );
        (file.into_os_string(), name)
    };
    Ok(files.into_iter().map(named).collect())
}

/// Each shard of a pinned checkpoint with where its digest came from (None: loaded
/// unverified), as `pinned()` of a checkpoint and of a handle give it to the log.
pub(super) fn pinned(
    ckpt: &crate::checkpoint::Checkpoint,
) -> Vec<(std::path::PathBuf, Option<String>)> {
    (ckpt.pinned().into_iter())
        .map(|(path, from)| (crate::redact::shown(path), from))
        .collect()
}
