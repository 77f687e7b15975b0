//! What programs are told about device memory: the cap is the size of the
//! device, and what the container holds is what is used.

use crate::driver::cuda::signature;
use crate::enforcer::{current_context, mode, Mode};
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;

#[inline(always)]
pub(crate) unsafe fn cuMemGetInfo_v2(
    driver: Real<signature::cuMemGetInfo_v2>,
    free: *mut usize,
    total: *mut usize,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(free, total) };
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
    if device >= vgpu_node_contract::region::MAX_DEVICES {
        return code;
    }
    let limit = enforcer.region.device_limit(device);
    let swap_limit = enforcer.region.device_swap_limit(device);
    if limit == 0 && swap_limit == 0 {
        return code;
    }
    // SAFETY: both out-pointers were written by the successful call.
    unsafe {
        let physical_total = *total as u64;
        let physical_free = *free as u64;
        let (device_total, device_free) = if limit == 0 {
            (physical_total, physical_free)
        } else {
            let capped_total = limit.min(physical_total);
            let used = enforcer.region.device_used(device);
            // Never report more free memory than the device really
            // has: other tenants may hold it (libraries size buffers
            // from this).
            (
                capped_total,
                capped_total.saturating_sub(used).min(physical_free),
            )
        };
        // Host-memory swap is part of what the program may allocate.
        let swap_free = swap_limit.saturating_sub(enforcer.region.device_swap_used(device));
        *total = device_total.saturating_add(swap_limit) as usize;
        *free = device_free.saturating_add(swap_free) as usize;
    }
    code
}

#[inline(always)]
pub(crate) unsafe fn cuDeviceTotalMem_v2(
    driver: Real<signature::cuDeviceTotalMem_v2>,
    bytes: *mut usize,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(bytes, device) };
    match mode() {
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer)
            if code == CUDA_SUCCESS
                && !bytes.is_null()
                && (0..vgpu_node_contract::region::MAX_DEVICES as CUdevice).contains(&device) =>
        {
            let limit = enforcer.region.device_limit(device as usize);
            let swap_limit = enforcer.region.device_swap_limit(device as usize);
            // SAFETY: written by the successful call.
            unsafe {
                let physical = *bytes as u64;
                let device_total = if limit > 0 {
                    physical.min(limit)
                } else {
                    physical
                };
                *bytes = device_total.saturating_add(swap_limit) as usize;
            }
            code
        }
        _ => code,
    }
}
