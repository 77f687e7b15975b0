//! Kernel launches. Without a compute cap a launch is forwarded with no
//! work besides loading the real address.

use crate::driver::cuda as real;
use std::ffi::c_void;
use vgpu_cuda_abi::cuda::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    function: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        unsafe {
            real::cuLaunchKernel(
                function, gx, gy, gz, bx, by, bz, shared, stream, params, extra,
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    function: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        unsafe {
            real::cuLaunchKernel_ptsz(
                function, gx, gy, gz, bx, by, bz, shared, stream, params, extra,
            )
        }
    })
}
