//! Device memory: every way the driver API hands out device memory is
//! charged to the container before the driver is asked, and every way it is
//! given back returns the charge.

use super::out::{written, written_handle};
use crate::driver::cuda as real;
use crate::driver::cuda::signature;
use crate::enforcer::{current_context, mode, Enforcer, Mode};
use crate::table::{Charge, Resource};
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;
use vgpu_node_contract::region::MemoryKind;

/// Pitch alignment assumed before the driver reports the real pitch. Real
/// devices align pitched rows to at most 512 bytes.
const PITCH_ALIGNMENT_BOUND: u64 = 512;

/// Allocates through `allocate` in the current context, charging `bytes`.
fn allocate_in_context(
    kind: MemoryKind,
    resource: Resource,
    bytes: u64,
    allocate: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    match mode() {
        Mode::Passthrough => allocate().0,
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => match current_context() {
            // No context: the driver will refuse the call with its own error.
            None => allocate().0,
            Some((device, context)) => {
                let charge = Charge {
                    device,
                    kind,
                    bytes,
                    context,
                    pool: 0,
                    host: 0,
                };
                enforcer.charged(charge, resource, allocate)
            }
        },
    }
}

/// Frees through `free`, returning the charge of `resource` `id`.
fn free_resource(resource: Resource, id: u64, free: impl FnOnce() -> CUresult) -> CUresult {
    match mode() {
        Mode::Enforce(enforcer) => enforcer.uncharged(resource, id, free),
        Mode::Passthrough | Mode::FailClosed => free(),
    }
}

#[inline(always)]
pub(crate) unsafe fn cuMemAlloc_v2(
    driver: Real<signature::cuMemAlloc_v2>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
) -> CUresult {
    let allocate = || {
        // SAFETY: forwarded unchanged; `dptr` is written on success.
        let code = unsafe { (driver.call)(dptr, bytes) };
        // SAFETY: the caller's out-pointer.
        (code, unsafe { written(dptr) })
    };
    if let Mode::Enforce(enforcer) = mode() {
        // Swap is off unless oversubscription is configured: do not
        // ask the driver for the context twice on the common path.
        let spill_device = enforcer
            .config
            .oversubscribe
            .then(current_context)
            .flatten();
        if let Some((device, context)) = spill_device {
            if enforcer.may_spill(device) {
                return allocate_or_spill(enforcer, device, context, dptr, bytes as u64, allocate);
            }
        }
    }
    allocate_in_context(
        MemoryKind::Data,
        Resource::DevicePointer,
        bytes as u64,
        allocate,
    )
}

// ---- Host-memory swap (`CUDA_OVERSUBSCRIBE`) ----
//
// An allocation that does not fit under the cap, or that the device cannot
// hold because other tenants use it, is served from page-locked host memory
// mapped into the device's address space (`cuMemHostAlloc` with
// `DEVICEMAP`): with unified addressing its device pointer is its host
// address, kernels and copies use it like device memory, and the driver
// answers pointer queries truthfully (memory type: host). Pinned host memory
// was chosen over managed memory advised to stay on the host because its
// pages can never migrate onto the device (device-resident bytes stay under
// the cap whatever the access pattern) and device access costs no page
// faults; the price is that it is locked host memory, bounded by the swap
// allowance.

/// `cuMemHostAlloc` flags: usable from every context, mapped for the device.
const SPILL_FLAGS: u32 = 0x01 | 0x02;

fn allocate_or_spill(
    enforcer: &Enforcer,
    device: usize,
    context: usize,
    dptr: *mut CUdeviceptr,
    bytes: u64,
    allocate: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    let charge = Charge {
        device,
        kind: MemoryKind::Data,
        bytes,
        context,
        pool: 0,
        host: 0,
    };
    match enforcer.try_reserve(device, MemoryKind::Data, bytes) {
        Ok(()) => {
            let (code, address) = allocate();
            if code == CUDA_SUCCESS {
                enforcer
                    .table
                    .insert(Resource::DevicePointer, address, charge);
                return code;
            }
            enforcer.release(device, MemoryKind::Data, bytes);
            if code != CUDA_ERROR_OUT_OF_MEMORY {
                return code;
            }
        }
        Err(CUDA_ERROR_OUT_OF_MEMORY) => {}
        Err(code) => return code,
    }
    spill(enforcer, charge, dptr)
}

fn spill(enforcer: &Enforcer, mut charge: Charge, dptr: *mut CUdeviceptr) -> CUresult {
    if dptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let Err(code) = enforcer.reserve_swap(charge.device, charge.bytes) {
        return code;
    }
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the current context is the allocation's.
    let code = unsafe { real::cuMemHostAlloc(&mut host, charge.bytes as usize, SPILL_FLAGS) };
    if code != CUDA_SUCCESS {
        enforcer.release_charge(Resource::SpilledPointer, &charge);
        return code;
    }
    let mut address: CUdeviceptr = 0;
    // SAFETY: `host` was just allocated with DEVICEMAP; valid out-pointer.
    let code = unsafe { real::cuMemHostGetDevicePointer_v2(&mut address, host, 0) };
    if code != CUDA_SUCCESS {
        // SAFETY: our own allocation, not handed out.
        unsafe { real::cuMemFreeHost(host) };
        enforcer.release_charge(Resource::SpilledPointer, &charge);
        return code;
    }
    charge.host = host as usize;
    enforcer
        .table
        .insert(Resource::SpilledPointer, address, charge);
    tracing::debug!(
        device = charge.device,
        bytes = charge.bytes,
        "allocation served from host memory"
    );
    // SAFETY: checked non-null; the caller's out-pointer.
    unsafe { *dptr = address };
    CUDA_SUCCESS
}

/// Frees `dptr` if it is a spilled allocation (after `before`, which must
/// succeed); `None` if it is not one.
fn free_if_spilled(dptr: CUdeviceptr, before: impl FnOnce() -> CUresult) -> Option<CUresult> {
    let Mode::Enforce(enforcer) = mode() else {
        return None;
    };
    if !enforcer.config.oversubscribe {
        return None;
    }
    let charge = enforcer.table.get(Resource::SpilledPointer, dptr)?;
    let code = before();
    if code != CUDA_SUCCESS {
        return Some(code);
    }
    // SAFETY: the host allocation made by `spill` for this pointer.
    let code = unsafe { real::cuMemFreeHost(charge.host as *mut std::ffi::c_void) };
    if code == CUDA_SUCCESS
        && enforcer
            .table
            .remove(Resource::SpilledPointer, dptr)
            .is_some()
    {
        enforcer.release_charge(Resource::SpilledPointer, &charge);
    }
    Some(code)
}

#[inline(always)]
pub(crate) unsafe fn cuMemAllocManaged(
    driver: Real<signature::cuMemAllocManaged>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    flags: u32,
) -> CUresult {
    allocate_in_context(
        MemoryKind::Data,
        Resource::DevicePointer,
        bytes as u64,
        || {
            // SAFETY: forwarded unchanged.
            let code = unsafe { (driver.call)(dptr, bytes, flags) };
            // SAFETY: the caller's out-pointer.
            (code, unsafe { written(dptr) })
        },
    )
}

#[inline(always)]
pub(crate) unsafe fn cuMemAllocPitch_v2(
    driver: Real<signature::cuMemAllocPitch_v2>,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_bytes: u32,
) -> CUresult {
    let allocate = || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(dptr, pitch, width, height, element_bytes) }
    };
    let Mode::Enforce(enforcer) = mode() else {
        return match mode() {
            Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
            _ => allocate(),
        };
    };
    let Some((device, context)) = current_context() else {
        return allocate();
    };
    // Reserve an upper bound, then settle on the real pitch x height.
    let bound = (width as u64)
        .div_ceil(PITCH_ALIGNMENT_BOUND)
        .saturating_mul(PITCH_ALIGNMENT_BOUND)
        .saturating_mul(height as u64);
    if let Err(code) = enforcer.reserve(device, MemoryKind::Data, bound) {
        return code;
    }
    let code = allocate();
    if code != CUDA_SUCCESS {
        enforcer.release(device, MemoryKind::Data, bound);
        return code;
    }
    // SAFETY: both out-pointers were written by the successful call.
    let (address, real_pitch) = unsafe { (written(dptr), pitch.as_ref().copied().unwrap_or(0)) };
    let actual = (real_pitch as u64).saturating_mul(height as u64);
    enforcer.recharge(device, MemoryKind::Data, bound, actual);
    let charge = Charge {
        device,
        kind: MemoryKind::Data,
        bytes: actual,
        context,
        pool: 0,
        host: 0,
    };
    enforcer
        .table
        .insert(Resource::DevicePointer, address, charge);
    code
}

#[inline(always)]
pub(crate) unsafe fn cuMemFree_v2(
    driver: Real<signature::cuMemFree_v2>,
    dptr: CUdeviceptr,
) -> CUresult {
    if let Some(code) = free_if_spilled(dptr, || CUDA_SUCCESS) {
        return code;
    }
    // SAFETY: forwarded unchanged.
    free_resource(Resource::DevicePointer, dptr, || unsafe {
        (driver.call)(dptr)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMemCreate(
    driver: Real<signature::cuMemCreate>,
    handle: *mut CUmemGenericAllocationHandle,
    bytes: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let create = || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(handle, bytes, prop, flags) }
    };
    // SAFETY: `prop` is null or points to the caller's description.
    let location = unsafe { prop.as_ref() }.map(|p| p.location);
    match (mode(), location) {
        (Mode::FailClosed, _) => CUDA_ERROR_NOT_INITIALIZED,
        (Mode::Enforce(enforcer), Some(location))
            if location.type_ == CU_MEM_LOCATION_TYPE_DEVICE && location.id >= 0 =>
        {
            let charge = Charge {
                device: location.id as usize,
                kind: MemoryKind::Data,
                bytes: bytes as u64,
                context: 0,
                pool: 0,
                host: 0,
            };
            enforcer.charged(charge, Resource::PhysicalHandle, || {
                let code = create();
                // SAFETY: the caller's out-pointer.
                (code, unsafe { written(handle) })
            })
        }
        // Host-located physical memory is not device memory.
        _ => create(),
    }
}

#[inline(always)]
pub(crate) unsafe fn cuMemRelease(
    driver: Real<signature::cuMemRelease>,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    free_resource(Resource::PhysicalHandle, handle, || unsafe {
        (driver.call)(handle)
    })
}

// ---- Arrays ----

fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: CUarray_format,
    channels: u32,
) -> u64 {
    // Formats we cannot size exactly (block-compressed, video) are charged
    // at 4 bytes per channel element.
    let element = array_format_bytes(format).unwrap_or(4);
    (width.max(1) as u64)
        .saturating_mul(height.max(1) as u64)
        .saturating_mul(depth.max(1) as u64)
        .saturating_mul(element)
        .saturating_mul(channels.max(1) as u64)
}

#[inline(always)]
pub(crate) unsafe fn cuArrayCreate_v2(
    driver: Real<signature::cuArrayCreate_v2>,
    array: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    // SAFETY: `desc` is null or the caller's descriptor.
    let bytes = unsafe { desc.as_ref() }
        .map(|d| array_bytes(d.width, d.height, 1, d.format, d.num_channels))
        .unwrap_or(0);
    allocate_in_context(MemoryKind::Data, Resource::Array, bytes, || {
        // SAFETY: forwarded unchanged.
        let code = unsafe { (driver.call)(array, desc) };
        // SAFETY: the caller's out-pointer.
        (code, unsafe { written_handle(array) })
    })
}

#[inline(always)]
pub(crate) unsafe fn cuArray3DCreate_v2(
    driver: Real<signature::cuArray3DCreate_v2>,
    array: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    // SAFETY: `desc` is null or the caller's descriptor.
    let bytes = unsafe { desc.as_ref() }
        .map(|d| array_bytes(d.width, d.height, d.depth, d.format, d.num_channels))
        .unwrap_or(0);
    allocate_in_context(MemoryKind::Data, Resource::Array, bytes, || {
        // SAFETY: forwarded unchanged.
        let code = unsafe { (driver.call)(array, desc) };
        // SAFETY: the caller's out-pointer.
        (code, unsafe { written_handle(array) })
    })
}

#[inline(always)]
pub(crate) unsafe fn cuArrayDestroy(
    driver: Real<signature::cuArrayDestroy>,
    array: CUarray,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    free_resource(Resource::Array, array as u64, || unsafe {
        (driver.call)(array)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMipmappedArrayCreate(
    driver: Real<signature::cuMipmappedArrayCreate>,
    array: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    // SAFETY: `desc` is null or the caller's descriptor.
    let bytes = unsafe { desc.as_ref() }
        .map(|d| {
            (0..levels.min(32)).fold(0u64, |total, level| {
                let shrink = |extent: usize| {
                    if extent == 0 {
                        0
                    } else {
                        (extent >> level).max(1)
                    }
                };
                total.saturating_add(array_bytes(
                    shrink(d.width),
                    shrink(d.height),
                    shrink(d.depth),
                    d.format,
                    d.num_channels,
                ))
            })
        })
        .unwrap_or(0);
    allocate_in_context(MemoryKind::Data, Resource::Array, bytes, || {
        // SAFETY: forwarded unchanged.
        let code = unsafe { (driver.call)(array, desc, levels) };
        // SAFETY: the caller's out-pointer.
        (code, unsafe { written_handle(array) })
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMipmappedArrayDestroy(
    driver: Real<signature::cuMipmappedArrayDestroy>,
    array: CUmipmappedArray,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    free_resource(Resource::Array, array as u64, || unsafe {
        (driver.call)(array)
    })
}

// ---- Stream-ordered allocator ----
//
// A pool keeps freed memory for reuse, so what it holds on the device is its
// *reserved* size, not the sum of live allocations. The charge of a pool is
// kept equal to the reserved size the driver reports after each allocation,
// free and trim; an allocation is checked against the cap for the growth it
// may cause (its size less what the pool holds unused).

fn pool_allocate(
    enforcer: &Enforcer,
    pool: CUmemoryPool,
    device: usize,
    context: usize,
    bytes: u64,
    dptr: *mut CUdeviceptr,
    allocate: impl FnOnce() -> CUresult,
) -> CUresult {
    enforcer.track_pool(pool, device);
    let growth = bytes.saturating_sub(enforcer.pool_cached_bytes(pool));
    if let Err(code) = enforcer.reserve(device, MemoryKind::Data, growth) {
        return code;
    }
    let code = allocate();
    // Charge the pool what it now holds before dropping the temporary
    // reservation, so the books never show less than the device does.
    enforcer.sync_pool(pool);
    enforcer.release(device, MemoryKind::Data, growth);
    if code == CUDA_SUCCESS {
        // SAFETY: the caller's out-pointer, written on success.
        let address = unsafe { written(dptr) };
        let charge = Charge {
            device,
            kind: MemoryKind::Data,
            bytes: 0,
            context,
            pool: pool as usize,
            host: 0,
        };
        enforcer
            .table
            .insert(Resource::DevicePointer, address, charge);
    }
    code
}

fn alloc_async(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    allocate: impl FnOnce() -> CUresult,
) -> CUresult {
    match mode() {
        Mode::Passthrough => allocate(),
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => {
            let Some((device, context)) = current_context() else {
                return allocate();
            };
            let mut pool: CUmemoryPool = std::ptr::null_mut();
            // SAFETY: valid out-pointer and the current device.
            if unsafe { real::cuDeviceGetMemPool(&mut pool, device as CUdevice) } != CUDA_SUCCESS {
                return allocate();
            }
            pool_allocate(
                enforcer,
                pool,
                device,
                context,
                bytes as u64,
                dptr,
                allocate,
            )
        }
    }
}

fn alloc_from_pool(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: CUmemoryPool,
    allocate: impl FnOnce() -> CUresult,
) -> CUresult {
    match mode() {
        Mode::Passthrough => allocate(),
        Mode::FailClosed => CUDA_ERROR_NOT_INITIALIZED,
        Mode::Enforce(enforcer) => {
            let Some((current_device, context)) = current_context() else {
                return allocate();
            };
            // A pool we saw created knows its device; otherwise assume the
            // current one.
            let device = enforcer
                .table
                .get(Resource::Pool, pool as u64)
                .map(|charge| charge.device)
                .unwrap_or(current_device);
            pool_allocate(
                enforcer,
                pool,
                device,
                context,
                bytes as u64,
                dptr,
                allocate,
            )
        }
    }
}

#[inline(always)]
pub(crate) unsafe fn cuMemAllocAsync(
    driver: Real<signature::cuMemAllocAsync>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    alloc_async(dptr, bytes, || unsafe {
        (driver.call)(dptr, bytes, stream)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMemAllocFromPoolAsync(
    driver: Real<signature::cuMemAllocFromPoolAsync>,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    alloc_from_pool(dptr, bytes, pool, || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(dptr, bytes, pool, stream) }
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMemFreeAsync(
    driver: Real<signature::cuMemFreeAsync>,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> CUresult {
    // Host memory cannot be freed in stream order: wait for the stream's
    // earlier work (which may still use the buffer), then free it.
    let wait = || {
        // SAFETY: the caller's stream, synchronized the way the called
        // variant names it.
        unsafe {
            if driver.per_thread {
                real::cuStreamSynchronize_ptsz(stream)
            } else {
                real::cuStreamSynchronize(stream)
            }
        }
    };
    if let Some(code) = free_if_spilled(dptr, wait) {
        return code;
    }
    // SAFETY: forwarded unchanged.
    free_resource(Resource::DevicePointer, dptr, || unsafe {
        (driver.call)(dptr, stream)
    })
}

#[inline(always)]
pub(crate) unsafe fn cuMemPoolTrimTo(
    driver: Real<signature::cuMemPoolTrimTo>,
    pool: CUmemoryPool,
    keep: usize,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(pool, keep) };
    if let (CUDA_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
        enforcer.sync_pool(pool);
    }
    code
}

#[inline(always)]
pub(crate) unsafe fn cuMemPoolCreate(
    driver: Real<signature::cuMemPoolCreate>,
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(pool, props) };
    if let (CUDA_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
        // SAFETY: `props` was accepted by the driver; `pool` written.
        let (location, created) =
            unsafe { (props.as_ref().map(|p| p.location), written_handle(pool)) };
        if let Some(location) = location {
            if location.type_ == CU_MEM_LOCATION_TYPE_DEVICE && location.id >= 0 {
                enforcer.track_pool(created as CUmemoryPool, location.id as usize);
            }
        }
    }
    code
}

#[inline(always)]
pub(crate) unsafe fn cuMemPoolDestroy(
    driver: Real<signature::cuMemPoolDestroy>,
    pool: CUmemoryPool,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(pool) };
    if let (CUDA_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
        enforcer.forget_pool(pool);
    }
    code
}

fn note_device_pool(code: CUresult, pool: *mut CUmemoryPool, device: CUdevice) -> CUresult {
    if let (CUDA_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
        // SAFETY: written by the successful call.
        let pool = unsafe { written_handle(pool) };
        if pool != 0 && device >= 0 {
            enforcer.track_pool(pool as CUmemoryPool, device as usize);
        }
    }
    code
}

#[inline(always)]
pub(crate) unsafe fn cuDeviceGetDefaultMemPool(
    driver: Real<signature::cuDeviceGetDefaultMemPool>,
    pool: *mut CUmemoryPool,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(pool, device) };
    note_device_pool(code, pool, device)
}

#[inline(always)]
pub(crate) unsafe fn cuDeviceGetMemPool(
    driver: Real<signature::cuDeviceGetMemPool>,
    pool: *mut CUmemoryPool,
    device: CUdevice,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(pool, device) };
    note_device_pool(code, pool, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(100, 0, 0, CU_AD_FORMAT_FLOAT, 4), 1600);
        assert_eq!(array_bytes(16, 16, 4, CU_AD_FORMAT_UNSIGNED_INT8, 1), 1024);
        assert_eq!(array_bytes(8, 8, 0, CU_AD_FORMAT_HALF, 2), 256);
    }
}
