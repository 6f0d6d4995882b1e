//! Objects in object storage (`s3://`, `gs://`, `az://`/`abfs://`, `http(s)://`) as something a
//! [`crate::source::Source`] reads from: ranged GETs through Apache Arrow's `object_store`.
//!
//! Here: which paths are URLs (always built, so a build without the `remote` feature can say so);
//! the stores and their runtime in `store` (AWS's shared profile files: `profile`), their HTTP client in `connector`, one object's reads (retries, resumes) in `object`,
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
mod store;

#[cfg(feature = "remote")]
pub use listing::checkpoint_urls;
#[cfg(feature = "remote")]
pub use object::Object;

/// `storage_options`: (key, value) pairs, fsspec / obstore style, applied over the environment.
pub type Options = [(String, String)];

/// URL schemes read from object storage.
const SCHEMES: [&str; 9] = [
    "s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "http", "https",
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

/// `text` with every URL in it stripped of what would let a reader of a message or a log use it:
/// the user info (`user:password@` -> `***@`) and the values of query keys that carry
/// signatures, tokens, keys or credentials (S3 presigned URLs' `X-Amz-Signature`,
/// `X-Amz-Credential`, `X-Amz-Security-Token`; Azure SAS's `sig`; `token`, `access_token` ...).
pub fn redact(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("://") {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let is_scheme = |c: char| c.is_ascii_alphanumeric() || "+.-".contains(c);
        let start = rest[..at]
            .rfind(|c: char| !is_scheme(c))
            .map_or(0, |i| i + 1);
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || "\"'<>`()[]{}".contains(c))
            .map_or(rest.len(), |i| at + i);
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

fn redact_url(url: &str) -> String {
    let Some((scheme, after)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let (authority, tail) = after.split_at(authority_end);
    let host = match authority.rsplit_once('@') {
        Some((_, host)) => format!("***@{host}"),
        None => authority.to_string(),
    };
    let Some((path, query)) = tail.split_once('?') else {
        return format!("{scheme}://{host}{tail}");
    };
    let (query, fragment) = query
        .split_once('#')
        .map_or((query, None), |(q, f)| (q, Some(f)));
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if secret_key(key) => format!("{key}=REDACTED"),
            _ => pair.to_string(),
        })
        .collect();
    let fragment = fragment.map_or(String::new(), |f| format!("#{f}"));
    format!("{scheme}://{host}{path}?{}{fragment}", pairs.join("&"))
}

/// Query keys whose values are secrets.
fn secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "sig",
        "token",
        "credential",
        "secret",
        "password",
        "passwd",
        "key",
        "auth",
        "session",
    ]
    .iter()
    .any(|s| key.contains(s))
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
    fn secrets_never_reach_a_message() {
        let text = "GET https://user:hunter2@h.example/b/m.safetensors?X-Amz-Credential=AKIA1%2F2&\
                    X-Amz-Signature=f00d&X-Amz-Expires=60&sig=s4s&token=t0k&revision=main#frag \
                    failed: 403 (s3://b/x.safetensors)";
        let got = redact(text);
        for secret in ["hunter2", "AKIA1", "f00d", "s4s", "t0k", "user:"] {
            assert!(!got.contains(secret), "{secret} in {got}");
        }
        assert!(
            got.starts_with("GET https://***@h.example/b/m.safetensors?X-Amz-Credential=REDACTED&")
        );
        assert!(got.contains("X-Amz-Expires=60") && got.contains("revision=main#frag"));
        assert!(got.ends_with("failed: 403 (s3://b/x.safetensors)"), "{got}");
        assert_eq!(
            redact("no url here: /tmp/a.safetensors"),
            "no url here: /tmp/a.safetensors"
        );
        let e = crate::error::Error::Remote(format!("{text}: gone"));
        assert!(!e.to_string().contains("hunter2") && !e.to_string().contains("t0k"));
    }

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
