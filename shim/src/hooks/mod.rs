//! The implementations of the hooked driver and NVML functions.
//!
//! Each is named after the driver function it replaces, declared with that
//! function's C signature in [`crate::driver`] (which exports it under the
//! driver's symbol and checks the signature), and receives the real
//! function first, as a [`vgpu_interpose::Real`]. Each has the same three
//! behaviours: forward (nothing configured), enforce, or refuse
//! (configuration unusable).

// Every hook is the C function it replaces: its name (`cuMemAlloc_v2`) is
// the driver's, which the declaration in `crate::driver` finds it by, and
// its arguments are the C function's own (eleven for `cuLaunchKernel`),
// checked against that declaration at compile time. Neither can follow
// Rust's naming or be bundled, so both lints are off for all the hooks.
#![allow(non_snake_case, clippy::too_many_arguments)]

mod context;
mod info;
mod launch;
mod memory;
mod module;
mod nvml;
mod out;
mod procaddr;

pub(crate) use context::*;
pub(crate) use info::*;
pub(crate) use launch::*;
pub(crate) use memory::*;
pub(crate) use module::*;
pub(crate) use nvml::*;
pub(crate) use procaddr::*;
