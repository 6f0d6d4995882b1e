//! The stores' HTTP client: hyper-util's pooled HTTP/1.1 client, TLS by rustls on `ring` with
//! Mozilla's roots plus `AWS_CA_BUNDLE` / `SSL_CERT_FILE` (see Cargo.toml for why not reqwest).
//!
//! One leniency: some S3 servers (rclone's `serve s3`, gofakes3) answer a ranged GET with
//! `200 OK` and a `Content-Range` of exactly the bytes asked for, where S3 says `206`;
//! `object_store` refuses any ranged `200`. Such a response is taken as the `206` it means, and
//! `object_store` still checks that its `Content-Range` is the range asked for. A `200` without
//! `Content-Range` (a server that ignores `Range` and sends the whole object) stays an error.
//!
//! Every wait is bounded, by the client options `object_store` names (storage_options or the
//! environment): `connect_timeout` (default 10 s), `timeout` for the response headers (30 s), and
//! `read_timeout` for each piece of any body (30 s without a byte is an error). An error response's
//! body (which `object_store` reads into its message) is cut to [`ERROR_BODY_BYTES`]. A `429` or
//! `503` with `Retry-After` is retried here, after the wait it names (capped), as many times as
//! `object_store` would retry it, and then fails without a last, useless wait.
//!
//! Connections go through the proxies of `proxy` (`HTTPS_PROXY`, `proxy_url`, ...); TLS is `tls`'s.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::StatusCode;
use http::header::{CONTENT_RANGE, RANGE};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector as Tcp;
use hyper_util::rt::TokioExecutor;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpRequestBody,
    HttpResponse, HttpResponseBody, HttpService,
};
use object_store::{ClientConfigKey, ClientOptions};

use super::proxy::{Proxies, Route};

/// A connection that does not open within this is a failed request (retried).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A response whose headers do not come within this is a failed request (retried).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// A body that sends nothing for this long has stalled (an error; reads retry from the first
/// byte not received).
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// What is kept of an error response's body.
pub const ERROR_BODY_BYTES: usize = 4 << 10;
/// Redirects followed for one request, as HTTP clients follow them.
const MAX_REDIRECTS: usize = 10;

/// The client of one store; `query`: a query string every request of it carries (an `http(s)`
/// URL's own: a presigned S3 URL's signature, an Azure SAS, a `?token=`), which `object_store`'s
/// HTTP store would drop.
#[derive(Debug, Default)]
pub struct Connector {
    pub query: Option<String>,
    /// An `Authorization` value every request of this client starts with (the Hub's token), sent
    /// to the host the URL names and to no other (see `Hyper::follow`).
    pub authorization: Option<String>,
    /// The caller's `allow_http=false`: no request goes to an `http://` URL.
    pub refuse_http: bool,
}

/// The waits a client bounds, and which plain-http requests it sends: a redirect from https to
/// http only with `allow_http` true (`downgrade`), none at all with the caller's
/// `allow_http=false` (`refuse_http`).
#[derive(Debug, Clone, Copy)]
struct Waits {
    response: Duration,
    stall: Duration,
    downgrade: bool,
    refuse_http: bool,
}

/// A duration client option, in the forms `object_store` takes ("30s", "1m 30s", "500ms").
fn duration(
    options: &ClientOptions,
    key: ClientConfigKey,
    default: Duration,
) -> Result<Duration, String> {
    match options.get_config_value(&key) {
        None => Ok(default),
        Some(text) => humantime::parse_duration(text.trim()).map_err(|e| {
            format!(
                "client option {}: {text:?} is not a duration ({e})",
                key.as_ref()
            )
        }),
    }
}

impl HttpConnector for Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let generic = |e: String| object_store::Error::Generic {
            store: "HTTP client",
            source: e.into(),
        };
        let waits = Waits {
            response: duration(options, ClientConfigKey::Timeout, RESPONSE_TIMEOUT)
                .map_err(generic)?,
            stall: duration(options, ClientConfigKey::ReadTimeout, STALL_TIMEOUT)
                .map_err(generic)?,
            downgrade: (options.get_config_value(&ClientConfigKey::AllowHttp))
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("true")),
            refuse_http: self.refuse_http,
        };
        let connect_timeout =
            duration(options, ClientConfigKey::ConnectTimeout, CONNECT_TIMEOUT).map_err(generic)?;
        let tls = super::tls::config(options).map_err(generic)?;
        let proxies = Arc::new(Proxies::new(options).map_err(generic)?);
        let mut tcp = Tcp::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(connect_timeout));
        let route = Route {
            tcp,
            proxies: proxies.clone(),
        };
        let https = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(route);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(https);
        let authorization = (self.authorization.as_deref())
            .map(http::HeaderValue::from_str)
            .transpose()
            .map_err(|e| generic(format!("Authorization: {e}")))?
            .map(|mut value| {
                value.set_sensitive(true);
                value
            });
        let client = Hyper {
            client,
            waits,
            query: self.query.clone(),
            authorization,
            proxies,
        };
        Ok(HttpClient::new(client))
    }
}

/// The longest `Retry-After` waited for.
const RETRY_AFTER_MAX: Duration = Duration::from_secs(30);
/// Tries of one request that `Retry-After` answers may take: the first and the retries
/// `object_store` would make.
const RETRY_AFTER_TRIES: usize = super::config::MAX_RETRIES + 1;
/// The most one request waits, in all, for the `Retry-After`s it is answered with.
const RETRY_AFTER_TOTAL: Duration = super::config::RETRY_TIMEOUT;

/// How long a `429 Too Many Requests` or `503 Service Unavailable` asks the client to wait before
/// its next try: `Retry-After` in seconds or as an HTTP date, at most [`RETRY_AFTER_MAX`].
fn retry_after(status: StatusCode, headers: &http::HeaderMap) -> Option<Duration> {
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let text = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    let wait = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => (httpdate::parse_http_date(text).ok()?)
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    };
    Some(wait.min(RETRY_AFTER_MAX))
}

/// Every cause of a client error, outermost first (hyper's own message says only "client error
/// (Connect)"), and whether one is TLS's (an untrusted or expired certificate, a name it does
/// not cover): an `io::Error` carries rustls' error as its inner error, which `source()` skips.
fn causes(error: &(dyn std::error::Error + 'static)) -> (String, bool) {
    let (mut parts, mut tls) = (Vec::new(), false);
    let mut next = Some(error);
    while let Some(e) = next {
        tls |= e.downcast_ref::<rustls::Error>().is_some();
        let text = e.to_string();
        if !parts.iter().any(|p: &String| p.contains(&text)) {
            parts.push(text);
        }
        next = match (e.downcast_ref::<std::io::Error>()).and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as _),
            None => e.source(),
        };
    }
    (parts.join(": "), tls)
}

/// The HTTP client every store request goes through.
#[derive(Debug)]
struct Hyper {
    client: Client<HttpsConnector<Route>, HttpRequestBody>,
    waits: Waits,
    /// The URL's query string, appended to every request (presigned and SAS URLs).
    query: Option<String>,
    /// Sent to the URL's own host only (see [`Hyper::follow`]).
    authorization: Option<http::HeaderValue>,
    /// The proxies its connections go through (and the credentials of each).
    proxies: Arc<Proxies>,
}

#[async_trait]
impl HttpService for Hyper {
    async fn call(&self, mut req: HttpRequest) -> Result<HttpResponse, HttpError> {
        if let Some(query) = &self.query {
            let uri = req.uri().to_string();
            let joined = match uri.contains('?') {
                true => format!("{uri}&{query}"),
                false => format!("{uri}?{query}"),
            };
            *req.uri_mut() = joined
                .parse()
                .map_err(|e| HttpError::new(HttpErrorKind::Request, e))?;
        }
        if let Some(value) = &self.authorization {
            req.headers_mut()
                .insert(http::header::AUTHORIZATION, value.clone());
        }
        let ranged = req.headers().contains_key(RANGE);
        let stall = self.waits.stall;
        // A 429 / 503 with `Retry-After` is retried here, after the wait it asks for, as this
        // client counts its tries: given to object_store, it would retry after its own backoff
        // and then this wait, and wait once more before the try it gives up after.
        let (mut tries, mut waited) = (1, Duration::ZERO);
        let response = loop {
            let again = copy(&req);
            let response = self.follow(req).await?;
            let Some(wait) = retry_after(response.status(), response.headers()) else {
                break response;
            };
            if tries == RETRY_AFTER_TRIES || waited + wait > RETRY_AFTER_TOTAL {
                let message = format!(
                    "{}: {} on each of {tries} tries ({} s waited as Retry-After asked); \
                     the server is still busy",
                    crate::redact::redact(&again.uri().to_string()),
                    response.status(),
                    waited.as_secs(),
                );
                // Not retried: these tries were object_store's retries.
                return Err(HttpError::new(HttpErrorKind::Unknown, Message(message)));
            }
            tokio::time::sleep(wait).await;
            (tries, waited, req) = (tries + 1, waited + wait, again);
        };
        let (mut parts, body) = response.into_parts();
        if ranged && parts.status == StatusCode::OK && parts.headers.contains_key(CONTENT_RANGE) {
            parts.status = StatusCode::PARTIAL_CONTENT;
        }
        let body = body.map_err(|e| HttpError::new(HttpErrorKind::Interrupted, e));
        let keep = match parts.status.is_success() {
            true => usize::MAX,
            false => ERROR_BODY_BYTES,
        };
        let body = StreamBody::new(bounded(body, stall, keep));
        Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)))
    }
}

impl Hyper {
    /// Sends `req`, and follows the redirects of a GET or HEAD as HTTP clients do: at most
    /// [`MAX_REDIRECTS`], to http(s) only, never from https to http unless `allow_http`, and
    /// without the credentials (`Authorization`, cookies) when the host changes. Range and
    /// If-Match go on, so the data comes from where the redirects end. The answers of the host
    /// `req` went to, until a redirect leaves it, are shown to [`super::reported`] (the Hub
    /// reports a file's SHA-256 on its redirect to the storage).
    async fn follow(
        &self,
        req: HttpRequest,
    ) -> Result<http::Response<hyper::body::Incoming>, HttpError> {
        let follows = matches!(*req.method(), http::Method::GET | http::Method::HEAD);
        let method = req.method().clone();
        let (mut headers, mut uri) = (req.headers().clone(), req.uri().clone());
        let mut next = Some(req);
        let mut at_origin = true;
        for hop in 0..=MAX_REDIRECTS {
            let request = next.take().expect("set for every hop");
            let response = self.send(request, &uri).await?;
            let status = response.status();
            if at_origin && (status.is_success() || status.is_redirection()) {
                super::reported::note_hub_answer(response.headers());
            }
            let location = response.headers().get(http::header::LOCATION);
            let (true, true, Some(location)) =
                (follows, response.status().is_redirection(), location)
            else {
                return Ok(response);
            };
            let from = crate::redact::redact(&uri.to_string()).into_owned();
            if hop == MAX_REDIRECTS {
                return Err(refused(format!(
                    "{from}: more than {MAX_REDIRECTS} redirects"
                )));
            }
            let target = self.redirect_target(&uri, location, &from)?;
            let same_host = same_host(&target, &uri);
            at_origin &= same_host;
            if !same_host {
                headers.remove(http::header::AUTHORIZATION);
                headers.remove(http::header::PROXY_AUTHORIZATION);
                headers.remove(http::header::COOKIE);
            }
            headers.remove(http::header::HOST);
            uri = target
                .as_str()
                .parse()
                .map_err(|e: http::uri::InvalidUri| bad_location(&from, e))?;
            let mut request = http::Request::builder()
                .method(method.clone())
                .uri(uri.clone())
                .body(HttpRequestBody::empty())
                .map_err(|e| bad_location(&from, e))?;
            *request.headers_mut() = headers.clone();
            next = Some(request);
        }
        unreachable!("the last hop returns")
    }

    /// Sends one request of a [`Hyper::follow`] to `uri` (its own): with the proxy's credentials
    /// for it, never over plain http when the caller refused it, and within the response wait.
    async fn send(
        &self,
        mut request: HttpRequest,
        uri: &http::Uri,
    ) -> Result<http::Response<hyper::body::Incoming>, HttpError> {
        if let Some(value) = self.proxies.authorization(uri) {
            request
                .headers_mut()
                .insert(http::header::PROXY_AUTHORIZATION, value);
        }
        if uri.scheme_str() == Some("http") && self.waits.refuse_http {
            return Err(refused(format!(
                "{}: plain http is refused: storage_options has allow_http=false",
                crate::redact::redact(&uri.to_string())
            )));
        }
        tokio::time::timeout(self.waits.response, self.client.request(request))
            .await
            .map_err(|e| HttpError::new(HttpErrorKind::Timeout, e))?
            .map_err(|e| request_error(&e, uri))
    }

    /// Where a redirect from `uri` (shown as `from`) to `location` leads, if it may be followed:
    /// http(s) only, and from https to http only with `allow_http`.
    fn redirect_target(
        &self,
        uri: &http::Uri,
        location: &http::HeaderValue,
        from: &str,
    ) -> Result<url::Url, HttpError> {
        let target = (url::Url::parse(&uri.to_string()))
            .and_then(|base| base.join(location.to_str().unwrap_or_default()))
            .map_err(|e| bad_location(from, e))?;
        let shown = crate::redact::redact(target.as_str()).into_owned();
        let downgrade = uri.scheme_str() == Some("https") && target.scheme() == "http";
        match target.scheme() {
            "http" if downgrade && !self.waits.downgrade => Err(refused(format!(
                "{from}: redirected from https to http ({shown}): refused unless \
                 storage_options has allow_http=true"
            ))),
            "http" | "https" => Ok(target),
            other => Err(refused(format!(
                "{from}: redirected to a {other}: URL ({shown}), which is not followed"
            ))),
        }
    }
}

/// A request error as `object_store` should take it, naming the URL and every cause: a TLS
/// failure is not retried (the same certificate fails the same way on every try), a failed
/// connection or request is.
fn request_error(e: &hyper_util::client::legacy::Error, uri: &http::Uri) -> HttpError {
    let (causes, tls) = causes(e);
    let kind = match (tls, e.is_connect()) {
        (true, _) => HttpErrorKind::Unknown,
        (false, true) => HttpErrorKind::Connect,
        (false, false) => HttpErrorKind::Request,
    };
    let at = crate::redact::redact(&uri.to_string()).into_owned();
    let what = if tls { "TLS failed" } else { "request failed" };
    HttpError::new(kind, Message(format!("{at}: {what}: {causes}")))
}

/// Whether a redirect `target` is on the host (and port) of `uri`, which its credentials are for.
fn same_host(target: &url::Url, uri: &http::Uri) -> bool {
    let port = |scheme: Option<&str>| if scheme == Some("https") { 443 } else { 80 };
    target.host_str() == uri.host()
        && target.port_or_known_default() == Some(uri.port_u16().unwrap_or(port(uri.scheme_str())))
}

/// A request [`Hyper::follow`] will not send (not retried: the same request is refused again).
fn refused(message: String) -> HttpError {
    HttpError::new(HttpErrorKind::Unknown, Message(message))
}

/// A redirect from `from` whose location is not a URL to send a request to.
fn bad_location(from: &str, e: impl std::fmt::Display) -> HttpError {
    refused(format!("{from}: redirected to a bad location ({e})"))
}

/// The same request again, for its next try.
fn copy(req: &HttpRequest) -> HttpRequest {
    let mut again = http::Request::new(req.body().clone());
    *again.method_mut() = req.method().clone();
    *again.uri_mut() = req.uri().clone();
    *again.version_mut() = req.version();
    *again.headers_mut() = req.headers().clone();
    again
}

/// `body`'s frames, each within `stall` of the last (else a timeout error, the end), and at most
/// `keep` data bytes of it (the rest is not read: the connection is dropped with the body).
fn bounded<B>(
    body: B,
    stall: Duration,
    keep: usize,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, HttpError>> + Send + 'static
where
    B: http_body::Body<Data = Bytes, Error = HttpError> + Send + Unpin + 'static,
{
    use futures_util::StreamExt;
    futures_util::stream::unfold(Some((body, keep)), move |state| async move {
        let (mut body, left) = state?;
        if left == 0 {
            return None;
        }
        match tokio::time::timeout(stall, body.frame()).await {
            Err(_) => {
                let message = format!("no bytes for {} s", stall.as_secs_f64());
                Some((
                    Err(HttpError::new(HttpErrorKind::Timeout, Message(message))),
                    None,
                ))
            }
            Ok(None) => None,
            Ok(Some(Err(e))) => Some((Err(e), None)),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(mut data) => {
                    data.truncate(left);
                    let left = left - data.len();
                    Some((Ok(Frame::data(data)), Some((body, left))))
                }
                Err(frame) => Some((Ok(frame), Some((body, left)))),
            },
        }
    })
    .fuse() // polled again after its end (a HEAD's empty body), it stays ended
}

/// What went wrong, said by the connector (a stalled body, a redirect refused).
#[derive(Debug)]
struct Message(String);

impl std::fmt::Display for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Message {}
