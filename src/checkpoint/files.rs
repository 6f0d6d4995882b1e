//! Which files make a checkpoint, by one rule for paths and URLs alike: a file is itself; a
//! directory (or a URL prefix) is its `*.safetensors.index.json` when it holds one, else its
//! `*.safetensors` in name order; an index is the shards its `weight_map` names, beside it.
//! Where the names come from and the index is read is a [`Place`] (the storage layer's: the
//! file system, an object store); this rule never asks which kind it has.
//!
//! A checkpoint is untrusted input: the names its index or a listing gives are checked by one
//! rule ([`crate::format::names::outside`], or a store's stricter form) before anything they name is opened or requested, so a published index
//! cannot take a load out of its folder, to another file, host or repository. What the caller
//! passed (a path, a URL, a list of shards) is the caller's choice and is not confined.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::storage::place::Place;

/// The shard files of the checkpoint at `at` in `place`, in a stable order; a directory that
/// holds none is an error.
pub fn resolve(place: &dyn Place, at: &Path) -> Result<Vec<PathBuf>> {
    resolve_normal(place, &place.normal(at))
}

/// [`resolve`] of `at` as `place` takes it ([`Place::normal`]).
fn resolve_normal(place: &dyn Place, at: &Path) -> Result<Vec<PathBuf>> {
    if place.is_dir(at)? {
        let names = place.names(at)?;
        if let Some((name, why)) = names.iter().find_map(|n| Some((n, place.refuse(n)?))) {
            return Err(Error::Checkpoint(format!(
                "{}: the listing names {name:?}, which is not a file in it ({why})",
                at.display()
            )));
        }
        if let Some(index) = names
            .iter()
            .find(|n| n.ends_with(".safetensors.index.json"))
        {
            return resolve_normal(place, &place.join(at, index));
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
        let names = index_shards(&at.display().to_string(), &json, |n| place.refuse(n))?;
        return Ok(names.into_iter().map(|n| place.join(&base, &n)).collect());
    }
    Ok(vec![at.to_path_buf()])
}

/// The shard names an index (`label`: where it came from, for the error) gives as its
/// `weight_map` values, sorted, each once; every one a file name `refuse` lets through.
fn index_shards(
    label: &str,
    json: &[u8],
    refuse: impl Fn(&str) -> Option<&'static str>,
) -> Result<Vec<String>> {
    let invalid = || {
        Error::Checkpoint(format!(
            "{label}: not a safetensors index (no 'weight_map' object)"
        ))
    };
    let index: serde_json::Value = serde_json::from_slice(json).map_err(|_| invalid())?;
    let map = (index.get("weight_map"))
        .and_then(|m| m.as_object())
        .ok_or_else(invalid)?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let refused = |why: &str| {
            Error::Checkpoint(format!(
                "{label}: weight_map entry {tensor:?} names {file}, which is not a file in the \
                 index's folder ({why})"
            ))
        };
        let file = file.as_str().ok_or_else(|| refused("not a string"))?;
        if let Some(why) = refuse(file) {
            return Err(refused(why));
        }
        shards.insert(file);
    }
    Ok(shards.into_iter().map(String::from).collect())
}

/// The folder the names of the checkpoint at `at` are relative to (`verify=`'s mapping and
/// manifest keys), given the `files` it resolved to ([`at`]): a directory
/// or prefix itself, an index's folder; None for one file.
pub fn root_of(at: &Path, files: &[PathBuf]) -> Option<PathBuf> {
    let text = at.to_string_lossy();
    if text.ends_with(".json") {
        return at.parent().map(Path::to_path_buf);
    }
    let single = files.len() == 1 && files[0] == at;
    (!single).then(|| PathBuf::from(text.trim_end_matches('/')))
}

/// The shard files (paths or URLs, in order) of the checkpoint at `at`: a file, a
/// directory, an index.json, a URL or a URL prefix, by [`resolve`]'s rule, asked of the place
/// storage picks for it.
pub fn at(at: &Path, store: &crate::storage::remote::Options) -> Result<Vec<PathBuf>> {
    resolve(&*crate::storage::place(at, store)?, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::place::Local;

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

    #[test]
    fn an_index_or_a_listing_names_only_files_inside_its_folder() {
        let root = std::env::temp_dir().join(format!("safeload-confine-{}", std::process::id()));
        let dir = root.join("ckpt");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(root.join("outside.safetensors"), b"").unwrap();
        let index = |name: &str| {
            let json = serde_json::json!({"weight_map": {"a": "sub/in.safetensors", "b": name}});
            std::fs::write(dir.join("model.safetensors.index.json"), json.to_string()).unwrap();
        };
        index("in.safetensors");
        assert_eq!(
            resolve(&Local, &dir).unwrap(),
            [dir.join("in.safetensors"), dir.join("sub/in.safetensors")]
        );
        let outside_file = root.join("outside.safetensors");
        for (name, why) in [
            ("../outside.safetensors", "a '..' part"),
            ("sub/../../outside.safetensors", "a '..' part"),
            // `C:\...` on Windows: its drive's ':' is what is refused first.
            (
                outside_file.to_str().unwrap(),
                if cfg!(windows) {
                    "a ':'"
                } else {
                    "an absolute path"
                },
            ),
            ("/etc/passwd", "an absolute path"),
            ("http://127.0.0.1:1/x.safetensors", "a ':'"),
            ("C:\\x.safetensors", "a ':'"),
            ("..\\outside.safetensors", "a backslash"),
            ("sub//in.safetensors", "an empty part"),
            ("in.safetensors\n", "a control character"),
            ("in\0.safetensors", "a control character"),
            ("", "an empty name"),
        ] {
            index(name);
            let err = resolve(&Local, &dir).unwrap_err().to_string();
            assert!(
                err.contains("model.safetensors.index.json")
                    && err.contains("weight_map entry \"b\"")
                    && err.contains(why),
                "{name:?}: {err}"
            );
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": 7}}"#,
        )
        .unwrap();
        let err = resolve(&Local, &dir).unwrap_err().to_string();
        assert!(
            err.contains("entry \"a\" names 7") && err.contains("not a string"),
            "{err}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn special_files_are_refused_at_open_not_waited_on() {
        let dir = std::env::temp_dir().join(format!("safeload-special-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("model.safetensors.index.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // A FIFO with no writer: an open that waited would never return.
        let err = resolve(&Local, &dir).unwrap_err().to_string();
        assert!(err.contains("not a regular file: a FIFO"), "{err}");
        let err = resolve(&Local, &fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file: a FIFO"), "{err}");
        // An index that is /dev/zero (through a link): refused, not read until memory runs out.
        let zero = dir.join("zero.safetensors.index.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let err = resolve(&Local, &zero).unwrap_err().to_string();
        assert!(
            err.contains("not a regular file: a character device"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
