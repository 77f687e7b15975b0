//! The HTTP(S) server in front of the extender and the webhooks.
//!
//! - [`routes`]: every endpoint, timed by [`metrics`], and which listener
//!   serves which.
//! - [`mod@body`]: request bodies read within a size, a time and a budget.
//! - [`clock`]: what a connection is doing (silent, sending headers, idle,
//!   being answered) and how long it may go on doing it.
//! - [`views`]: nvidia-gpu-scheduler's watchable GPU pod and node views.
//! - [`mod@serve`]: a router served on a listener, with a graceful stop,
//!   within connection limits.
//! - [`stall`]: connections whose clients must keep reading what they
//!   asked for.
//! - [`tls`]: the certificate and key for HTTPS, read again when they
//!   change, and warned about before they end.
//! - [`validity`]: when an X.509 certificate ends.

pub mod body;
pub mod clock;
pub mod metrics;
pub mod routes;
pub mod serve;
pub mod stall;
pub mod tls;
pub mod validity;
pub mod views;

pub use routes::{router, Surface};
pub use serve::{serve, serve_with};
pub use tls::{tls_config, CertificateFiles, ServerError};
