//! What a URL's text says, for every module here and for `storage::location`: whether a path is
//! a URL, a name that would leave its folder once a server decodes it, percent coding, and the
//! `storage_options` type. Always built (a build without `remote` still says what is a URL);
//! a leaf: it uses nothing of its neighbours.

use std::path::Path;

/// `storage_options`: (key, value) pairs, fsspec / obstore style, applied over the environment.
pub type Options = [(String, String)];

/// URL schemes read from object storage.
const SCHEMES: [&str; 10] = [
    "s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "http", "https", "hf",
];

/// Why `name` (a file an index or a listing in a store gives, or the path of an `hf://` URL) is
/// not a relative path inside its folder: [`crate::format::names::outside`] of the name as written and
/// as the server reads it, percent-decoded (`%2e%2e` is `..` to a server, to the `url` crate
/// too; decoded until nothing changes, so `%252e` is caught as well); a `?` or `#` as written
/// would end the path and change the query the folder's grant goes with.
pub fn url_outside(name: &str) -> Option<&'static str> {
    if name.contains(['?', '#']) {
        return Some("a '?' or '#' (a query or a fragment, not a file name)");
    }
    let mut form = std::borrow::Cow::Borrowed(name);
    for _ in 0..4 {
        if let Some(why) = crate::format::names::outside(&form) {
            return Some(why);
        }
        match percent_decoded(&form) {
            Some(decoded) => form = std::borrow::Cow::Owned(decoded),
            None => return None,
        }
    }
    Some("percent-encoded more than three times")
}

/// `text` with each `%XX` decoded (invalid UTF-8 replaced); None when it has none.
pub(crate) fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let pair =
            (bytes.get(i + 1).copied().and_then(hex)).zip(bytes.get(i + 2).copied().and_then(hex));
        match (bytes[i], pair) {
            (b'%', Some((hi, lo))) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    (out != bytes).then(|| String::from_utf8_lossy(&out).into_owned())
}

/// `text` percent-encoded for a URL path: every byte but ASCII letters, digits, `-._~` (and
/// `/` where `slash` keeps it), as huggingface_hub quotes a file path (`safe="/"`) and a
/// revision (`safe=""`).
pub fn percent_encoded(text: &str, slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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

    #[test]
    fn names_in_a_store_are_checked_as_written_and_as_decoded() {
        for ok in [
            "model-00001-of-00002.safetensors",
            "sub/dir/x.safetensors",
            "a%20b.safetensors",
            "100%.safetensors",
            "..x.safetensors",
        ] {
            assert_eq!(url_outside(ok), None, "{ok}");
        }
        for (bad, why) in [
            ("../secret.safetensors", "'..'"),
            ("%2e%2e/secret.safetensors", "'..'"),
            ("%2E%2E%2Fsecret.safetensors", "'..'"),
            ("%252e%252e/secret.safetensors", "'..'"),
            ("a/%2e%2e/%2e%2e/b.safetensors", "'..'"),
            ("..%5csecret.safetensors", "backslash"),
            ("..\\secret.safetensors", "backslash"),
            ("/etc/passwd", "absolute"),
            ("%2fetc/passwd", "absolute"),
            ("https://evil.example/x.safetensors", "':'"),
            ("C:x.safetensors", "':'"),
            ("a//b.safetensors", "empty part"),
            ("a%00.safetensors", "control"),
            ("a%0a.safetensors", "control"),
            ("x.safetensors?token=t", "'?'"),
            ("x.safetensors#f", "'?'"),
            ("", "empty name"),
        ] {
            let got = url_outside(bad).unwrap_or_else(|| panic!("{bad} let through"));
            assert!(got.contains(why), "{bad}: {got}");
        }
        assert_eq!(percent_encoded("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(percent_encoded("a b/c%.s", true), "a%20b/c%25.s");
    }
}
