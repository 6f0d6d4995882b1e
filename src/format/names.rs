//! The names a checkpoint's index or listing gives its files: the one rule of what may be joined
//! to the folder they are relative to (used where local files and a store's objects are named).

/// Why `name` (a shard an index or a listing gives) is not a relative path inside the folder it
/// is joined to; None when it is. The rule transformers applies to an index's names, and more:
/// no absolute path, no `..` part, no empty part (`//`, a leading or trailing `/`), no `:` (a URL
/// scheme, a Windows drive or stream), no backslash (a separator on Windows and to URL parsers),
/// no control character (NUL, a line break). Symlinks are not resolved: a Hub cache's
/// `snapshots/<rev>/x` links into `blobs/`, and a folder's own links are the folder's choice.
pub fn outside(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("an empty name")
    } else if name.starts_with('/') {
        Some("an absolute path")
    } else if name.contains(':') {
        Some("a ':' (a URL scheme, a drive or a stream)")
    } else if name.contains('\\') {
        Some("a backslash")
    } else if name.chars().any(char::is_control) {
        Some("a control character")
    } else if name.split('/').any(|part| part == "..") {
        Some("a '..' part")
    } else if name.split('/').any(str::is_empty) {
        Some("an empty part ('//' or a trailing '/')")
    } else {
        None
    }
}
