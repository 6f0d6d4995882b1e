//! A location (a path or a URL) told apart once, here: where a checkpoint's files are listed and
//! read ([`place`]). Nothing above the storage layer asks whether a location is a URL: it asks
//! what this returns.

use std::path::Path;

use super::place::{Local, Place};
use super::remote::{self, Options};
use crate::error::Result;

/// Where the checkpoint at `at` (a path, or a URL or URL prefix) has its files listed and its
/// index read: the file system, or the store the URL names, reached with `options`.
pub fn place<'a>(at: &Path, options: &'a Options) -> Result<Box<dyn Place + 'a>> {
    if remote::is_url(at) {
        return remote::place(at, options);
    }
    Ok(Box::new(Local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_the_file_system_where_files_beside_may_be_read() {
        assert!(
            place(Path::new("model.safetensors"), &[])
                .unwrap()
                .may_look_beside()
        );
    }

    #[cfg(not(feature = "remote"))]
    #[test]
    fn a_url_without_the_remote_feature_is_refused_by_name() {
        let url = Path::new("s3://bucket/model.safetensors");
        let err = place(url, &[]).err().unwrap().to_string();
        assert!(err.contains("cargo feature `remote`"), "{err}");
    }

    #[cfg(feature = "remote")]
    #[test]
    fn a_url_is_a_store_where_nothing_beside_is_looked_for() {
        let url = Path::new("s3://bucket/dir");
        assert!(!place(url, &[]).unwrap().may_look_beside());
    }
}
