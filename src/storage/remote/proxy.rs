//! Requests through an HTTP proxy, routed as curl and other HTTP clients route them: the client
//! options `proxy_url` and `proxy_excludes` (object_store's names) when given, else
//! `HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY` and `NO_PROXY` (or their lower-case spellings), read
//! by hyper-util's `Matcher` (NO_PROXY: host names, domain suffixes, IPs, CIDR ranges, `*`).
//!
//! An https host is reached through a `CONNECT` tunnel (TLS runs end to end inside it); a plain
//! http request goes to the proxy in absolute form (`GET http://host/path`), with the proxy's
//! credentials (`http://user:password@proxy:3128`) as `Proxy-Authorization` on each. Only
//! `http://` proxies are used; any other proxy URL (https://, socks5://) or one that does not
//! parse is refused when the store is built, naming the setting, never silently bypassed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::TokioIo;
use object_store::{ClientConfigKey, ClientOptions};
use tokio::net::TcpStream;
use tower_service::Service;

/// The environment variables that choose proxies (a store is kept per their values).
pub const VARIABLES: [&str; 8] = [
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
];

/// Which requests go through which proxy.
#[derive(Debug)]
pub struct Proxies(Matcher);

impl Proxies {
    /// The client options' proxy when one is given (`proxy_excludes` its NO_PROXY), else the
    /// environment's.
    pub fn new(options: &ClientOptions) -> Result<Proxies, String> {
        if options
            .get_config_value(&ClientConfigKey::ProxyCaCertificate)
            .is_some()
        {
            return Err(
                "client option proxy_ca_certificate: only http:// proxies are used, \
                        which have no certificate"
                    .into(),
            );
        }
        if let Some(url) = options.get_config_value(&ClientConfigKey::ProxyUrl) {
            check("proxy_url", &url)?;
            let excludes = options.get_config_value(&ClientConfigKey::ProxyExcludes);
            let matcher = Matcher::builder()
                .all(url)
                .no(excludes.unwrap_or_default())
                .build();
            return Ok(Proxies(matcher));
        }
        for name in VARIABLES
            .iter()
            .filter(|n| !n.eq_ignore_ascii_case("no_proxy"))
        {
            match std::env::var(name) {
                Ok(value) if !value.trim().is_empty() => check(name, &value)?,
                _ => {}
            }
        }
        Ok(Proxies(Matcher::from_env()))
    }

    /// The `Proxy-Authorization` a plain-http request to `uri` carries (its proxy's credentials).
    pub fn authorization(&self, uri: &Uri) -> Option<http::HeaderValue> {
        match uri.scheme_str() {
            Some("http") => self.0.intercept(uri)?.basic_auth().cloned(),
            _ => None,
        }
    }
}

/// A proxy setting `hyper-util` would read: `http://` (or no scheme) with a host.
fn check(name: &str, value: &str) -> Result<(), String> {
    let value = value.trim();
    let shown = match value.contains("://") {
        true => crate::redact::redact(value).into_owned(),
        false => crate::redact::redact(&format!("http://{value}")).into_owned(),
    };
    let uri: Uri = (value.parse()).map_err(|e| format!("{name}={shown}: not a proxy URL ({e})"))?;
    match uri.scheme_str() {
        None | Some("http") if uri.authority().is_some() => Ok(()),
        None | Some("http") => Err(format!("{name}={shown}: not a proxy URL (no host)")),
        Some(other) => Err(format!(
            "{name}={shown}: {other}:// proxies are not supported; give the proxy's http:// URL"
        )),
    }
}

/// The connection a request is sent on, as [`Route`] opens it: to the host, to a proxy
/// (forwarded: the request goes in absolute form), or a tunnel through one.
#[derive(Clone)]
pub struct Route {
    pub tcp: HttpConnector,
    pub proxies: Arc<Proxies>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Service<Uri> for Route {
    type Response = Stream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Stream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let mut tcp = self.tcp.clone();
        let proxy = self.proxies.0.intercept(&dst);
        Box::pin(async move {
            let Some(proxy) = proxy else {
                let io = tcp.call(dst).await?;
                return Ok(Stream {
                    io,
                    forwarded: false,
                });
            };
            let through = |e: BoxError| -> BoxError {
                Box::new(Through {
                    proxy: proxy.uri().to_string(),
                    error: e,
                })
            };
            if dst.scheme_str() != Some("https") {
                let io = (tcp.call(proxy.uri().clone()).await).map_err(|e| through(e.into()))?;
                return Ok(Stream {
                    io,
                    forwarded: true,
                });
            }
            let mut tunnel = Tunnel::new(proxy.uri().clone(), tcp);
            if let Some(auth) = proxy.basic_auth() {
                tunnel = tunnel.with_auth(auth.clone());
            }
            std::future::poll_fn(|cx| tunnel.poll_ready(cx))
                .await
                .map_err(|e| through(e.into()))?;
            let io = tunnel.call(dst).await.map_err(|e| through(e.into()))?;
            Ok(Stream {
                io,
                forwarded: false,
            })
        })
    }
}

/// A connection failure at a proxy, naming it (its URL carries no credentials).
#[derive(Debug)]
struct Through {
    proxy: String,
    error: BoxError,
}

impl std::fmt::Display for Through {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "through the proxy {}", self.proxy)
    }
}

impl std::error::Error for Through {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error.as_ref())
    }
}

/// A TCP connection that says whether it goes to a forwarding proxy (hyper's client then writes
/// each request's URI in absolute form).
pub struct Stream {
    io: TokioIo<TcpStream>,
    forwarded: bool,
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        self.io.connected().proxy(self.forwarded)
    }
}

impl Read for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl Write for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_settings_are_checked_and_their_secrets_not_shown() {
        assert!(check("HTTPS_PROXY", "http://proxy.corp:3128").is_ok());
        assert!(check("HTTPS_PROXY", "proxy.corp:3128").is_ok());
        let e = check("HTTPS_PROXY", "socks5://u:hunter2@proxy.corp:1080").unwrap_err();
        assert!(e.contains("socks5:// proxies are not supported"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = check("proxy_url", "https://proxy.corp").unwrap_err();
        assert!(e.starts_with("proxy_url=https://proxy.corp"), "{e}");
        assert!(check("HTTP_PROXY", "http://").is_err());
    }

    #[test]
    fn options_route_through_their_proxy_with_its_credentials() {
        let options = ClientOptions::new()
            .with_config(ClientConfigKey::ProxyUrl, "http://u:p@127.0.0.1:3128")
            .with_config(ClientConfigKey::ProxyExcludes, "internal.example");
        let proxies = Proxies::new(&options).unwrap();
        let to = |u: &str| {
            proxies
                .0
                .intercept(&u.parse().unwrap())
                .map(|i| i.uri().to_string())
        };
        assert_eq!(
            to("https://bucket.example/x").as_deref(),
            Some("http://127.0.0.1:3128/")
        );
        assert_eq!(to("http://internal.example/x"), None);
        let auth = proxies.authorization(&"http://bucket.example/x".parse().unwrap());
        assert_eq!(auth.unwrap(), "Basic dTpw"); // base64("u:p")
        assert!((proxies.authorization(&"https://bucket.example/x".parse().unwrap())).is_none());
        let bad = ClientOptions::new().with_config(ClientConfigKey::ProxyCaCertificate, "ca.pem");
        assert!(Proxies::new(&bad).is_err());
    }
}
