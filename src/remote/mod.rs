//! Objects in object storage (`s3://`, `gs://`, `az://`/`abfs://`, `http(s)://`) as something a
//! [`crate::source::Source`] reads from: ranged GETs through Apache Arrow's `object_store`.
//!
//! Here: which paths are URLs (always built, so a build without the `remote` feature can say so);
//! the stores and their runtime in `store` (AWS's shared profile files: `profile`), their HTTP client in `connector` (its proxies: `proxy`; its TLS: `tls`), one object's reads (retries, resumes) in `object`,
//! checkpoints named by URL (index.json, "directory" listings) in `listing`.

use std::path::Path;

#[cfg(feature = "remote")]
mod connector;
#[cfg(feature = "remote")]
mod listing;
#[cfg(feature = "remote")]
mod object;
#[cfg(feature = "remote")]
mod profile;
#[cfg(feature = "remote")]
mod proxy;
#[cfg(feature = "remote")]
mod store;
#[cfg(feature = "remote")]
mod tls;

#[cfg(feature = "remote")]
pub use listing::checkpoint_urls;
#[cfg(feature = "remote")]
pub use object::Object;

/// `storage_options`: (key, value) pairs, fsspec / obstore style, applied over the environment.
pub type Options = [(String, String)];

/// URL schemes read from object storage.
const SCHEMES: [&str; 10] = [
    "s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "http", "https", "hf",
];

/// Without the `remote` feature no URL names a checkpoint this build can read.
#[cfg(not(feature = "remote"))]
pub fn checkpoint_urls(url: &Path, _: &Options) -> crate::error::Result<Vec<std::path::PathBuf>> {
    Err(unavailable(url))
}

/// The error for a URL in a build without the `remote` feature.
#[cfg(not(feature = "remote"))]
pub fn unavailable(url: &Path) -> crate::error::Error {
    crate::error::Error::Remote(format!(
        "{}: this build of safeload reads no object storage (cargo feature `remote`)",
        url.display()
    ))
}

/// Whether `path` names an object by URL rather than a local file.
pub fn is_url(path: &Path) -> bool {
    path.to_str()
        .and_then(|s| s.split_once("://"))
        .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_paths() {
        for url in [
            "s3://b/k.safetensors",
            "gs://b/k",
            "az://c/k",
            "abfs://c/k",
            "https://h/x",
            "HTTP://h/x",
        ] {
            assert!(is_url(Path::new(url)), "{url}");
        }
        for path in [
            "model.safetensors",
            "/tmp/s3://x",
            "file:///tmp/x",
            "s3:/x",
            "./http",
        ] {
            assert!(!is_url(Path::new(path)), "{path}");
        }
    }
}
