//! What programs are told about device memory: the cap is the size of the
//! device, and what the container holds is what is used.

use crate::driver::cuda as real;
use crate::enforcer::{current_context, mode, Mode};
use vgpu_cuda_abi::cuda::*;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        let code = unsafe { real::cuMemGetInfo_v2(free, total) };
        let Mode::Enforce(enforcer) = mode() else {
            return match mode() {
                Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
                _ => code,
            };
        };
        if code != CUDA_SUCCESS || free.is_null() || total.is_null() {
            return code;
        }
        let Some((device, _)) = current_context() else {
            return code;
        };
        if device >= vgpu_common::region::MAX_DEVICES {
            return code;
        }
        let limit = enforcer.region.device_limit(device);
        if limit == 0 {
            return code;
        }
        // SAFETY: both out-pointers were written by the successful call.
        unsafe {
            let physical_total = *total as u64;
            let physical_free = *free as u64;
            let capped_total = limit.min(physical_total);
            let used = enforcer.region.device_used(device);
            // Never report more free memory than the device really has:
            // other tenants may hold it (libraries size buffers from this).
            let capped_free = capped_total.saturating_sub(used).min(physical_free);
            *total = capped_total as usize;
            *free = capped_free as usize;
        }
        code
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        let code = unsafe { real::cuDeviceTotalMem_v2(bytes, device) };
        match mode() {
            Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
            Mode::Enforce(enforcer)
                if code == CUDA_SUCCESS
                    && !bytes.is_null()
                    && (0..vgpu_common::region::MAX_DEVICES as CUdevice).contains(&device) =>
            {
                let limit = enforcer.region.device_limit(device as usize);
                if limit > 0 {
                    // SAFETY: written by the successful call.
                    unsafe { *bytes = (*bytes as u64).min(limit) as usize };
                }
                code
            }
            _ => code,
        }
    })
}
