//! A store as a [`Place`] where a checkpoint's files are listed and read: its "directories" are
//! prefixes (listed; not for http(s), which cannot list; the Hub's through its API), its index is
//! fetched whole (at most [`INDEX_BYTES`]), the names its listings and indexes give are checked
//! as its server will read them, and nothing the caller did not point at is requested.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use futures_util::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;

use super::address::{Options, url_outside};
use super::object::{self, Object, to_io};
use super::store;
use crate::error::{Error, Result};
use crate::storage::place::{INDEX_BYTES, Place};

/// An object store, reached with the caller's options.
pub struct Store<'a> {
    options: &'a Options,
}

impl<'a> Store<'a> {
    pub fn new(options: &'a Options) -> Self {
        Store { options }
    }
}

impl Place for Store<'_> {
    /// A prefix named with a trailing `/` is the prefix without it.
    fn normal(&self, at: &Path) -> PathBuf {
        PathBuf::from(at.to_string_lossy().trim_end_matches('/'))
    }

    fn is_dir(&self, at: &Path) -> Result<bool> {
        let url = path_part(at);
        let http = url.starts_with("http://") || url.starts_with("https://");
        Ok(!(http || url.ends_with(".safetensors") || self.is_index(at)))
    }

    fn names(&self, at: &Path) -> Result<Vec<String>> {
        let url = at.to_string_lossy();
        if let Some(hub) = store::Hub::parse(&url).map_err(|e| Error::remote(at, e))? {
            // The Hub lists through its API, not through resolve URLs.
            let (api, location) =
                store::locate_as(&hub.tree_url(), hub.authorization(), self.options)
                    .map_err(|e| Error::remote(at, e))?;
            let json = Object::fetch_located(api.as_ref(), &location, &url, INDEX_BYTES)
                .map_err(|e| Error::remote(at, e))?;
            return hub_names(&json, &hub.path).map_err(|e| Error::remote(at, e));
        }
        let (store, prefix) =
            store::locate(&url, self.options).map_err(|e| Error::remote(at, e))?;
        let listed = async {
            list(store.as_ref(), &prefix)
                .await
                .map_err(|e| to_io(&url, e))
        };
        object::wait(None, listed).map_err(|e| Error::remote(at, e))
    }

    fn is_index(&self, at: &Path) -> bool {
        path_part(at).ends_with(".json")
    }

    /// A name is checked as the server will read it too: percent-decoded.
    fn refuse(&self, name: &str) -> Option<&'static str> {
        url_outside(name)
    }

    fn read(&self, at: &Path) -> Result<Vec<u8>> {
        Object::fetch_all(&at.to_string_lossy(), self.options, INDEX_BYTES)
            .map_err(|e| Error::remote(at, e))
    }

    /// `name` in `dir`, with `dir`'s query (a SAS or `?token=` grant for the folder goes with
    /// every file in it).
    fn join(&self, dir: &Path, name: &str) -> PathBuf {
        let (path, query) = split_query(dir);
        PathBuf::from(format!("{path}/{name}{query}"))
    }

    /// The folder of `at`, with `at`'s query.
    fn parent(&self, at: &Path) -> PathBuf {
        let (path, query) = split_query(at);
        let base = path.rsplit_once('/').map_or(&*path, |(base, _)| base);
        PathBuf::from(format!("{base}{query}"))
    }

    /// Never: a `SHA256SUMS` beside the objects would be a request the caller did not point at.
    fn may_look_beside(&self) -> bool {
        false
    }
}

/// A URL's path and its query string (with its `?`; empty where there is none): the query names
/// no file (a signature, a token).
fn split_query(at: &Path) -> (String, String) {
    let url = at.to_string_lossy();
    match url.split_once('?') {
        Some((path, query)) => (path.to_string(), format!("?{query}")),
        None => (url.into_owned(), String::new()),
    }
}

fn path_part(at: &Path) -> String {
    split_query(at).0
}

/// The Hub API's most entries in one page of a folder's listing (it pages beyond them).
const HUB_PAGE: usize = 1000;

/// The names of the files directly in `folder`, sorted, from the Hub API's tree listing of it.
fn hub_names(json: &[u8], folder: &str) -> std::io::Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Entry {
        #[serde(rename = "type")]
        kind: String,
        path: String,
    }
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let entries: Vec<Entry> = serde_json::from_slice(json).map_err(|e| {
        bad(format!(
            "the Hub's listing of the folder is not a tree ({e})"
        ))
    })?;
    if entries.len() >= HUB_PAGE {
        return Err(bad(format!(
            "the folder has {HUB_PAGE} or more entries (more than one page of the Hub's \
             listing): name its index.json or its files"
        )));
    }
    let prefix = match folder {
        "" => String::new(),
        folder => format!("{folder}/"),
    };
    let mut names: Vec<String> = (entries.into_iter())
        .filter(|e| e.kind == "file")
        .filter_map(|e| {
            let name = e.path.strip_prefix(&prefix)?;
            (!name.is_empty() && !name.contains('/')).then(|| name.to_string())
        })
        .collect();
    names.sort();
    Ok(names)
}

/// Names directly under `prefix`, sorted.
async fn list(store: &dyn ObjectStore, prefix: &ObjectPath) -> object_store::Result<Vec<String>> {
    let listed: Vec<_> = store.list(Some(prefix)).try_collect().await?;
    let names: BTreeSet<String> = listed
        .into_iter()
        .filter_map(|meta| {
            let rest = meta.location.prefix_match(prefix)?.collect::<Vec<_>>();
            match rest.as_slice() {
                [name] => Some(name.as_ref().to_string()),
                _ => None,
            }
        })
        .collect();
    Ok(names.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_join_with_slashes_on_every_platform() {
        let store = Store::new(&[]);
        let dir = Path::new("s3://b/dir");
        assert_eq!(store.normal(Path::new("s3://b/dir/")), dir);
        assert!(!store.may_look_beside());
        assert_eq!(
            store.join(dir, "m-1.safetensors"),
            PathBuf::from("s3://b/dir/m-1.safetensors")
        );
        let index = Path::new("s3://b/dir/m.safetensors.index.json");
        assert_eq!(store.parent(index), PathBuf::from("s3://b/dir"));
        assert!(store.is_dir(dir).unwrap());
        assert!(!store.is_dir(index).unwrap());
        assert!(!store.is_dir(Path::new("https://h/models")).unwrap());
        // A query names no file: an index with a token is an index, its shards beside it,
        // reached with the same token.
        let signed = Path::new("https://h/m/model.safetensors.index.json?token=t");
        assert!(store.is_index(signed));
        assert_eq!(store.parent(signed), PathBuf::from("https://h/m?token=t"));
        assert_eq!(
            store.join(&store.parent(signed), "m-1.safetensors"),
            PathBuf::from("https://h/m/m-1.safetensors?token=t")
        );
        assert!(
            !store
                .is_dir(Path::new("s3://b/m.safetensors?versionId=3"))
                .unwrap()
        );
    }

    #[test]
    fn hub_listings_give_the_files_directly_in_the_folder() {
        let json = br#"[{"type":"file","oid":"1","size":3,"path":"unet/config.json"},
            {"type":"file","path":"unet/diffusion_pytorch_model.safetensors","size":9},
            {"type":"directory","path":"unet/sub"},
            {"type":"file","path":"unetx/other.safetensors"}]"#;
        let names = hub_names(json, "unet").unwrap();
        assert_eq!(
            names,
            ["config.json", "diffusion_pytorch_model.safetensors"]
        );
        let root =
            br#"[{"type":"file","path":"model.safetensors"},{"type":"directory","path":"unet"}]"#;
        assert_eq!(hub_names(root, "").unwrap(), ["model.safetensors"]);
        assert!(hub_names(b"{\"error\": \"nope\"}", "").is_err());
        let page = format!(
            "[{}]",
            vec![r#"{"type":"file","path":"a"}"#; HUB_PAGE].join(",")
        );
        let err = hub_names(page.as_bytes(), "").unwrap_err().to_string();
        assert!(err.contains("name its index.json"), "{err}");
    }
}
