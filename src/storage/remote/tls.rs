//! The stores' TLS: rustls on `ring`, Mozilla's roots (webpki-roots) plus the PEM bundle named by
//! `AWS_CA_BUNDLE` (else `SSL_CERT_FILE`); with the client option `allow_invalid_certificates`
//! true, any certificate is accepted (a self-signed test server, a proxy that re-signs), while
//! the handshake's signatures are still checked.

use std::sync::Arc;

use object_store::{ClientConfigKey, ClientOptions};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The TLS configuration of a store's client.
pub fn config(options: &ClientOptions) -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let any = options
        .get_config_value(&ClientConfigKey::AllowInvalidCertificates)
        .is_some_and(|v| super::config::is_true(v.trim()));
    if any {
        let verifier = Arc::new(AnyCertificate(provider));
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    for cert in extra_roots()? {
        roots.add(cert).map_err(|e| format!("CA bundle: {e}"))?;
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
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

/// `allow_invalid_certificates`: whoever the certificate names and whoever signed it, it is
/// taken; the server must still prove it holds the certificate's key.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
