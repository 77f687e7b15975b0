//! The extender over real HTTP against a real Kubernetes API server (one
//! per test), and against the shared fake for the faults only it injects.

mod burst;
mod claims;
mod errors;
mod groups;
mod harness;
mod policies;
mod preempt;
mod rejections;
mod restart;
mod tls;
mod views;
mod webhook;
