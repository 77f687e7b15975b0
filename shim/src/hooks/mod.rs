//! The implementations of the hooked driver and NVML functions.
//!
//! Each is named after the driver function it replaces, declared with that
//! function's C signature in [`crate::driver`] (which exports it under the
//! driver's symbol and checks the signature), and receives the real
//! function first, as a [`vgpu_interpose::Real`]. Each has the same three
//! behaviours: forward (nothing configured), enforce, or refuse
//! (configuration unusable).

mod context;
mod info;
mod launch;
mod memory;
mod module;
mod nvml;
mod procaddr;

pub(crate) use context::*;
pub(crate) use info::*;
pub(crate) use launch::*;
pub(crate) use memory::*;
pub(crate) use module::*;
pub(crate) use nvml::*;
pub(crate) use procaddr::*;

/// Reads an out-parameter the driver has just written, or 0 if the caller
/// passed null (the driver then failed the call anyway).
///
/// # Safety
/// `pointer` must be null or valid for reads.
unsafe fn written<T: Copy + Into<u64>>(pointer: *const T) -> u64 {
    // SAFETY: null or valid per the caller.
    unsafe { pointer.as_ref() }
        .map(|value| (*value).into())
        .unwrap_or(0)
}

/// Like [`written`] for pointer-typed handles.
///
/// # Safety
/// `pointer` must be null or valid for reads.
unsafe fn written_handle<T>(pointer: *const *mut T) -> u64 {
    // SAFETY: null or valid per the caller.
    unsafe { pointer.as_ref() }
        .map(|value| *value as u64)
        .unwrap_or(0)
}
