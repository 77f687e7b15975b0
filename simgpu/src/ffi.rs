//! Helpers for the C ABI: export macros that keep panics inside the library,
//! and safe-ish wrappers around caller-provided pointers.

use std::ffi::{c_char, CStr};

/// Defines an exported CUDA driver entry point.
///
/// The body returns `Result<(), CUresult>`; `Ok` becomes `CUDA_SUCCESS`. A
/// panic becomes `CUDA_ERROR_UNKNOWN`. Every entry point counts its calls in
/// a private static, which also keeps functions with identical bodies from
/// being merged into one address (tests tell variants apart by address).
macro_rules! cuda_fn {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> ::vgpu_cuda_abi::cuda::CUresult {
            static CALLS: ::std::sync::atomic::AtomicU64 = ::std::sync::atomic::AtomicU64::new(0);
            CALLS.fetch_add(1, ::std::sync::atomic::Ordering::Relaxed);
            let run = || -> ::std::result::Result<(), ::vgpu_cuda_abi::cuda::CUresult> { $body };
            match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(run)) {
                Ok(Ok(())) => ::vgpu_cuda_abi::cuda::CUDA_SUCCESS,
                Ok(Err(code)) => code,
                Err(_) => ::vgpu_cuda_abi::cuda::CUDA_ERROR_UNKNOWN,
            }
        }
    };
}

/// Defines a legacy entry point and its per-thread-default-stream twin with
/// the same behaviour (distinct exported functions).
macro_rules! twin {
    ($legacy:ident, $ptds:ident, ($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        cuda_fn! { fn $legacy($($arg: $ty),*) $body }
        cuda_fn! { fn $ptds($($arg: $ty),*) $body }
    };
}

/// Defines an exported NVML entry point; like [`cuda_fn`] with NVML codes.
macro_rules! nvml_fn {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> ::vgpu_cuda_abi::nvml::nvmlReturn_t {
            static CALLS: ::std::sync::atomic::AtomicU64 = ::std::sync::atomic::AtomicU64::new(0);
            CALLS.fetch_add(1, ::std::sync::atomic::Ordering::Relaxed);
            let run = || -> ::std::result::Result<(), ::vgpu_cuda_abi::nvml::nvmlReturn_t> { $body };
            match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(run)) {
                Ok(Ok(())) => ::vgpu_cuda_abi::nvml::NVML_SUCCESS,
                Ok(Err(code)) => code,
                Err(_) => ::vgpu_cuda_abi::nvml::NVML_ERROR_UNKNOWN,
            }
        }
    };
}

/// Writes `value` through a caller-provided out-pointer, or returns `Err(code)`
/// when the pointer is NULL.
///
/// # Safety
/// `ptr` must be NULL or valid for writing one `T` (the C API contract).
pub unsafe fn put<T>(ptr: *mut T, value: T, code: u32) -> Result<(), u32> {
    if ptr.is_null() {
        return Err(code);
    }
    // SAFETY: non-NULL was checked; the caller guarantees `ptr` is writable
    // for one `T`. Unaligned writes keep us safe from sloppy C callers.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Reads a value through a caller-provided pointer, or `Err(code)` for NULL.
///
/// # Safety
/// `ptr` must be NULL or valid for reading one `T`.
pub unsafe fn get<T: Copy>(ptr: *const T, code: u32) -> Result<T, u32> {
    if ptr.is_null() {
        return Err(code);
    }
    // SAFETY: non-NULL was checked; the caller guarantees `ptr` is readable.
    Ok(unsafe { ptr.read_unaligned() })
}

/// Borrows a NUL-terminated C string, `None` for NULL or invalid UTF-8.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string that outlives `'a`.
pub unsafe fn cstr<'a>(ptr: *const c_char) -> Option<&'a str> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-NULL; the caller guarantees NUL termination and lifetime.
    unsafe { CStr::from_ptr(ptr) }.to_str().ok()
}

/// Copies `text` and a terminating NUL into `buf` (`len` bytes).
///
/// With `truncate`, a too-small buffer receives as much as fits (still NUL
/// terminated) and the call succeeds; without, nothing is written and
/// `false` is returned. A NULL buffer or zero length returns `false`.
///
/// # Safety
/// `buf` must be NULL or valid for writing `len` bytes.
pub unsafe fn write_cstr(buf: *mut c_char, len: usize, text: &str, truncate: bool) -> bool {
    if buf.is_null() || len == 0 {
        return false;
    }
    let bytes = text.as_bytes();
    let fits = bytes.len() < len;
    if !fits && !truncate {
        return false;
    }
    let n = bytes.len().min(len - 1);
    // SAFETY: `buf` is writable for `len` bytes and `n + 1 <= len`; the source
    // is a distinct Rust string, so the ranges cannot overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
        buf.add(n).write(0);
    }
    true
}

/// Writes one line to stderr, ignoring failures (stderr may be closed).
pub fn warn(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "simgpu: {line}");
}
