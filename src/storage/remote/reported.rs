//! The SHA-256 a store reports of an object, taken from the answer to the request that opens it
//! (no request of its own). Today one store reports one: the Hugging Face Hub, for a file of a
//! repository (`hf://`, or its `resolve` URL), in the headers huggingface_hub's
//! `get_hf_file_metadata` reads: `X-Linked-Etag` (an LFS or Xet file: its SHA-256), else `ETag`
//! (a small file kept in git: its git blob id, 40 hex digits, which is no SHA-256).
//!
//! The Hub says it on its own answer, a redirect to its storage for a large file; the data, and
//! the headers `object_store` keeps, come from where the redirect ends. So the connector, which
//! follows redirects, hands the Hub's headers to [`note_hub_answer`], and the open that wants
//! them runs its request inside [`from_hub`]: a task-local scoped to that one request, so
//! concurrent opens sharing a store (and its client) never see each other's answers.

use std::cell::Cell;

use http::HeaderMap;

use crate::format::digest::Digest;

/// A SHA-256 a store reported, and which header said it (for messages: "expected ... (the Hub's
/// X-Linked-Etag)").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportedDigest {
    pub digest: Digest,
    pub from: &'static str,
}

tokio::task_local! {
    /// What the Hub's answer to the request running in [`from_hub`] reported.
    static HUB_ANSWER: Cell<Option<ReportedDigest>>;
}

/// Runs `request` (one request to the Hub), noting what the Hub's own answer reports of the file.
pub async fn from_hub<F: Future>(request: F) -> (F::Output, Option<ReportedDigest>) {
    HUB_ANSWER
        .scope(Cell::new(None), async {
            let output = request.await;
            (output, HUB_ANSWER.with(Cell::get))
        })
        .await
}

/// Called by the connector with the headers of each answer (a success or a redirect) from the
/// host a request was sent to, before any redirect leaves it: the last one is the Hub's answer
/// (huggingface_hub follows the Hub's redirects to itself, and reads the one that leaves it).
/// Does nothing outside [`from_hub`].
pub fn note_hub_answer(headers: &HeaderMap) {
    let _ = HUB_ANSWER.try_with(|answer| answer.set(hub_digest(headers)));
}

/// The SHA-256 the Hub's headers report: `X-Linked-Etag` when there is one (huggingface_hub
/// takes it over `ETag`, whatever it holds), else `ETag`; None unless it is a SHA-256.
fn hub_digest(headers: &HeaderMap) -> Option<ReportedDigest> {
    let (value, from) = match headers.get("x-linked-etag") {
        Some(linked) => (linked, "the Hub's X-Linked-Etag"),
        None => (headers.get(http::header::ETAG)?, "the Hub's ETag"),
    };
    let digest = sha256_of_etag(value.to_str().ok()?)?;
    Some(ReportedDigest { digest, from })
}

/// The SHA-256 an entity tag holds: `"<64 hex>"` (either case), weak (`W/`) or not, quoted or
/// not, as huggingface_hub's `_normalize_etag` reads one; None for anything else (a git blob
/// id, an S3 MD5, a `sha256:` form no Hub sends).
fn sha256_of_etag(value: &str) -> Option<Digest> {
    let value = value.trim();
    let value = value.strip_prefix("W/").unwrap_or(value);
    let value = (value.strip_prefix('"'))
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    value.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "248dfc3911869ec493c76e65bf2fcf7f615828b0254c12b473182f0f81d3a707";

    #[test]
    fn only_a_64_hex_entity_tag_is_a_sha256() {
        let digest: Digest = SHA.parse().unwrap();
        for tag in [
            format!("\"{SHA}\""),
            format!("W/\"{SHA}\""),
            format!("  \"{SHA}\" "),
            SHA.to_string(),
            format!("\"{}\"", SHA.to_uppercase()),
        ] {
            assert_eq!(sha256_of_etag(&tag), Some(digest), "{tag}");
        }
        for tag in [
            "\"be4d21d94f3b4687e5a54d84bf6ab46ed0f8defd\"", // a git blob id
            "\"9b2cf535f27731c974343645a3985328\"",         // an MD5 (S3, a CDN)
            "\"d41d8cd98f00b204e9800998ecf8427e-3\"",       // a multipart upload's
            &format!("\"sha256:{SHA}\""),
            &format!("\"{SHA}0\""),
            &format!("\"{}g\"", &SHA[..63]),
            &format!("\"{SHA}"),
            &format!("w/\"{SHA}\""),
            "",
            "\"\"",
        ] {
            assert_eq!(sha256_of_etag(tag), None, "{tag}");
        }
    }

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        (pairs.iter())
            .map(|(k, v)| (http::HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn the_linked_etag_is_read_before_the_etag_as_huggingface_hub_reads_them() {
        let sha: Digest = SHA.parse().unwrap();
        let other = Digest::of(b"other");
        let git = "\"be4d21d94f3b4687e5a54d84bf6ab46ed0f8defd\"".to_string();
        let quoted = |d: Digest| format!("\"{d}\"");
        let linked = |d| ReportedDigest {
            digest: d,
            from: "the Hub's X-Linked-Etag",
        };
        for (pairs, want) in [
            // An LFS or Xet file: the redirect names its SHA-256.
            (
                vec![("x-linked-etag", quoted(sha)), ("etag", quoted(other))],
                Some(linked(sha)),
            ),
            (vec![("x-linked-etag", quoted(sha))], Some(linked(sha))),
            // A small file in git: its blob id, no SHA-256.
            (vec![("etag", git.clone())], None),
            // A SHA-256 as the ETag itself.
            (
                vec![("etag", format!("W/{}", quoted(other)))],
                Some(ReportedDigest {
                    digest: other,
                    from: "the Hub's ETag",
                }),
            ),
            // A linked ETag that is no SHA-256 is not made up for by the ETag.
            (
                vec![("x-linked-etag", git.clone()), ("etag", quoted(sha))],
                None,
            ),
            (vec![], None),
        ] {
            assert_eq!(hub_digest(&headers(&pairs)), want, "{pairs:?}");
        }
    }

    /// A loopback server answering each request (one a connection) with `answer(path, range)`.
    fn serve(answer: impl Fn(&str, &str) -> String + Send + 'static) -> u16 {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut lines = BufReader::new(stream.try_clone().unwrap()).lines();
                let request = lines.next().unwrap().unwrap();
                let path = request.split(' ').nth(1).unwrap_or_default().to_string();
                let mut range = String::new();
                for line in lines.map(Result::unwrap).take_while(|l| !l.is_empty()) {
                    if let Some((k, v)) = line.split_once(':')
                        && k.eq_ignore_ascii_case("range")
                    {
                        range = v.trim().to_string();
                    }
                }
                let _ = stream.write_all(answer(&path, &range).as_bytes());
            }
        });
        port
    }

    #[test]
    fn the_hubs_own_answer_is_noted_not_its_storages() {
        let sha: Digest = SHA.parse().unwrap();
        let body = "0123456789";
        let storage = serve(move |_, range| {
            let (from, to) = (range.trim_start_matches("bytes="))
                .split_once('-')
                .map(|(a, b)| (a.parse::<usize>().unwrap(), b.parse::<usize>().unwrap()))
                .unwrap();
            let to = to.min(body.len() - 1);
            // A SHA-256 as the storage's ETag, which is not the Hub's word.
            format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {from}-{to}/{}\r\n\
                 ETag: \"{}\"\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                body.len(),
                Digest::of(b"storage"),
                to + 1 - from,
                &body[from..=to]
            )
        });
        let hub = serve(move |path, _| {
            let linked = match path.contains("/lfs/") {
                true => format!("X-Linked-Etag: \"{SHA}\"\r\n"),
                false => String::new(),
            };
            format!(
                "HTTP/1.1 302 Found\r\nLocation: http://localhost:{storage}{path}\r\n{linked}\
                 ETag: \"be4d21d94f3b4687e5a54d84bf6ab46ed0f8defd\"\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
        });
        let open = |file: &str| {
            let url = format!("http://127.0.0.1:{hub}/acme/tiny/resolve/main/{file}");
            let (store, location) = super::super::store::locate(&url, &[]).unwrap();
            let get = object_store::GetOptions {
                range: Some((0..4).into()),
                ..Default::default()
            };
            let request = async { Ok(from_hub(store.get_opts(&location, get)).await) };
            let (got, reported) = super::super::object::wait(None, request).unwrap();
            assert_eq!(got.unwrap().meta.size, body.len() as u64);
            reported
        };
        assert_eq!(
            open("lfs/m.safetensors"),
            Some(ReportedDigest {
                digest: sha,
                from: "the Hub's X-Linked-Etag"
            })
        );
        assert_eq!(open("git/m.safetensors"), None);
    }

    #[test]
    fn answers_are_noted_only_for_the_request_that_asks() {
        let sha: Digest = SHA.parse().unwrap();
        let answer = headers(&[("x-linked-etag", format!("\"{SHA}\""))]);
        let git = headers(&[(
            "etag",
            "\"be4d21d94f3b4687e5a54d84bf6ab46ed0f8defd\"".into(),
        )]);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            note_hub_answer(&answer); // outside: nowhere to go, no panic
            let ((), got) = from_hub(async { note_hub_answer(&answer) }).await;
            assert_eq!(got.map(|r| r.digest), Some(sha));
            // The last answer from the Hub counts (a redirect of the Hub to itself, then the file).
            let ((), got) = from_hub(async {
                note_hub_answer(&answer);
                note_hub_answer(&git);
            })
            .await;
            assert_eq!(got, None);
            let ((), got) = from_hub(async {}).await;
            assert_eq!(got, None);
        });
    }
}
