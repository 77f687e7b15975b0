//! The extender over real HTTP against a fake Kubernetes API server.

mod burst;
mod errors;
mod fake_api;
mod harness;
mod policies;
mod rejections;
mod restart;
mod tls;
mod webhook;
