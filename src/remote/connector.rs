//! The stores' HTTP client: hyper-util's pooled HTTP/1.1 client, TLS by rustls on `ring` with
//! Mozilla's roots plus `AWS_CA_BUNDLE` / `SSL_CERT_FILE` (see Cargo.toml for why not reqwest).
//!
//! One leniency: some S3 servers (rclone's `serve s3`, gofakes3) answer a ranged GET with
//! `200 OK` and a `Content-Range` of exactly the bytes asked for, where S3 says `206`;
//! `object_store` refuses any ranged `200`. Such a response is taken as the `206` it means, and
//! `object_store` still checks that its `Content-Range` is the range asked for. A `200` without
//! `Content-Range` (a server that ignores `Range` and sends the whole object) stays an error.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use http::StatusCode;
use http::header::{CONTENT_RANGE, RANGE};
use http_body_util::BodyExt;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector as Tcp;
use hyper_util::rt::TokioExecutor;
use object_store::ClientOptions;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpRequestBody,
    HttpResponse, HttpResponseBody, HttpService,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// A connection that does not open within this is a failed request (retried).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A response whose headers do not come within this is a failed request (retried). Bodies that
/// stall are caught per frame by the reader (`object.rs`).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct Connector;

impl HttpConnector for Connector {
    fn connect(&self, _: &ClientOptions) -> object_store::Result<HttpClient> {
        let generic = |e: String| object_store::Error::Generic {
            store: "HTTP client",
            source: e.into(),
        };
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        for cert in extra_roots().map_err(generic)? {
            roots
                .add(cert)
                .map_err(|e| generic(format!("CA bundle: {e}")))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| generic(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut tcp = Tcp::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let https = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(https);
        Ok(HttpClient::new(Hyper(client)))
    }
}

/// `AWS_CA_BUNDLE` (else `SSL_CERT_FILE`): PEM certificates trusted beside Mozilla's roots.
fn extra_roots() -> Result<Vec<CertificateDer<'static>>, String> {
    let Ok(path) = std::env::var("AWS_CA_BUNDLE").or_else(|_| std::env::var("SSL_CERT_FILE"))
    else {
        return Ok(Vec::new());
    };
    CertificateDer::pem_file_iter(&path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("CA bundle {path}: {e}"))
}

#[derive(Debug)]
struct Hyper(Client<HttpsConnector<Tcp>, HttpRequestBody>);

#[async_trait]
impl HttpService for Hyper {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let ranged = req.headers().contains_key(RANGE);
        let response = tokio::time::timeout(RESPONSE_TIMEOUT, self.0.request(req))
            .await
            .map_err(|e| HttpError::new(HttpErrorKind::Timeout, e))?
            .map_err(|e| {
                let kind = match e.is_connect() {
                    true => HttpErrorKind::Connect,
                    false => HttpErrorKind::Request,
                };
                HttpError::new(kind, e)
            })?;
        let (mut parts, body) = response.into_parts();
        if ranged && parts.status == StatusCode::OK && parts.headers.contains_key(CONTENT_RANGE) {
            parts.status = StatusCode::PARTIAL_CONTENT;
        }
        let body = body.map_err(|e| HttpError::new(HttpErrorKind::Interrupted, e));
        Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)))
    }
}
