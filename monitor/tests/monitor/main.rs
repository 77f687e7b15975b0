//! The node monitor's integration tests that may share a process, in one
//! test binary: each binary of the release profile costs a thin-LTO link of
//! its own, about 110 s of this project's CI's two cores. `held_mutex`
//! (which counts its process's threads), `contention` and `arbitration`
//! (which measure compute shares) keep binaries of their own.

mod backstop;
#[path = "../common/mod.rs"]
mod common;
mod connections;
mod dashboard;
mod hostile;
mod kubernetes;
mod metrics;
mod prometheus;
mod tampering;
mod unenforced;
