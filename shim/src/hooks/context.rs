//! Contexts: each one is charged the device memory it holds of its own
//! (code, stacks, printf buffer) that no allocation call shows: the
//! configured reservation (`VGPU_CONTEXT_RESERVE`), or, when none is set,
//! what the first context on a device is measured to hold (see
//! `context_size`).

use super::out::written_handle;
use crate::driver::cuda::signature;
use crate::enforcer::{mode, Enforcer, Mode};
use crate::table::{Charge, Resource};
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;
use vgpu_node_contract::region::MemoryKind;

fn context_charge(enforcer: &Enforcer, device: CUdevice) -> Charge {
    Charge {
        device: device.max(0) as usize,
        kind: MemoryKind::Context,
        bytes: enforcer.context_bytes(device.max(0) as usize),
        context: 0,
        pool: 0,
        host: 0,
    }
}

/// Creates a context through `create`, charging it first.
fn create_context(
    device: CUdevice,
    ctx: *mut CUcontext,
    create: impl FnOnce() -> CUresult,
) -> CUresult {
    match mode() {
        Mode::Passthrough => create(),
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => {
            let mut charge = context_charge(enforcer, device);
            let before = enforcer.before_context(charge.device);
            let mut created = 0;
            let code = enforcer.charged(charge, Resource::Context, || {
                let code = create();
                // SAFETY: `ctx` is the caller's out-pointer, written on success.
                created = unsafe { written_handle(ctx) };
                (code, created)
            });
            if code == CUDA_SUCCESS && before.is_some() {
                let settled = enforcer.settle_context(charge.device, charge.bytes, before);
                if settled != charge.bytes {
                    // Its destruction must return what it is charged now.
                    charge.bytes = settled;
                    enforcer.table.insert(Resource::Context, created, charge);
                }
            }
            code
        }
    }
}

#[inline(always)]
pub(crate) unsafe fn cuCtxCreate_v2(
    driver: Real<signature::cuCtxCreate_v2>,
    ctx: *mut CUcontext,
    flags: u32,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    create_context(device, ctx, || unsafe { (driver.call)(ctx, flags, device) })
}

#[inline(always)]
pub(crate) unsafe fn cuCtxCreate_v3(
    driver: Real<signature::cuCtxCreate_v3>,
    ctx: *mut CUcontext,
    params: *mut std::ffi::c_void,
    num_params: i32,
    flags: u32,
    device: CUdevice,
) -> CUresult {
    create_context(device, ctx, || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(ctx, params, num_params, flags, device) }
    })
}

#[inline(always)]
pub(crate) unsafe fn cuCtxCreate_v4(
    driver: Real<signature::cuCtxCreate_v4>,
    ctx: *mut CUcontext,
    params: *mut std::ffi::c_void,
    flags: u32,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    create_context(device, ctx, || unsafe {
        (driver.call)(ctx, params, flags, device)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuCtxDestroy_v2(
    driver: Real<signature::cuCtxDestroy_v2>,
    ctx: CUcontext,
) -> CUresult {
    match mode() {
        // SAFETY: forwarded unchanged.
        Mode::Passthrough | Mode::FailClosed => unsafe { (driver.call)(ctx) },
        Mode::Enforce(enforcer) => {
            // SAFETY: forwarded unchanged.
            let code = enforcer.uncharged(Resource::Context, ctx as u64, || unsafe {
                (driver.call)(ctx)
            });
            if code == CUDA_SUCCESS {
                // Destroying a context frees everything allocated in it.
                enforcer.release_context_resources(ctx as usize);
            }
            code
        }
    }
}

#[inline(always)]
pub(crate) unsafe fn cuDevicePrimaryCtxRetain(
    driver: Real<signature::cuDevicePrimaryCtxRetain>,
    ctx: *mut CUcontext,
    device: CUdevice,
) -> CUresult {
    match mode() {
        // SAFETY: forwarded unchanged.
        Mode::Passthrough => unsafe { (driver.call)(ctx, device) },
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => {
            let first = enforcer.primary_retained(device.max(0) as usize);
            let charge = context_charge(enforcer, device);
            let mut before = None;
            if first {
                if let Err(code) = enforcer.reserve(charge.device, charge.kind, charge.bytes) {
                    enforcer.primary_retain_failed(charge.device);
                    return code;
                }
                before = enforcer.before_context(charge.device);
            }
            // SAFETY: forwarded unchanged.
            let code = unsafe { (driver.call)(ctx, device) };
            if code == CUDA_SUCCESS {
                if first {
                    // Its release returns `context_bytes`, which this settles.
                    enforcer.settle_context(charge.device, charge.bytes, before);
                }
                // SAFETY: written by the successful call.
                enforcer
                    .note_primary_context(charge.device, unsafe { written_handle(ctx) } as usize);
            } else {
                enforcer.primary_retain_failed(charge.device);
                if first {
                    enforcer.release(charge.device, charge.kind, charge.bytes);
                }
            }
            code
        }
    }
}

/// Common part of the primary-context release and reset hooks.
fn primary_context_gone(device: CUdevice, code: CUresult, reset: bool) -> CUresult {
    if code != CUDA_SUCCESS {
        return code;
    }
    if let Mode::Enforce(enforcer) = mode() {
        let index = device.max(0) as usize;
        let dropped = if reset {
            enforcer.primary_reset(index)
        } else {
            enforcer.primary_released(index)
        };
        if dropped {
            let charge = context_charge(enforcer, device);
            enforcer.release(charge.device, charge.kind, charge.bytes);
            enforcer.primary_context_destroyed(index);
        }
    }
    code
}

#[inline(always)]
pub(crate) unsafe fn cuDevicePrimaryCtxRelease(
    driver: Real<signature::cuDevicePrimaryCtxRelease>,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(device) };
    primary_context_gone(device, code, false)
}

#[inline(always)]
pub(crate) unsafe fn cuDevicePrimaryCtxReset(
    driver: Real<signature::cuDevicePrimaryCtxReset>,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(device) };
    primary_context_gone(device, code, true)
}
