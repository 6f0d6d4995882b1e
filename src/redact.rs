//! URLs as messages and logs may show them: without user info and without the values of the
//! query parameters that carry signatures, tokens, keys or credentials. Every error message goes
//! through it ([`crate::error::Error`]'s `Display`), and so do the paths the binding shows.

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
            // A message's punctuation after the URL (`...?token=t0k: 404`) is not the value's.
            Some((key, value)) if secret_key(key) => {
                let punct = &value[value.trim_end_matches([':', ',', ';', '.']).len()..];
                format!("{key}=REDACTED{punct}")
            }
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
}
