//! What each file of a checkpoint must hash to (`verify=`), worked out once at open, before any
//! tensor is read: digests the caller pinned (a mapping, a `sha256sum` manifest) or the ones the
//! source itself knows (the Hugging Face cache's blob names, a `SHA256SUMS` beside the files where
//! their place lets a file the caller did not name be read: locally, never in a store).
//! The read hashes what it reads ([`crate::format::digest`]); [`Expected::check`] compares.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::digest::{Digest, parse_manifest};
use crate::storage::{self, place::INDEX_BYTES, remote::Options};

/// What verification did so far: files whose digest matched and their bytes, files the verified
/// record vouched for (unchanged since they last matched: not hashed), files loaded unverified
/// (no digest known, under a lenient [`Pin::Known`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verified {
    pub files: usize,
    pub bytes: u64,
    pub recorded: usize,
    pub unverified: usize,
}

/// What the caller asked to check the files against.
#[derive(Debug, Clone)]
pub enum Pin {
    /// `{name: digest}`: `name` relative to the checkpoint's root, or the bare file name of a
    /// single file; every file of the checkpoint must be in it.
    Mapping(Vec<(String, String)>),
    /// A manifest as `sha256sum` writes it; names relative to the checkpoint's root.
    Manifest(PathBuf),
    /// The digests the source knows; `strict`: a file with none is an error, else it loads
    /// unverified (counted).
    Known { strict: bool },
}

impl Pin {
    /// What `SAFELOAD_VERIFY` asks of code that passes no `verify=`: unset, empty or `0`: nothing;
    /// `1`: the digests the source knows, files with none loading unverified (counted, logged);
    /// `strict`: the same, a file with none an error. Anything else is an error naming it.
    pub fn from_env() -> Result<Option<Pin>> {
        Self::from_setting(std::env::var("SAFELOAD_VERIFY").ok().as_deref())
    }

    fn from_setting(value: Option<&str>) -> Result<Option<Pin>> {
        match value.map(str::trim) {
            None | Some("" | "0") => Ok(None),
            Some("1") => Ok(Some(Pin::Known { strict: false })),
            Some("strict") => Ok(Some(Pin::Known { strict: true })),
            Some(other) => Err(Error::Argument(format!(
                "SAFELOAD_VERIFY={other:?}: expected 1 (verify where a digest is known), strict \
                 (every file must have one) or 0"
            ))),
        }
    }
}

/// A file's expected digest and where the expectation came from, for messages and stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub digest: Digest,
    pub from: String,
}

impl Expected {
    /// `Ok` when `actual` is the digest expected of `path`; else the error naming the file, both
    /// digests and where the expectation came from.
    pub fn check(&self, path: &Path, actual: &Digest) -> Result<()> {
        if *actual == self.digest {
            return Ok(());
        }
        Err(Error::Verify(format!(
            "{}: SHA-256 mismatch: expected {} ({}), read {}",
            path.display(),
            self.digest,
            self.from,
            actual
        )))
    }
}

/// The expected digest of each of `shards` (None: none known, under a lenient [`Pin::Known`]),
/// in their order. `root`: the folder names are relative to (the directory or the index's folder
/// the caller named); None for a file or a list of files, whose names are their bare file names.
/// `reported`: per shard, the digest its store reports (the Hub's), for [`Pin::Known`]. `store`:
/// the stores' `storage_options` the shards were opened with.
pub fn expectations(
    pin: &Pin,
    root: Option<&Path>,
    shards: &[PathBuf],
    reported: &[Option<Expected>],
    store: &Options,
) -> Result<Vec<Option<Expected>>> {
    let names: Vec<String> = shards.iter().map(|s| name_in(root, s)).collect();
    match pin {
        Pin::Mapping(pairs) => {
            let table = pairs
                .iter()
                .map(|(name, text)| {
                    let digest = text.parse::<Digest>().map_err(|why| {
                        Error::Argument(format!("verify: the digest of {name:?}: {why}"))
                    })?;
                    Ok((normal(name), digest))
                })
                .collect::<Result<Vec<_>>>()?;
            pinned(&names, shards, &table, "the mapping", "verify=")
        }
        Pin::Manifest(path) => {
            let table = read_manifest(path)?;
            let from = format!("the manifest {}", path.display());
            pinned(&names, shards, &table, &from, &from)
        }
        Pin::Known { strict } => {
            let mut sums = Sums {
                store,
                read: Vec::new(),
            };
            (shards.iter().zip(&names).zip(reported))
                .map(|((shard, name), reported)| {
                    let known = match (cache_blob(shard), reported) {
                        (Some(blob), _) => Some(blob),
                        (None, Some(reported)) => Some(reported.clone()),
                        (None, None) => sums.lookup(root, shard, name)?,
                    };
                    match known {
                        None if *strict => Err(Error::Verify(format!(
                            "{}: no SHA-256 is known for this file (not a Hugging Face cache blob, \
                             none reported by its store, no {SUMS} beside it): pin one with \
                             verify={{name: digest}} or a manifest",
                            shard.display()
                        ))),
                        known => Ok(known),
                    }
                })
                .collect()
        }
    }
}

/// A manifest's lines: (name, digest).
type Table = Vec<(String, Digest)>;

/// The `SHA256SUMS` files read so far (None: there is none), by path: the root's, else each
/// file's own folder's; `store`: the options the shards' places are reached with.
struct Sums<'a> {
    store: &'a Options,
    read: Vec<(PathBuf, Option<Table>)>,
}

impl Sums<'_> {
    /// `shard`'s digest in the `SHA256SUMS` of its root (or its own folder without one), by
    /// `name`; None when there is no such file or it has no line for the shard, and where the
    /// shard's place may not be looked in beyond what the caller named (a store: nothing is
    /// requested that the caller did not point at).
    fn lookup(
        &mut self,
        root: Option<&Path>,
        shard: &Path,
        name: &str,
    ) -> Result<Option<Expected>> {
        if !storage::place(shard, self.store)?.may_look_beside() {
            return Ok(None);
        }
        let Some(folder) = root.or_else(|| shard.parent()) else {
            return Ok(None);
        };
        let sums = folder.join(SUMS);
        if !self.read.iter().any(|(f, _)| *f == sums) {
            let table = sums.is_file().then(|| read_manifest(&sums)).transpose()?;
            self.read.push((sums.clone(), table));
        }
        let (_, table) = self
            .read
            .iter()
            .find(|(f, _)| *f == sums)
            .expect("read above");
        Ok(table
            .as_ref()
            .and_then(|t| lookup(t, name))
            .map(|digest| Expected {
                digest,
                from: format!("{}", sums.display()),
            }))
    }
}

/// The file `sha256sum *.safetensors > SHA256SUMS` writes beside a checkpoint's files.
pub const SUMS: &str = "SHA256SUMS";

/// `shard`'s name relative to `root` with `/` separators; its bare file name without a root.
fn name_in(root: Option<&Path>, shard: &Path) -> String {
    let relative = root.and_then(|r| shard.strip_prefix(r).ok());
    let name = match relative {
        Some(rel) => rel.to_string_lossy().replace('\\', "/"),
        None => shard
            .file_name()
            .map_or_else(|| shard.to_string_lossy(), |n| n.to_string_lossy())
            .into_owned(),
    };
    normal(&name)
}

/// A name as the table keys it: without a leading `./` (what `sha256sum ./x` writes).
fn normal(name: &str) -> String {
    name.trim_start_matches("./").to_string()
}

fn lookup(table: &[(String, Digest)], name: &str) -> Option<Digest> {
    table.iter().find(|(n, _)| n == name).map(|(_, d)| *d)
}

/// Every shard's digest from `table`; a shard missing from it is an error (`what` names the
/// table in it): the caller pinned the checkpoint, not some of it.
fn pinned(
    names: &[String],
    shards: &[PathBuf],
    table: &[(String, Digest)],
    from: &str,
    what: &str,
) -> Result<Vec<Option<Expected>>> {
    (names.iter().zip(shards))
        .map(|(name, shard)| match lookup(table, name) {
            Some(digest) => Ok(Some(Expected {
                digest,
                from: from.to_string(),
            })),
            None => Err(Error::Verify(format!(
                "{}: {what} has no digest for {name:?} (every file of the checkpoint must be \
                 pinned)",
                shard.display()
            ))),
        })
        .collect()
}

/// A `sha256sum` manifest as (name, digest) pairs; a line not in its format is an error naming
/// the manifest and the line.
fn read_manifest(path: &Path) -> Result<Table> {
    let text = storage::place::read_bounded(path, INDEX_BYTES, || {
        Error::Verify(format!(
            "{}: larger than {} MiB, not a manifest",
            path.display(),
            INDEX_BYTES >> 20
        ))
    })?;
    let entries = parse_manifest(&text).map_err(|error| Error::Manifest {
        path: path.to_path_buf(),
        error,
    })?;
    Ok(entries
        .into_iter()
        .map(|e| (normal(&e.name), e.digest))
        .collect())
}

/// The digest a Hugging Face cache file's name gives: `snapshots/<rev>/<file>` links to
/// `blobs/<sha256>` for a file stored with LFS or Xet (a small git file's blob name is a 40-digit
/// git id, not a SHA-256: none).
fn cache_blob(shard: &Path) -> Option<Expected> {
    let target = std::fs::read_link(shard).ok()?;
    let blob = target.file_name()?.to_str()?;
    let in_blobs = target.parent()?.file_name()? == "blobs";
    if !in_blobs || blob.len() != 64 {
        return None;
    }
    let digest = blob.parse::<Digest>().ok()?;
    Some(Expected {
        digest,
        from: "the Hugging Face cache's blob name".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("safeload-verify-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn mappings_and_manifests_pin_every_file_by_its_name_in_the_root() {
        let dir = temp("pin");
        let shards = [dir.join("a.safetensors"), dir.join("sub/b.safetensors")];
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let mapping = Pin::Mapping(vec![
            ("a.safetensors".into(), format!("sha256:{a}")),
            (
                "./sub/b.safetensors".into(),
                format!("{}", b).to_uppercase(),
            ),
            ("config.json".into(), format!("{a}")),
        ]);
        let got = expectations(&mapping, Some(&dir), &shards, &[None, None], &[]).unwrap();
        assert_eq!(got[0].as_ref().unwrap().digest, a);
        assert_eq!(got[1].as_ref().unwrap().digest, b);
        assert_eq!(got[0].as_ref().unwrap().from, "the mapping");
        // A single file: its bare name.
        let one = expectations(&mapping, None, &shards[..1], &[None], &[]).unwrap();
        assert_eq!(one[0].as_ref().unwrap().digest, a);
        let missing = Pin::Mapping(vec![("a.safetensors".into(), format!("{a}"))]);
        let err = expectations(&missing, Some(&dir), &shards, &[None, None], &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("has no digest for \"sub/b.safetensors\""),
            "{err}"
        );
        let bad = Pin::Mapping(vec![("a.safetensors".into(), "sha256:12".into())]);
        let err = expectations(&bad, Some(&dir), &shards, &[None, None], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("64 hex digits"), "{err}");
        let manifest = dir.join("sums.txt");
        std::fs::write(
            &manifest,
            format!("{a}  a.safetensors\n{b} *sub/b.safetensors\n"),
        )
        .unwrap();
        let got = expectations(
            &Pin::Manifest(manifest.clone()),
            Some(&dir),
            &shards,
            &[None, None],
            &[],
        )
        .unwrap();
        assert_eq!(got[1].as_ref().unwrap().digest, b);
        assert!(got[1].as_ref().unwrap().from.contains("sums.txt"));
        std::fs::write(&manifest, "not a manifest\n").unwrap();
        let err = expectations(
            &Pin::Manifest(manifest),
            Some(&dir),
            &shards,
            &[None, None],
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        let e = Expected {
            digest: a,
            from: "the mapping".into(),
        };
        e.check(&shards[0], &a).unwrap();
        let err = e.check(&shards[0], &b).unwrap_err().to_string();
        assert!(
            err.contains(&format!("expected {a} (the mapping), read {b}")),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_environment_asks_for_known_digests_leniently_or_strictly() {
        assert!(Pin::from_setting(None).unwrap().is_none());
        assert!(Pin::from_setting(Some("0")).unwrap().is_none());
        assert!(matches!(
            Pin::from_setting(Some("1")).unwrap(),
            Some(Pin::Known { strict: false })
        ));
        assert!(matches!(
            Pin::from_setting(Some("strict")).unwrap(),
            Some(Pin::Known { strict: true })
        ));
        let err = Pin::from_setting(Some("yes")).unwrap_err().to_string();
        assert!(err.contains("SAFELOAD_VERIFY=\"yes\""), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn known_digests_come_from_cache_blob_names_and_sha256sums() {
        let dir = temp("known");
        let a = Digest::of(b"a");
        std::fs::create_dir_all(dir.join("blobs")).unwrap();
        std::fs::create_dir_all(dir.join("snap")).unwrap();
        std::fs::write(dir.join("blobs").join(a.to_string()), b"a").unwrap();
        let linked = dir.join("snap/a.safetensors");
        std::os::unix::fs::symlink(format!("../blobs/{a}"), &linked).unwrap();
        let plain = dir.join("snap/b.safetensors");
        std::fs::write(&plain, b"b").unwrap();
        let root = dir.join("snap");
        let shards = [linked, plain];
        let strict = Pin::Known { strict: true };
        let err = expectations(&strict, Some(&root), &shards, &[None, None], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("b.safetensors: no SHA-256 is known"), "{err}");
        let lenient = expectations(
            &Pin::Known { strict: false },
            Some(&root),
            &shards,
            &[None, None],
            &[],
        )
        .unwrap();
        assert_eq!(lenient[0].as_ref().unwrap().digest, a);
        assert!(lenient[0].as_ref().unwrap().from.contains("blob name"));
        assert!(lenient[1].is_none());
        let b = Digest::of(b"b");
        std::fs::write(root.join(SUMS), format!("{b}  b.safetensors\n")).unwrap();
        let got = expectations(&strict, Some(&root), &shards, &[None, None], &[]).unwrap();
        assert_eq!(got[1].as_ref().unwrap().digest, b);
        assert!(got[1].as_ref().unwrap().from.ends_with(SUMS));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
