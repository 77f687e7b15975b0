//! Out-parameters the driver has just written, read back by the hooks.

/// Reads an out-parameter the driver has just written, or 0 if the caller
/// passed null (the driver then failed the call anyway).
///
/// # Safety
/// `pointer` must be null or valid for reads.
pub(super) unsafe fn written<T: Copy + Into<u64>>(pointer: *const T) -> u64 {
    // SAFETY: null or valid per the caller.
    unsafe { pointer.as_ref() }
        .map(|value| (*value).into())
        .unwrap_or(0)
}

/// Like [`written`] for pointer-typed handles.
///
/// # Safety
/// `pointer` must be null or valid for reads.
pub(super) unsafe fn written_handle<T>(pointer: *const *mut T) -> u64 {
    // SAFETY: null or valid per the caller.
    unsafe { pointer.as_ref() }
        .map(|value| *value as u64)
        .unwrap_or(0)
}
