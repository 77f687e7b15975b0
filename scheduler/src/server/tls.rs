//! HTTPS: the certificate and key the servers present, read again when
//! their files change.
//!
//! The chart mounts them from a Secret, whose volume kubelet updates in
//! place (all files at once) when the Secret changes: a certificate
//! renewed by `helm upgrade` or by cert-manager is served from the next
//! handshake after [`CertificateFiles::keep_reloading`] sees it, with no
//! restart and no connection dropped. The served certificate's end is
//! watched too: the log warns before it comes ([`expiry_standing`]) and
//! `/metrics` shows it.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use thiserror::Error;

use crate::server::validity::{not_after_unix, ValidityError};

/// How often the files are compared with what is served, unless told.
pub const RELOAD_PERIOD: Duration = Duration::from_secs(30);

/// How long before its end a served certificate is warned about, unless
/// told.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 86_400);

/// How often a warning about the same certificate's end is repeated.
const EXPIRY_REMINDER: Duration = Duration::from_secs(86_400);

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
/// client CA signed ([`CertificateFiles::server_config_verifying_clients`]).
pub use vgpu_served::ClientCertified;

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
    /// The end of the first certificate of the chain (the one served).
    not_after: Result<i64, ValidityError>,
}

/// How near its end the served certificate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ExpiryStanding {
    /// More than the warning's allowance left.
    Valid,
    /// Ends within the allowance: clients will refuse it then.
    EndingSoon,
    /// Its end has passed: clients that check it refuse it now.
    Ended,
}

/// Where a certificate ending at `not_after` (Unix seconds) stands at
/// `now`, warned about `warn_before` its end.
pub fn expiry_standing(not_after: i64, now: i64, warn_before: Duration) -> ExpiryStanding {
    let allowance = i64::try_from(warn_before.as_secs()).unwrap_or(i64::MAX);
    if now >= not_after {
        ExpiryStanding::Ended
    } else if not_after.saturating_sub(now) <= allowance {
        ExpiryStanding::EndingSoon
    } else {
        ExpiryStanding::Valid
    }
}

/// What the log last said about the served certificate's end.
struct ExpiryReported {
    cert_pem: Vec<u8>,
    standing: ExpiryStanding,
    at: Instant,
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
        let not_after = served_not_after(&certified);
        Ok(Arc::new(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: RwLock::new(Loaded {
                cert_pem,
                key_pem,
                certified,
                not_after,
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
        let not_after = served_not_after(&certified);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Loaded {
            cert_pem,
            key_pem,
            certified,
            not_after,
        };
        Ok(true)
    }

    /// When the certificate served now ends, in Unix seconds; `None` when
    /// its validity could not be read.
    pub fn not_after_unix(&self) -> Option<i64> {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        current.not_after.as_ref().ok().copied()
    }

    /// Says in the log when the certificate served now ends, or why that
    /// cannot be read.
    pub fn log_validity(&self) {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        match &current.not_after {
            Ok(not_after) => tracing::info!(
                "TLS certificate {} valid until {} ({} days from now)",
                self.cert.display(),
                timestamp(*not_after),
                not_after.saturating_sub(unix_now()) / 86_400
            ),
            Err(error) => tracing::warn!(
                error = error as &dyn std::error::Error,
                "TLS certificate {}: its end date cannot be read, so no warning will come before it expires",
                self.cert.display()
            ),
        }
    }

    /// Warns when the served certificate ends within `warn_before` or has
    /// ended: when it first does, and again every day while it is served.
    fn report_expiry(&self, warn_before: Duration, last: &mut Option<ExpiryReported>) {
        let current = self.current.read().unwrap_or_else(PoisonError::into_inner);
        let Ok(not_after) = current.not_after else {
            return;
        };
        let standing = expiry_standing(not_after, unix_now(), warn_before);
        if !warn_now(last.as_ref(), &current.cert_pem, standing) {
            if last
                .as_ref()
                .is_none_or(|last| last.cert_pem != current.cert_pem)
            {
                *last = Some(ExpiryReported {
                    cert_pem: current.cert_pem.clone(),
                    standing,
                    at: Instant::now(),
                });
            }
            return;
        }
        let when = timestamp(not_after);
        match standing {
            ExpiryStanding::Ended => tracing::error!(
                "TLS certificate {} expired at {when}: clients that check it (the API server calling the webhooks) refuse it; renew it (the chart's: helm upgrade)",
                self.cert.display()
            ),
            _ => tracing::warn!(
                "TLS certificate {} expires at {when}, in {} days: renew it before then (the chart's: helm upgrade)",
                self.cert.display(),
                not_after.saturating_sub(unix_now()) / 86_400
            ),
        }
        *last = Some(ExpiryReported {
            cert_pem: current.cert_pem.clone(),
            standing,
            at: Instant::now(),
        });
    }

    /// Runs until the runtime stops: [`CertificateFiles::reload`] every
    /// `period`, saying in the log what changed, and naming a pair it
    /// cannot use once (it keeps serving the one before); warns when the
    /// served certificate ends within `warn_before`.
    pub async fn keep_reloading(self: Arc<Self>, period: Duration, warn_before: Duration) {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut expiry_reported = None;
        self.report_expiry(warn_before, &mut expiry_reported);
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
                    self.log_validity();
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
            self.report_expiry(warn_before, &mut expiry_reported);
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

/// Whether a certificate (`cert_pem`) standing so is to be warned about
/// now, the log having said `last` before: when it first ends soon or
/// ends, and again each [`EXPIRY_REMINDER`] after.
fn warn_now(last: Option<&ExpiryReported>, cert_pem: &[u8], standing: ExpiryStanding) -> bool {
    match last {
        Some(last) if last.cert_pem == cert_pem => {
            standing > last.standing
                || (standing > ExpiryStanding::Valid && last.at.elapsed() >= EXPIRY_REMINDER)
        }
        _ => standing > ExpiryStanding::Valid,
    }
}

/// The end of the certificate `certified` presents (the chain's first).
fn served_not_after(certified: &CertifiedKey) -> Result<i64, ValidityError> {
    let served = certified.cert.first().ok_or(ValidityError::Truncated)?;
    not_after_unix(served.as_ref())
}

fn unix_now() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
}

/// Unix seconds as an RFC 3339 time (UTC), or the number when out of range.
fn timestamp(unix: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(unix)
        .map(|at| at.to_string())
        .unwrap_or_else(|_| format!("Unix time {unix}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(cert_pem: &[u8], standing: ExpiryStanding, ago: Duration) -> ExpiryReported {
        ExpiryReported {
            cert_pem: cert_pem.to_vec(),
            standing,
            at: Instant::now()
                .checked_sub(ago)
                .expect("an instant that long ago"),
        }
    }

    #[test]
    fn an_ending_certificate_is_warned_about_once_a_day_and_when_it_ends() {
        use ExpiryStanding::*;
        let hour = Duration::from_secs(3_600);
        // Nothing said yet, or another certificate before.
        assert!(!warn_now(None, b"a", Valid));
        assert!(warn_now(None, b"a", EndingSoon));
        assert!(warn_now(
            Some(&reported(b"old", Valid, hour)),
            b"a",
            EndingSoon
        ));
        // The same certificate: not again within a day, unless it ended.
        let warned = reported(b"a", EndingSoon, hour);
        assert!(!warn_now(Some(&warned), b"a", EndingSoon));
        assert!(warn_now(Some(&warned), b"a", Ended));
        assert!(warn_now(
            Some(&reported(b"a", EndingSoon, 25 * hour)),
            b"a",
            EndingSoon
        ));
        assert!(!warn_now(Some(&reported(b"a", Ended, hour)), b"a", Ended));
        // A renewed certificate far from its end: nothing to say.
        assert!(!warn_now(
            Some(&reported(b"a", Ended, 25 * hour)),
            b"b",
            Valid
        ));
    }

    #[test]
    fn standing_is_judged_against_the_allowance() {
        let day = 86_400;
        let allowance = Duration::from_secs(30 * 86_400);
        for (now, expected) in [
            (69, ExpiryStanding::Valid),
            (70, ExpiryStanding::EndingSoon),
            (100, ExpiryStanding::Ended),
            (101, ExpiryStanding::Ended),
        ] {
            assert_eq!(
                expiry_standing(100 * day, now * day, allowance),
                expected,
                "day {now}"
            );
        }
        assert_eq!(
            expiry_standing(i64::MAX, 0, Duration::MAX),
            ExpiryStanding::EndingSoon
        );
    }
}
