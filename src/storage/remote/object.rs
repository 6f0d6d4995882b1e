//! One object in a store: its size, a prefix and the SHA-256 the store reports of it (the Hub's
//! of a file of a repository: `reported`) from one ranged GET at open, then ranged GETs
//! straight into the caller's memory, retried from the byte where a failed or stalled response
//! stopped. Every call blocks on the crate's runtime (the engine's workers are plain threads) in
//! [`wait`], which ends it when the caller stops the read or presses Ctrl-C.

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::Either;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore};

use super::address::Options;
use super::reported::{self, ReportedDigest};
use super::store;

/// Bytes asked for at open: the 8-byte length and, for most files, the whole JSON header.
const PROBE_BYTES: u64 = 1 << 16;
/// Attempts at one range: `object_store` retries requests and resumes bodies itself (where the
/// server sends an ETag); one more request from the first missing byte covers the rest.
const ATTEMPTS: usize = 2;
/// How often a wait looks at its stop flag and at the caller's poll ([`crate::storage::cancel`]).
const STOP_CHECK: Duration = Duration::from_millis(50);

pub struct Object {
    store: Arc<dyn ObjectStore>,
    location: ObjectPath,
    url: String,
    size: u64,
    /// The version opened (its strong ETag, and the store's version id where it has one): every
    /// later GET asks for it, so a load reads one version or fails.
    version: Version,
    /// The SHA-256 the store reported in its answer to the opening GET.
    reported: Option<ReportedDigest>,
}

/// Which version of an object a read asks for.
#[derive(Debug, Clone, Default)]
struct Version {
    etag: Option<String>,
    id: Option<String>,
}

impl Version {
    fn of(meta: &object_store::ObjectMeta) -> Version {
        Version {
            // A weak ETag (W/"...") never matches If-Match, which compares strongly.
            etag: (meta.e_tag.clone()).filter(|tag| !tag.starts_with("W/")),
            id: meta.version.clone(),
        }
    }

    fn ask(&self, range: Range<u64>) -> GetOptions {
        GetOptions {
            range: Some(GetRange::Bounded(range)),
            if_match: self.etag.clone(),
            version: self.id.clone(),
            ..GetOptions::default()
        }
    }
}

impl std::fmt::Debug for Object {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Object({}, {} bytes)",
            crate::redact::redact(&self.url),
            self.size
        )
    }
}

/// On failure: how many bytes were read into the destinations before the error, and the error.
pub type Partial = (usize, io::Error);

impl Object {
    /// Opens `url`: one GET of its first bytes gives the object's size, its start and, for a
    /// file of a Hub repository, the SHA-256 the Hub reports of it.
    pub fn open(url: &str, options: &Options) -> io::Result<(Object, Vec<u8>)> {
        let (store, location) = store::locate(url, options)?;
        let get = GetOptions {
            range: Some(GetRange::Bounded(0..PROBE_BYTES)),
            ..GetOptions::default()
        };
        let hub = store::names_hub_file(url);
        let result = wait(None, async {
            let request = store.get_opts(&location, get);
            let (got, reported) = match hub {
                true => reported::from_hub(request).await,
                false => (request.await, None),
            };
            let got = got.map_err(|e| to_io(url, e))?;
            let (size, version) = (got.meta.size, Version::of(&got.meta));
            let prefix = collect(got.into_stream(), url, PROBE_BYTES as usize, || {
                range_error(url, "more bytes than the range asked for")
            })
            .await?;
            Ok::<_, io::Error>((size, version, reported, prefix))
        })?;
        let (size, version, reported, prefix) = result;
        let object = Object {
            store,
            location,
            url: url.to_string(),
            size,
            version,
            reported,
        };
        Ok((object, prefix))
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The SHA-256 the store reported of the object when it was opened; None where it reported
    /// none (every store but the Hub, a Hub file kept in git rather than LFS or Xet).
    pub fn reported_digest(&self) -> Option<ReportedDigest> {
        self.reported
    }

    /// Fills `buf` from `offset` (short only at the object's end); for headers and slice rows.
    pub fn read_fully_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let len = (buf.len() as u64).min(self.size.saturating_sub(offset)) as usize;
        let stop = AtomicBool::new(false);
        self.read_into(offset, &mut [&mut buf[..len]], &stop)
            .map_err(|(_, e)| e)?;
        Ok(len)
    }

    /// Fills `dests`, in order, with the bytes from `offset` on: one ranged GET, and on a failure
    /// another from the first byte not yet received. Stops early (an `Interrupted` error) when
    /// `stop` is set.
    pub fn read_into(
        &self,
        offset: u64,
        dests: &mut [&mut [u8]],
        stop: &AtomicBool,
    ) -> Result<(), Partial> {
        let total: usize = dests.iter().map(|d| d.len()).sum();
        let mut done = 0usize;
        let mut attempt = 0;
        while done < total {
            let range = offset + done as u64..offset + total as u64;
            match self.get_into(range, dests, &mut done, stop) {
                Ok(()) => {}
                Err(e)
                    if retryable(&e) && attempt + 1 < ATTEMPTS && !stop.load(Ordering::Relaxed) =>
                {
                    attempt += 1;
                }
                Err(e) => return Err((done, e)),
            }
        }
        Ok(())
    }

    /// One GET of `range`, its body copied into `dests` from `done` bytes on (advancing `done`).
    fn get_into(
        &self,
        range: Range<u64>,
        dests: &mut [&mut [u8]],
        done: &mut usize,
        stop: &AtomicBool,
    ) -> io::Result<()> {
        let want = range.end - range.start;
        let get = self.version.ask(range);
        wait(Some(stop), async {
            let got = self.store.get_opts(&self.location, get).await;
            let mut body = got.map_err(|e| self.error(e))?.into_stream();
            let mut received = 0u64;
            while let Some(frame) = body.next().await {
                let bytes = frame.map_err(|e| self.error(e))?;
                if received + bytes.len() as u64 > want {
                    return Err(range_error(
                        &self.url,
                        "more bytes than the range asked for",
                    ));
                }
                received += bytes.len() as u64;
                copy_at(dests, *done, &bytes);
                *done += bytes.len();
            }
            if received < want {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{}: response ended {} bytes early",
                        self.url,
                        want - received
                    ),
                ));
            }
            Ok(())
        })
    }

    /// The store's error for a read of this object: a version that is gone is its own error.
    fn error(&self, e: object_store::Error) -> io::Error {
        match e {
            object_store::Error::Precondition { .. } => io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: the object changed while it was read (opened as ETag {}): reopen it to \
                     read the new version",
                    self.url,
                    self.version.etag.as_deref().unwrap_or("?")
                ),
            ),
            e => to_io(&self.url, e),
        }
    }

    /// The whole of a small object (an index.json): at most `limit` bytes, else an error.
    pub fn fetch_all(url: &str, options: &Options, limit: u64) -> io::Result<Vec<u8>> {
        let (store, location) = store::locate(url, options)?;
        Self::fetch_located(store.as_ref(), &location, url, limit)
    }

    /// [`Object::fetch_all`] of `location` in `store` (`url` names it in messages).
    pub fn fetch_located(
        store: &dyn ObjectStore,
        location: &ObjectPath,
        url: &str,
        limit: u64,
    ) -> io::Result<Vec<u8>> {
        wait(None, async {
            let got = (store.get_opts(location, GetOptions::default()).await)
                .map_err(|e| to_io(url, e))?;
            collect(got.into_stream(), url, limit as usize, || {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{url}: larger than {} MiB, not a safetensors index",
                        limit >> 20
                    ),
                )
            })
            .await
        })
    }
}

/// Runs `work` on the crate's runtime to its end, unless `stop` is set or the caller's poll asks
/// to stop first (looked at every [`STOP_CHECK`], whatever `work` waits on: a connect, a response,
/// a body, a retry's back-off): then an `Interrupted` error, and `work` is dropped, its requests
/// with it.
pub(crate) fn wait<T>(
    stop: Option<&AtomicBool>,
    work: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let stopped =
        || stop.is_some_and(|s| s.load(Ordering::Relaxed)) || crate::storage::cancel::requested();
    let cancelled = || io::Error::new(io::ErrorKind::Interrupted, "cancelled");
    if stopped() {
        return Err(cancelled());
    }
    let watch = async {
        loop {
            tokio::time::sleep(STOP_CHECK).await;
            if stopped() {
                return;
            }
        }
    };
    store::runtime().block_on(async {
        futures_util::pin_mut!(work, watch);
        match futures_util::future::select(work, watch).await {
            Either::Left((result, _)) => result,
            Either::Right(_) => Err(cancelled()),
        }
    })
}

/// A body's bytes, at most `limit` of them: more is `too_long()`'s error, not a larger buffer.
async fn collect<S>(
    mut body: S,
    url: &str,
    limit: usize,
    too_long: impl Fn() -> io::Error,
) -> io::Result<Vec<u8>>
where
    S: futures_util::Stream<Item = object_store::Result<bytes::Bytes>> + Unpin,
{
    let mut out = Vec::new();
    while let Some(frame) = body.next().await {
        let frame = frame.map_err(|e| to_io(url, e))?;
        if out.len() + frame.len() > limit {
            return Err(too_long());
        }
        out.extend_from_slice(&frame);
    }
    Ok(out)
}

/// Copies `bytes` into the destinations, as if they were one buffer, from position `at`.
fn copy_at(dests: &mut [&mut [u8]], mut at: usize, mut bytes: &[u8]) {
    for dest in dests.iter_mut() {
        if bytes.is_empty() {
            return;
        }
        if at >= dest.len() {
            at -= dest.len();
            continue;
        }
        let n = (dest.len() - at).min(bytes.len());
        dest[at..at + n].copy_from_slice(&bytes[..n]);
        bytes = &bytes[n..];
        at = 0;
    }
}

/// Errors a new request may cure: dropped or stalled connections, short bodies, server errors
/// (after `object_store`'s own retries). Not: missing objects, refused access, a server that
/// ignores `Range`, cancellation.
fn retryable(e: &io::Error) -> bool {
    !matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::InvalidData
            | io::ErrorKind::InvalidInput
            | io::ErrorKind::Interrupted
    )
}

fn range_error(url: &str, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "{url}: the server does not honour Range requests ({what}); safeload reads objects in byte ranges"
        ),
    )
}

/// The store's error as an I/O error of the matching kind, naming the URL and what the store said.
pub fn to_io(url: &str, e: object_store::Error) -> io::Error {
    use object_store::Error as E;
    // Redacted before it is cut: a URL cut short could hide its secrets from the redaction.
    let message = shortened(crate::redact::redact(&e.to_string()).into_owned());
    let kind = match e {
        E::NotFound { .. } => io::ErrorKind::NotFound,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => io::ErrorKind::PermissionDenied,
        _ if message.contains("non-partial response")
            || message.contains("Range request not supported")
            || message.contains("Content-Range")
            || message.contains("CONTENT_RANGE")
            || (message.contains("Requested ") && message.contains(", got ")) =>
        {
            return range_error(url, &message);
        }
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, format!("{url}: {message}"))
}

/// What a message keeps of a store's error (which quotes the server's error body).
const MESSAGE_CHARS: usize = 400;

fn shortened(message: String) -> String {
    match message.char_indices().nth(MESSAGE_CHARS) {
        Some((at, _)) => format!("{} ... ({} more bytes)", &message[..at], message.len() - at),
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_at_spans_destinations() {
        let (mut a, mut b, mut c) = ([0u8; 3], [0u8; 0], [0u8; 4]);
        let mut dests: Vec<&mut [u8]> = vec![&mut a, &mut b, &mut c];
        copy_at(&mut dests, 0, &[1, 2]);
        copy_at(&mut dests, 2, &[3, 4, 5]);
        copy_at(&mut dests, 5, &[6, 7]);
        assert_eq!((a, c), ([1, 2, 3], [4, 5, 6, 7]));
    }
}
