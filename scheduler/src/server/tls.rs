//! HTTPS: the certificate and key the servers present.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Why the TLS configuration cannot be loaded.
#[derive(Debug, Error)]
pub enum ServerError {
    #[error("TLS certificate {path}")]
    Certificate {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("TLS certificate {path}: no PEM certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("TLS key {path}")]
    Key {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("TLS configuration")]
    Tls(#[source] rustls::Error),
}

/// Loads a PEM certificate chain and private key for HTTPS.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|source| ServerError::Certificate {
            path: cert.to_path_buf(),
            source,
        })?
        .collect::<Result<_, _>>()
        .map_err(|source| ServerError::Certificate {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(ServerError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| ServerError::Key {
        path: key.to_path_buf(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(ServerError::Tls)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(ServerError::Tls)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
