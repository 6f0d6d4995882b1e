//! Which files make a checkpoint: one file; a directory (its `*.safetensors.index.json`, else its
//! `*.safetensors`, in name order); or an index (the shards its `weight_map` names, beside it).
//! URLs resolve the same way in `remote::listing`, with the same index rule.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The shard files of the checkpoint at `path`, in a stable order; empty for a directory that
/// holds none.
pub fn shard_paths(path: &Path) -> Result<Vec<PathBuf>> {
    let open_err = |source| Error::Open {
        path: path.to_path_buf(),
        source,
    };
    if path.is_dir() {
        let mut names: Vec<String> = std::fs::read_dir(path)
            .map_err(open_err)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        names.sort();
        if let Some(index) = names
            .iter()
            .find(|n| n.ends_with(".safetensors.index.json"))
        {
            return shard_paths(&path.join(index));
        }
        let files = names.iter().filter(|n| n.ends_with(".safetensors"));
        return Ok(files.map(|n| path.join(n)).collect());
    }
    if path.extension().is_some_and(|e| e == "json") {
        let json = std::fs::read(path).map_err(open_err)?;
        let base = path.parent().unwrap_or(Path::new(""));
        let names = index_shards(&path.display().to_string(), &json)?;
        return Ok(names.into_iter().map(|n| base.join(n)).collect());
    }
    Ok(vec![path.to_path_buf()])
}

/// The shard names an index (`label`: where it came from, for the error) gives as its
/// `weight_map` values, sorted, each once.
pub fn index_shards(label: &str, json: &[u8]) -> Result<Vec<String>> {
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
            names(shard_paths(&dir).unwrap()),
            ["a.safetensors", "b.safetensors"]
        );
        let index = r#"{"metadata": {}, "weight_map": {"x": "s2.safetensors", "y": "s1.safetensors", "z": "s2.safetensors"}}"#;
        std::fs::write(dir.join("m.safetensors.index.json"), index).unwrap();
        let got = shard_paths(&dir).unwrap();
        assert_eq!(
            got,
            [dir.join("s1.safetensors"), dir.join("s2.safetensors")]
        );
        assert_eq!(
            shard_paths(&dir.join("m.safetensors.index.json")).unwrap(),
            got
        );
        std::fs::write(dir.join("bad.json"), b"[1, 2]").unwrap();
        let e = shard_paths(&dir.join("bad.json")).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("not a safetensors index (no 'weight_map' object)")
        );
        assert!(matches!(
            shard_paths(&dir.join("gone.json")),
            Err(Error::Open { .. })
        ));
        let file = dir.join("a.safetensors");
        assert_eq!(shard_paths(&file).unwrap(), std::slice::from_ref(&file));
        std::fs::remove_dir_all(&dir).unwrap();
        let empty =
            std::env::temp_dir().join(format!("safeload-shards-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        assert!(shard_paths(&empty).unwrap().is_empty());
        std::fs::remove_dir_all(&empty).unwrap();
    }
}
