//! The HTTP(S) server in front of the extender and the webhooks.
//!
//! - [`routes`]: every endpoint, timed by [`metrics`], and which listener
//!   serves which.
//! - [`mod@body`]: request bodies read within a size, a time and a budget.
//! - [`views`]: nvidia-gpu-scheduler's watchable GPU pod and node views.
//! - [`mod@serve`]: a router served on a listener, with a graceful stop,
//!   within the extender's connection limits ([`vgpu_served`]).
//! - [`tls`]: the certificate and key for HTTPS, read again when they
//!   change, and warned about before they end.
//! - [`validity`]: when an X.509 certificate ends.

pub mod body;
pub mod metrics;
pub mod routes;
pub mod serve;
pub mod tls;
pub mod validity;
pub mod views;

pub use routes::{router, Surface};
pub use serve::{serve, serve_with};
pub use tls::{tls_config, CertificateFiles, ServerError};
