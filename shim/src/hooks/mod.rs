//! Exported replacements for driver and NVML functions.
//!
//! Each hook is `#[no_mangle]` under the driver's exact versioned name, wraps
//! its body in `guarded!`, and has the same three behaviours: forward
//! (nothing configured), enforce, or refuse (configuration unusable).

mod context;
mod info;
mod launch;
mod memory;
mod module;
mod nvml;
mod procaddr;

pub use context::*;
pub use info::*;
pub use launch::*;
pub use memory::*;
pub use module::*;
pub use nvml::*;
pub use procaddr::*;

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
