//! Which files make a checkpoint, by one rule for paths and URLs alike: a file is itself; a
//! directory (or a URL prefix) is its `*.safetensors.index.json` when it holds one, else its
//! `*.safetensors` in name order; an index is the shards its `weight_map` names, beside it.
//! Where the names come from is a [`Place`]: the file system here, an object store in
//! `remote::listing`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where a checkpoint's files are listed and its index read.
pub trait Place {
    /// Whether `at` is a directory (a prefix to list) rather than one file.
    fn is_dir(&self, at: &Path) -> Result<bool>;
    /// The names directly in the directory `at`, sorted.
    fn names(&self, at: &Path) -> Result<Vec<String>>;
    /// Whether the file `at` is an index (`*.json`).
    fn is_index(&self, at: &Path) -> bool {
        at.to_string_lossy().ends_with(".json")
    }
    /// The whole of the index file `at`.
    fn read(&self, at: &Path) -> Result<Vec<u8>>;
    /// `name` in the directory `dir`.
    fn join(&self, dir: &Path, name: &str) -> PathBuf;
    /// The directory that holds the file `at`.
    fn parent(&self, at: &Path) -> PathBuf;
}

/// The shard files of the checkpoint at `at` in `place`, in a stable order; a directory that
/// holds none is an error.
pub fn resolve(place: &impl Place, at: &Path) -> Result<Vec<PathBuf>> {
    if place.is_dir(at)? {
        let names = place.names(at)?;
        if let Some(index) = names
            .iter()
            .find(|n| n.ends_with(".safetensors.index.json"))
        {
            return resolve(place, &place.join(at, index));
        }
        let files: Vec<PathBuf> = (names.iter())
            .filter(|n| n.ends_with(".safetensors"))
            .map(|n| place.join(at, n))
            .collect();
        if files.is_empty() {
            return Err(Error::NoShards(at.to_path_buf()));
        }
        return Ok(files);
    }
    if place.is_index(at) {
        let json = place.read(at)?;
        let base = place.parent(at);
        let names = index_shards(&at.display().to_string(), &json)?;
        return Ok(names.into_iter().map(|n| place.join(&base, &n)).collect());
    }
    Ok(vec![at.to_path_buf()])
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
        std::fs::read(at).map_err(|source| Error::Open {
            path: at.to_path_buf(),
            source,
        })
    }

    fn join(&self, dir: &Path, name: &str) -> PathBuf {
        dir.join(name)
    }

    fn parent(&self, at: &Path) -> PathBuf {
        at.parent().unwrap_or(Path::new("")).to_path_buf()
    }
}

/// The shard names an index (`label`: where it came from, for the error) gives as its
/// `weight_map` values, sorted, each once.
fn index_shards(label: &str, json: &[u8]) -> Result<Vec<String>> {
    let invalid = || {
        Error::Checkpoint(format!(
            "{label}: not a safetensors index (no 'weight_map' object)"
        ))
    };
    let index: serde_json::Value = serde_json::from_slice(json).map_err(|_| invalid())?;
    let map = (index.get("weight_map"))
        .and_then(|m| m.as_object())
        .ok_or_else(invalid)?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    Ok(shards.into_iter().map(String::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_directories_and_indexes() {
        let dir = std::env::temp_dir().join(format!("safeload-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in ["b.safetensors", "a.safetensors", "notes.txt"] {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        let names = |v: Vec<PathBuf>| -> Vec<String> {
            v.iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(resolve(&Local, &dir).unwrap()),
            ["a.safetensors", "b.safetensors"]
        );
        let index = r#"{"metadata": {}, "weight_map": {"x": "s2.safetensors", "y": "s1.safetensors", "z": "s2.safetensors"}}"#;
        std::fs::write(dir.join("m.safetensors.index.json"), index).unwrap();
        let got = resolve(&Local, &dir).unwrap();
        assert_eq!(
            got,
            [dir.join("s1.safetensors"), dir.join("s2.safetensors")]
        );
        assert_eq!(
            resolve(&Local, &dir.join("m.safetensors.index.json")).unwrap(),
            got
        );
        std::fs::write(dir.join("bad.json"), b"[1, 2]").unwrap();
        let e = resolve(&Local, &dir.join("bad.json")).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("not a safetensors index (no 'weight_map' object)")
        );
        assert!(matches!(
            resolve(&Local, &dir.join("gone.json")),
            Err(Error::Open { .. })
        ));
        let file = dir.join("a.safetensors");
        assert_eq!(resolve(&Local, &file).unwrap(), std::slice::from_ref(&file));
        std::fs::remove_dir_all(&dir).unwrap();
        let empty =
            std::env::temp_dir().join(format!("safeload-shards-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let e = resolve(&Local, &empty).unwrap_err();
        assert!(matches!(&e, Error::NoShards(p) if p == &empty), "{e}");
        assert_eq!(e.io_kind(), Some(std::io::ErrorKind::NotFound));
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
