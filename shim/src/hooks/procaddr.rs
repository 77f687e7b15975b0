//! `cuInit` and `cuGetProcAddress`.
//!
//! `cuGetProcAddress` is asked by name, CUDA version and stream flavour
//! (legacy or per-thread default stream). The real driver decides which
//! variant that means (`cuMemAlloc` at 12.0 is `cuMemAlloc_v2`,
//! `cuLaunchKernel` with the per-thread flag is `cuLaunchKernel_ptsz`) and
//! writes `symbolStatus`; we let it, then swap the returned address for our
//! hook of that very variant if we hook it. Status and return code stay
//! exactly the driver's.

use crate::driver::cuda as real;
use crate::driver::cuda::signature;
use crate::enforcer::{mode, Mode};
use std::ffi::{c_char, c_void};
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;

#[inline(always)]
pub(crate) unsafe fn cuInit(driver: Real<signature::cuInit>, flags: u32) -> CUresult {
    let mode = mode();
    if let Mode::FailClosed = mode {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(flags) };
    if code == CUDA_SUCCESS {
        if let Mode::Enforce(enforcer) = mode {
            enforcer.learn_devices();
            if let Err(code) = enforcer.slot() {
                return code;
            }
        }
    }
    code
}

/// Replaces a just-returned driver address with our hook, if we hook it.
///
/// # Safety
/// `pfn` must be null or valid for reads and writes; `symbol` null or a
/// NUL-terminated string.
unsafe fn redirect_result(
    code: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
) {
    if code != CUDA_SUCCESS || pfn.is_null() {
        return;
    }
    // SAFETY: non-null and valid per the caller's contract with the driver.
    let address = unsafe { *pfn };
    if address.is_null() {
        return;
    }
    let hook = real::LIBRARY.redirect(address);
    if let Some(hook) = hook {
        // SAFETY: as above.
        unsafe { *pfn = hook };
    }
    // Which entry points a runtime or library asks for, and which of them
    // the shim holds, is what tells an unlimited path apart on a new CUDA.
    if tracing::enabled!(tracing::Level::DEBUG) && !symbol.is_null() {
        // SAFETY: checked non-null; NUL-terminated per the caller.
        let name = unsafe { std::ffi::CStr::from_ptr(symbol) }.to_string_lossy();
        tracing::debug!(
            symbol = %name,
            cuda_version,
            flags,
            hooked = hook.is_some(),
            "cuGetProcAddress"
        );
    }
}

#[inline(always)]
pub(crate) unsafe fn cuGetProcAddress(
    driver: Real<signature::cuGetProcAddress>,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
) -> CUresult {
    if let Mode::FailClosed = mode() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(symbol, pfn, cuda_version, flags) };
    // SAFETY: the caller's out-pointer and symbol name.
    unsafe { redirect_result(code, symbol, pfn, cuda_version, flags) };
    code
}

#[inline(always)]
pub(crate) unsafe fn cuGetProcAddress_v2(
    driver: Real<signature::cuGetProcAddress_v2>,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    if let Mode::FailClosed = mode() {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(symbol, pfn, cuda_version, flags, status) };
    // SAFETY: the caller's out-pointer and symbol name.
    unsafe { redirect_result(code, symbol, pfn, cuda_version, flags) };
    code
}
