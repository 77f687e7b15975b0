//! The shim's memory tests (caps, and host memory beyond them), in one
//! test binary (each release test binary costs a thin-LTO link of its
//! own). `compute_share`, which measures shares, keeps a binary of its own.

mod memory_cap;
mod node_grant;
mod oversubscribe;
