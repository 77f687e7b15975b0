//! The HTTP(S) server in front of the extender and the webhooks.
//!
//! - [`routes`]: every endpoint, timed by [`metrics`].
//! - [`views`]: nvidia-gpu-scheduler's watchable GPU pod and node views.
//! - [`mod@serve`]: a router served on a listener, with a graceful stop.
//! - [`tls`]: the certificate and key for HTTPS.

pub mod metrics;
pub mod routes;
pub mod serve;
pub mod tls;
pub mod views;

pub use routes::router;
pub use serve::serve;
pub use tls::{tls_config, ServerError};
