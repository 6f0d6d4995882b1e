//! URLs as messages and logs may show them: without user info and without the values of the
//! query parameters that carry signatures, tokens, keys or credentials. Every error message goes
//! through it ([`crate::error::Error`]'s `Display`), and so do the paths the binding shows. It
//! cleans strings and uses nothing of the crate: it sits beneath every layer, beside `error`.
//!
//! What is hidden never depends on the character after a secret: a URL runs from its scheme to
//! the next whitespace (brackets and quotes may be part of user info and query values), and a
//! secret runs to its own end (the user info's last `@`, the value's `&` or `#`), so a `(` or a
//! `'` in a password cannot end the URL early and leave the rest of it printed.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::ops::Range;

/// `text` with every URL in it stripped of what would let a reader of a message or a log use it:
/// the user info (`user:password@` -> `***@`) and the values of query keys that carry
/// signatures, tokens, keys or credentials (S3 presigned URLs' `X-Amz-Signature`,
/// `X-Amz-Credential`, `X-Amz-Security-Token`; Azure SAS's `sig`; `token`, `access_token` ...).
pub fn redact(text: &str) -> Cow<'_, str> {
    if !text.contains("://") {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let is_scheme = |c: char| c.is_ascii_alphanumeric() || "+.-".contains(c);
        let start = rest[..at]
            .rfind(|c: char| !is_scheme(c))
            .map_or(0, |i| i + 1);
        let end = rest[at..]
            .find(char::is_whitespace)
            .map_or(rest.len(), |i| at + i);
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// Characters that end a sentence or close a bracket or a quote: at the very end of a URL they
/// are the message's (`...?token=t0k: 404`, `('...?sig=s1g')`), not the last value's.
const CLOSERS: [char; 11] = ['.', ',', ';', ':', ')', ']', '}', '"', '\'', '`', '>'];

/// A part of a URL that is not shown, and what is shown in its place.
struct Hidden {
    range: Range<usize>,
    with: &'static str,
}

/// `url` (scheme to whitespace) with its secrets replaced: those of every URL that starts in it
/// (`?next=https://user:pw@...`, `'https://a','https://b'` written without a space).
fn redact_url(url: &str) -> String {
    let mut hidden = Vec::new();
    for (at, _) in url.match_indices("://") {
        secrets(url, at + 3, &mut hidden);
    }
    hidden.sort_by_key(|h| (h.range.start, Reverse(h.range.end)));
    hidden.dedup_by_key(|h| h.range.clone());
    let mut out = String::with_capacity(url.len());
    let mut shown = 0;
    for h in hidden {
        if h.range.start < shown {
            shown = shown.max(h.range.end); // overlaps what is already hidden: hidden with it
            continue;
        }
        out.push_str(&url[shown..h.range.start]);
        out.push_str(h.with);
        shown = h.range.end;
    }
    out.push_str(&url[shown..]);
    out
}

/// The secrets of the URL whose authority starts at `authority` (just past its `://`). User
/// info is everything before the last `@` ahead of the first `/`, even where a `?` or `#` (not
/// allowed there unescaped) comes before that `@`; the query is then read both ways, from the
/// authority and from past the user info, so neither reading of such a URL shows a secret
/// (`https://h?token=a@S3CR3T` is a host `h` and a token `a@S3CR3T`, or a host `S3CR3T`).
fn secrets(url: &str, authority: usize, hidden: &mut Vec<Hidden>) {
    let rest = &url[authority..];
    let before_path = rest.find('/').unwrap_or(rest.len());
    query_secrets(url, authority, hidden);
    if let Some(at) = rest[..before_path].rfind('@') {
        hidden.push(Hidden {
            range: authority..authority + at,
            with: "***",
        });
        query_secrets(url, authority + at + 1, hidden);
    }
}

/// The values of the secret keys in the query and the fragment (OAuth's implicit grant puts
/// `#access_token=` there) of the URL whose host starts at `host`: each runs to the next `&` or
/// `#` or the URL's end (less the [`CLOSERS`] there).
fn query_secrets(url: &str, host: usize, hidden: &mut Vec<Hidden>) {
    let Some(mark) = url[host..].find(['?', '#']) else {
        return;
    };
    let mut pair_start = host + mark + 1;
    for pair in url[pair_start..].split(['&', '#']) {
        if let Some((key, value)) = pair.split_once('=')
            && secret_key(key)
        {
            let start = pair_start + key.len() + 1;
            let mut end = start + value.len();
            if end == url.len() {
                end = start + value.trim_end_matches(CLOSERS).len();
            }
            hidden.push(Hidden {
                range: start..end,
                with: "REDACTED",
            });
        }
        pair_start += pair.len() + 1;
    }
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

/// A path or URL as messages and logs show it: a URL without its secrets ([`redact`]); a path
/// has none, and is shown as it is.
pub fn shown(path: &std::path::Path) -> std::path::PathBuf {
    match path.to_str() {
        Some(text) => redact(text).into_owned().into(),
        None => path.to_path_buf(),
    }
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
        assert_eq!(
            redact("http://h/m?token=t0k: 404 Not Found; https://h/n?sig=s1g."),
            "http://h/m?token=REDACTED: 404 Not Found; https://h/n?sig=REDACTED."
        );
        let e = crate::error::Error::Remote(format!("{text}: gone"));
        assert!(!e.to_string().contains("hunter2") && !e.to_string().contains("t0k"));
    }

    /// Every delimiter RFC 3986 allows in user info or a query value, before and after a secret,
    /// in each shape a message gives a URL.
    #[test]
    fn no_character_next_to_a_secret_lets_it_through() {
        const SECRET: &str = "S3CR3T";
        // Sub-delims, `:`, `@`, percent-escapes; `?` and `#` (not allowed unescaped in user
        // info, but read as its part when an `@` follows them before the path).
        let in_user_info = "!$&'()*+,;=:@?# %28 %29 %40 %3F %2F";
        // Sub-delims (less `&`, which ends a value), `:`, `@`, `/`, `?`, percent-escapes.
        let in_query = "!$'()*+,;=:@/? %28 %29 %26 %3D %23";
        let mut urls = Vec::new();
        for group in in_user_info.split(' ') {
            for d in delimiters(group) {
                urls.push(format!(
                    "https://ALICE:{d}{SECRET}{d}@host.example/models/m.safetensors?revision=main"
                ));
            }
        }
        for group in in_query.split(' ') {
            for d in delimiters(group) {
                urls.push(format!(
                    "https://host.example/models/m.safetensors?revision=main&token={d}{SECRET}{d}\
                     &X-Amz-Expires=60"
                ));
                urls.push(format!(
                    "https://host.example/models/m.safetensors?revision=main&sig={d}{SECRET}{d}"
                ));
            }
        }
        urls.push(format!(
            "https://host.example/models/m.safetensors?revision=main&token={SECRET}&&sig={SECRET}&"
        ));
        let shapes: [(&str, &str); 9] = [
            ("", ""),
            ("failed (", ")"),
            ("failed (", "): 404"),
            ("\"", "\""),
            ("'", "'"),
            ("<", ">"),
            ("could not read ", "."),
            ("GET ", ": 404 Not Found"),
            ("[Errno 2] No such file or directory: '", "'"),
        ];
        for url in &urls {
            for (before, after) in shapes {
                let text = format!("{before}{url}{after}");
                let got = redact(&text);
                for leak in (0..=SECRET.len() - 3)
                    .map(|i| &SECRET[i..i + 3])
                    .chain(["ALICE"])
                {
                    assert!(!got.contains(leak), "{leak} of {text} in {got}");
                }
                assert!(
                    got.starts_with(before) && got.ends_with(after),
                    "{text} -> {got}"
                );
                for shown in [
                    "https://",
                    "host.example/models/m.safetensors?",
                    "revision=main",
                ] {
                    assert!(got.contains(shown), "{shown} of {text} not in {got}");
                }
                if url.contains("X-Amz-Expires") {
                    assert!(got.contains("&X-Amz-Expires=60"), "{text} -> {got}");
                }
            }
        }
    }

    /// The single characters of `group` (`!$&`), or `group` itself when it is an escape (`%28`).
    fn delimiters(group: &str) -> Vec<String> {
        if group.starts_with('%') {
            return vec![group.to_string()];
        }
        group.chars().map(String::from).collect()
    }

    #[test]
    fn each_secret_is_hidden_whole() {
        for (text, want) in [
            // A bracket or a quote inside a secret (found leaking through FileNotFoundError).
            ("https://user:se(cret@host/x", "https://***@host/x"),
            ("https://h/x?token=abc(def", "https://h/x?token=REDACTED"),
            ("https://u:p'w@h/x", "https://***@h/x"),
            ("(https://h/x?token=abc)", "(https://h/x?token=REDACTED)"),
            (
                "'https://h/x?token=a(b)c'.",
                "'https://h/x?token=REDACTED'.",
            ),
            // `?` or `#` in user info: everything before the last `@` ahead of the path.
            ("https://u:p#w@h/x", "https://***@h/x"),
            ("https://u:p?w@h", "https://***@h"),
            // No path, an `@` in a token: a host `h` and a token, or a host after user info.
            ("https://h?token=a@b", "https://***"),
            // A URL inside another, and one beside it without a space.
            (
                "https://h/x?next=https://u:pw@h2/y?sig=s1g&a=1",
                "https://h/x?next=https://***@h2/y?sig=REDACTED&a=1",
            ),
            (
                "['https://a/x', 'https://u:pw@b/y']",
                "['https://a/x', 'https://***@b/y']",
            ),
            // A token in a fragment (OAuth's implicit grant).
            (
                "https://h/cb#access_token=t0k&expires_in=60",
                "https://h/cb#access_token=REDACTED&expires_in=60",
            ),
        ] {
            assert_eq!(redact(text), want, "{text}");
        }
        let glued = redact("['https://a/x?token=t0k','https://u:pw@b/y']");
        assert!(!glued.contains("t0k") && !glued.contains("pw"), "{glued}");
    }
}
