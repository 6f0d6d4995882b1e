//! Checkpoints named by URL: a file, a `*.index.json` (fetched, its shards resolved next to it),
//! or a "directory" (a prefix listed for its index or its `*.safetensors`; not for http(s)).

use std::collections::BTreeSet;
use std::io;

use futures_util::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;

use super::object::{Object, to_io};
use super::{Options, store};

/// The shard URLs of the checkpoint at `url`, in a stable order (as a local path resolves).
pub fn checkpoint_urls(url: &str, options: &Options) -> io::Result<Vec<String>> {
    let url = url.trim_end_matches('/');
    if url.ends_with(".json") {
        return index_shards(url, &Object::fetch_all(url, options)?);
    }
    if url.ends_with(".safetensors") || url.starts_with("http://") || url.starts_with("https://") {
        return Ok(vec![url.to_string()]);
    }
    let (store, prefix) = store::locate(url, options)?;
    let names = store::runtime()
        .block_on(list(store.as_ref(), &prefix))
        .map_err(|e| to_io(url, e))?;
    let mut indexes = names
        .iter()
        .filter(|n| n.ends_with(".safetensors.index.json"));
    if let Some(index) = indexes.next() {
        return checkpoint_urls(&format!("{url}/{index}"), options);
    }
    let files: Vec<String> = names
        .iter()
        .filter(|n| n.ends_with(".safetensors"))
        .map(|n| format!("{url}/{n}"))
        .collect();
    if files.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("No .safetensors files in directory: {url}"),
        ));
    }
    Ok(files)
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

/// The shards an index names (its `weight_map` values), as URLs beside the index.
fn index_shards(url: &str, json: &[u8]) -> io::Result<Vec<String>> {
    let names = crate::shards::index_shards(url, json)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let base = url.rsplit_once('/').map_or(url, |(base, _)| base);
    Ok(names.into_iter().map(|s| format!("{base}/{s}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_shards_resolve_beside_the_index() {
        let json = br#"{"metadata": {}, "weight_map": {"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}}"#;
        let urls = index_shards("s3://b/dir/m.safetensors.index.json", json).unwrap();
        assert_eq!(
            urls,
            ["s3://b/dir/m-1.safetensors", "s3://b/dir/m-2.safetensors"]
        );
        let err = index_shards("s3://b/x.json", b"[]")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("weight_map") && err.contains("s3://b/x.json"),
            "{err}"
        );
    }
}
