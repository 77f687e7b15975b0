//! HTTPS: the certificate and key the servers present, read again when
//! their files change.
//!
//! The chart mounts them from a Secret, whose volume kubelet updates in
//! place (all files at once) when the Secret changes: a certificate
//! renewed by `helm upgrade` or by cert-manager is served from the next
//! handshake after [`CertificateFiles::keep_reloading`] sees it, with no
//! restart and no connection dropped.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use thiserror::Error;

/// How often the files are compared with what is served, unless told.
pub const RELOAD_PERIOD: Duration = Duration::from_secs(30);

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
    #[error("TLS certificate {cert} with key {key}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("TLS configuration")]
    Tls(#[source] rustls::Error),
    #[error("client CA {path}")]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("client CA {path}: no usable CA certificate in the file")]
    NoClientCa { path: PathBuf },
    #[error("client CA {path}")]
    ClientVerifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

/// Whether the client of a connection presented a certificate that a
/// client CA signed ([`CertificateFiles::server_config_verifying_clients`]):
/// put by the server into each request of a TLS connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientCertified(pub bool);

/// Loads a PEM certificate chain and private key for HTTPS, served as
/// they are now (for a certificate that follows its files, see
/// [`CertificateFiles`]).
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    CertificateFiles::load(cert, key)?.server_config()
}

/// What the files held when last read, and what was made of them.
struct Loaded {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    certified: Arc<CertifiedKey>,
}

/// A certificate chain and key read from two PEM files, presented to every
/// client, and replaced when the files change
/// ([`CertificateFiles::reload`]).
pub struct CertificateFiles {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: RwLock<Loaded>,
    /// The contents last refused, so one bad pair is reported once.
    refused: Mutex<Option<(Vec<u8>, Vec<u8>)>>,
}

impl std::fmt::Debug for CertificateFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateFiles")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl CertificateFiles {
    /// Reads `cert` (a PEM chain, the server's certificate first) and
    /// `key` (its PEM private key).
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Self>, ServerError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (cert_pem, key_pem) = read_pair(cert, key)?;
        let certified = certify(cert, key, &cert_pem, &key_pem, &provider)?;
        Ok(Arc::new(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: RwLock::new(Loaded {
                cert_pem,
                key_pem,
                certified,
            }),
            refused: Mutex::new(None),
        }))
    }

    /// A server configuration presenting whatever these files hold at
    /// each handshake.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, ServerError> {
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(ServerError::Tls)?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// A server configuration as [`CertificateFiles::server_config`]'s
    /// that also asks each client for a certificate, and accepts one only
    /// if a CA of `client_ca` (PEM) signed it for client authentication.
    /// A client may present none (the API server calling the webhooks,
    /// kubelet's probes): the routes decide what such a client may call
    /// ([`ClientCertified`]).
    pub fn server_config_verifying_clients(
        self: &Arc<Self>,
        client_ca: &Path,
    ) -> Result<Arc<rustls::ServerConfig>, ServerError> {
        let pem = std::fs::read(client_ca).map_err(|source| ServerError::ClientCa {
            path: client_ca.to_path_buf(),
            source: rustls::pki_types::pem::Error::Io(source),
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for certificate in CertificateDer::pem_slice_iter(&pem) {
            let certificate = certificate.map_err(|source| ServerError::ClientCa {
                path: client_ca.to_path_buf(),
                source,
            })?;
            // One that cannot be a trust anchor is skipped, said so; none
            // left is refused below.
            if let Err(error) = roots.add(certificate) {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "client CA {}: a certificate skipped",
                    client_ca.display()
                );
            }
        }
        if roots.is_empty() {
            return Err(ServerError::NoClientCa {
                path: client_ca.to_path_buf(),
            });
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .allow_unauthenticated()
                .build()
                .map_err(|source| ServerError::ClientVerifier {
                    path: client_ca.to_path_buf(),
                    source,
                })?;
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(ServerError::Tls)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads the files again; when they hold another valid pair, presents
    /// it from the next handshake on. Answers whether it changed. A pair
    /// that cannot be used (unreadable, or a key that is not the
    /// certificate's: files caught half-written) leaves the one served.
    pub fn reload(&self) -> Result<bool, ServerError> {
        let (cert_pem, key_pem) = read_pair(&self.cert, &self.key)?;
        {
            let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
            if current.cert_pem == cert_pem && current.key_pem == key_pem {
                return Ok(false);
            }
        }
        let certified = certify(&self.cert, &self.key, &cert_pem, &key_pem, &self.provider)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Loaded {
            cert_pem,
            key_pem,
            certified,
        };
        Ok(true)
    }

    /// Runs until the runtime stops: [`CertificateFiles::reload`] every
    /// `period`, saying in the log what changed, and naming a pair it
    /// cannot use once (it keeps serving the one before).
    pub async fn keep_reloading(self: Arc<Self>, period: Duration) {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            match self.reload() {
                Ok(true) => {
                    self.forget_refused();
                    tracing::info!(
                        "TLS certificate {} changed: serving the new one from the next handshake",
                        self.cert.display()
                    );
                }
                Ok(false) => self.forget_refused(),
                Err(error) => {
                    if self.first_refusal() {
                        tracing::warn!(
                            error = &error as &dyn std::error::Error,
                            "TLS certificate files changed but cannot be used; still serving the certificate before"
                        );
                    }
                }
            }
        }
    }

    fn forget_refused(&self) {
        *self.refused.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// Whether the files as they are now were not refused before (and
    /// remembers them as refused).
    fn first_refusal(&self) -> bool {
        let now = (
            std::fs::read(&self.cert).unwrap_or_default(),
            std::fs::read(&self.key).unwrap_or_default(),
        );
        let mut refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
        if refused.as_ref() == Some(&now) {
            return false;
        }
        *refused = Some(now);
        true
    }
}

impl ResolvesServerCert for CertificateFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        Some(current.certified.clone())
    }
}

/// The two files' contents.
fn read_pair(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), ServerError> {
    let cert_pem = std::fs::read(cert).map_err(|source| ServerError::Certificate {
        path: cert.to_path_buf(),
        source: rustls::pki_types::pem::Error::Io(source),
    })?;
    let key_pem = std::fs::read(key).map_err(|source| ServerError::Key {
        path: key.to_path_buf(),
        source: rustls::pki_types::pem::Error::Io(source),
    })?;
    Ok((cert_pem, key_pem))
}

/// The chain in `cert_pem` with the key in `key_pem`, checked to belong
/// together.
fn certify(
    cert: &Path,
    key: &Path,
    cert_pem: &[u8],
    key_pem: &[u8],
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, ServerError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
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
    let private_key =
        PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| ServerError::Key {
            path: key.to_path_buf(),
            source,
        })?;
    CertifiedKey::from_der(chain, private_key, provider)
        .map(Arc::new)
        .map_err(|source| ServerError::Pair {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            source,
        })
}
