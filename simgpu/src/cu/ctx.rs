//! Contexts, the per-thread context stack and primary contexts.

use std::ffi::{c_int, c_uint, c_void};

use vgpu_cuda_abi::cuda::*;

use super::out;
use crate::config::Config;
use crate::driver::{
    self, charge, check_device, check_init, lock, shared, uncharge, Inner, Primary,
};

fn create(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let d = check_device(cfg, dev)?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let handle = lock().create_context(cfg, d, flags, false)?;
    driver::push_current(handle);
    // SAFETY: C API out-pointer (checked non-NULL above).
    unsafe { out(pctx, handle as CUcontext) }
}

cuda_fn! {
    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create(pctx, flags, dev)
    }
}

cuda_fn! {
    /// Execution-affinity parameters are accepted and ignored.
    fn cuCtxCreate_v3(
        pctx: *mut CUcontext,
        params: *mut c_void,
        num_params: c_int,
        flags: c_uint,
        dev: CUdevice,
    ) {
        let _ = (params, num_params);
        create(pctx, flags, dev)
    }
}

cuda_fn! {
    /// `CUctxCreateParams` is accepted and ignored.
    fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) {
        let _ = params;
        create(pctx, flags, dev)
    }
}

cuda_fn! {
    fn cuCtxDestroy_v2(ctx: CUcontext) {
        let cfg = check_init()?;
        let handle = ctx as u64;
        let mut inner = lock();
        match inner.contexts.get(&handle) {
            Some(c) if c.active && !c.primary => {}
            _ => return Err(CUDA_ERROR_INVALID_CONTEXT),
        }
        inner.teardown_context(cfg, handle);
        driver::pop_if_current(handle);
        Ok(())
    }
}

cuda_fn! {
    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        check_init()?;
        let top = driver::current_handle().unwrap_or(0);
        // SAFETY: C API out-pointer.
        unsafe { out(pctx, top as CUcontext) }
    }
}

cuda_fn! {
    fn cuCtxSetCurrent(ctx: CUcontext) {
        check_init()?;
        let handle = ctx as u64;
        if handle != 0 {
            lock().ctx(handle)?;
        }
        driver::set_current(handle);
        Ok(())
    }
}

cuda_fn! {
    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        check_init()?;
        let handle = ctx as u64;
        lock().ctx(handle)?;
        driver::push_current(handle);
        Ok(())
    }
}

cuda_fn! {
    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        check_init()?;
        let top = driver::pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: C API out-pointer, non-NULL.
            unsafe { out(pctx, top as CUcontext) }?;
        }
        Ok(())
    }
}

cuda_fn! {
    fn cuCtxGetDevice(device: *mut CUdevice) {
        check_init()?;
        let (_, d) = lock().current()?;
        // SAFETY: C API out-pointer.
        unsafe { out(device, d as CUdevice) }
    }
}

cuda_fn! {
    fn cuCtxGetFlags(flags: *mut c_uint) {
        check_init()?;
        let inner = lock();
        let (h, _) = inner.current()?;
        let f = inner.ctx(h)?.flags;
        // SAFETY: C API out-pointer.
        unsafe { out(flags, f) }
    }
}

cuda_fn! {
    fn cuCtxGetStreamPriorityRange(least: *mut c_int, greatest: *mut c_int) {
        check_init()?;
        lock().current()?;
        if !least.is_null() {
            // SAFETY: C API out-pointer, non-NULL.
            unsafe { out(least, 0) }?;
        }
        if !greatest.is_null() {
            // SAFETY: C API out-pointer, non-NULL.
            unsafe { out(greatest, -5) }?;
        }
        Ok(())
    }
}

/// Waits for all work of a context, then lets its device's pools release
/// memory above their thresholds.
pub fn synchronize_ctx(ctx: u64, device: usize) {
    if driver::wall_timing() {
        let last = lock().ctx_last_seq(ctx);
        if let Some(device_thread) = crate::executor::executor(device) {
            device_thread.wait_for(last);
        }
    } else {
        let deadline = lock().ctx_last_end(ctx);
        driver::wait_until(deadline);
    }
    lock().trim_pools_to_threshold(Some(device));
}

cuda_fn! {
    fn cuCtxSynchronize() {
        check_init()?;
        let (ctx, device) = lock().current()?;
        synchronize_ctx(ctx, device);
        Ok(())
    }
}

fn primary_entry<'a>(inner: &'a mut Inner, cfg: &Config, device: usize) -> &'a mut Primary {
    if inner.primary.len() < cfg.devices {
        inner.primary.resize(cfg.devices, Primary::default());
    }
    &mut inner.primary[device]
}

cuda_fn! {
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = lock();
        let entry = *primary_entry(&mut inner, cfg, d);
        if entry.refcount == 0 {
            if entry.handle == 0 {
                let h = inner.create_context(cfg, d, entry.flags, true)?;
                primary_entry(&mut inner, cfg, d).handle = h;
            } else {
                charge(d, cfg.context_bytes)?;
                if shared()?.count_context(d, true).is_err() {
                    uncharge(d, cfg.context_bytes);
                    return Err(CUDA_ERROR_OPERATING_SYSTEM);
                }
                if let Some(c) = inner.contexts.get_mut(&entry.handle) {
                    c.active = true;
                    c.flags = entry.flags;
                }
            }
        }
        let e = primary_entry(&mut inner, cfg, d);
        e.refcount += 1;
        let handle = e.handle;
        // SAFETY: C API out-pointer (checked non-NULL).
        unsafe { out(pctx, handle as CUcontext) }
    }
}

fn release_primary(dev: CUdevice) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let d = check_device(cfg, dev)?;
    let mut inner = lock();
    let entry = primary_entry(&mut inner, cfg, d);
    if entry.refcount == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    entry.refcount -= 1;
    if entry.refcount == 0 {
        let h = entry.handle;
        inner.teardown_context(cfg, h);
    }
    Ok(())
}

cuda_fn! {
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) {
        release_primary(dev)
    }
}

cuda_fn! {
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        release_primary(dev)
    }
}

fn reset_primary(dev: CUdevice) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let d = check_device(cfg, dev)?;
    let mut inner = lock();
    let entry = primary_entry(&mut inner, cfg, d);
    entry.refcount = 0;
    let h = entry.handle;
    if h != 0 {
        inner.teardown_context(cfg, h);
    }
    Ok(())
}

cuda_fn! {
    fn cuDevicePrimaryCtxReset(dev: CUdevice) {
        reset_primary(dev)
    }
}

cuda_fn! {
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) {
        reset_primary(dev)
    }
}

cuda_fn! {
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        let mut inner = lock();
        let e = *primary_entry(&mut inner, cfg, d);
        // SAFETY: C API out-pointers.
        unsafe {
            out(flags, e.flags)?;
            out(active, c_int::from(e.refcount > 0))
        }
    }
}

fn set_primary_flags(dev: CUdevice, flags: c_uint) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let d = check_device(cfg, dev)?;
    // Scheduling flags (0..=4 | 0x10 blocking sync alias) and LMEM resize.
    if flags & !0x1f != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let e = primary_entry(&mut inner, cfg, d);
    e.flags = flags;
    let h = e.handle;
    if let Some(c) = inner.contexts.get_mut(&h) {
        c.flags = flags;
    }
    Ok(())
}

cuda_fn! {
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) {
        set_primary_flags(dev, flags)
    }
}

cuda_fn! {
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) {
        set_primary_flags(dev, flags)
    }
}
