//! The extender over real HTTP against a real Kubernetes API server (one
//! per test), through testkit's fault proxy for the faults a real server
//! shows only by chance.

mod bind_copy;
mod burst;
mod claims;
mod confinement;
mod elastic_claims;
mod errors;
mod groups;
mod harness;
mod hostile;
mod policies;
mod preempt;
mod quotas;
mod rejections;
mod resize;
mod restart;
mod tls;
mod views;
mod webhook;
