//! The stream-ordered allocator (memory pools).
//!
//! Device memory backing a pool is *reserved* in 2 MiB chunks and counts as
//! used device memory. `cuMemFreeAsync` returns bytes to the pool (still
//! reserved); reserved bytes above the release threshold (default 0) go back
//! to the device when a stream, event or context is synchronised, and at
//! `cuMemPoolTrimTo`.

use std::ffi::{c_int, c_void};

use vgpu_cuda_abi::cuda::*;

use super::{inp, out};
use crate::driver::{
    check_device, check_init, lock, new_handle, Inner, Pool, RegionKind, StreamRef,
};

cuda_fn! {
    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        let h = lock().default_pool(cfg, d);
        // SAFETY: C API out-pointer.
        unsafe { out(pool, h as CUmemoryPool) }
    }
}

cuda_fn! {
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        let h = lock().current_pool(cfg, d);
        // SAFETY: C API out-pointer.
        unsafe { out(pool, h as CUmemoryPool) }
    }
}

cuda_fn! {
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        let mut inner = lock();
        inner.default_pool(cfg, d);
        match inner.pools.get(&(pool as u64)) {
            Some(p) if p.device == d && !p.destroyed => {}
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        inner.current_pool[d] = Some(pool as u64);
        Ok(())
    }
}

cuda_fn! {
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        let cfg = check_init()?;
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: caller's props struct (NULL rejected).
        let p = unsafe { inp(props) }?;
        if p.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED
            || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let d = check_device(cfg, p.location.id).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let h = new_handle();
        lock().pools.insert(h, Pool::new(d, false));
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(pool, h as CUmemoryPool) }
    }
}

cuda_fn! {
    /// Outstanding allocations keep their chunks until freed.
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        check_init()?;
        let h = pool as u64;
        let mut inner = lock();
        let p = inner.pools.get_mut(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if p.is_default || p.destroyed {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        p.destroyed = true;
        let device = p.device;
        if inner.current_pool.get(device).copied().flatten() == Some(h) {
            inner.current_pool[device] = None;
        }
        inner.trim_pool(h, 0);
        inner.finish_destroyed_pool(h);
        Ok(())
    }
}

cuda_fn! {
    fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) {
        check_init()?;
        let mut inner = lock();
        if !inner.pools.contains_key(&(pool as u64)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        inner.trim_pool(pool as u64, min_bytes_to_keep as u64);
        Ok(())
    }
}

cuda_fn! {
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) {
        check_init()?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = lock();
        let p = inner.pools.get_mut(&(pool as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: (all arms) `value` points to the type the attribute documents.
        unsafe {
            match attr {
                CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
                | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
                | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                    p.reuse[(attr - 1) as usize] = inp(value.cast::<c_int>())?;
                }
                CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => {
                    p.threshold = inp(value.cast::<u64>())?;
                }
                CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => {
                    if inp(value.cast::<u64>())? != 0 {
                        return Err(CUDA_ERROR_INVALID_VALUE);
                    }
                    p.reserved_high = p.reserved;
                }
                CU_MEMPOOL_ATTR_USED_MEM_HIGH => {
                    if inp(value.cast::<u64>())? != 0 {
                        return Err(CUDA_ERROR_INVALID_VALUE);
                    }
                    p.used_high = p.used;
                }
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        Ok(())
    }
}

cuda_fn! {
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) {
        check_init()?;
        let inner = lock();
        let p = inner.pools.get(&(pool as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: (all arms) `value` points to the type the attribute documents.
        unsafe {
            match attr {
                CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES
                | CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
                | CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                    out(value.cast::<c_int>(), p.reuse[(attr - 1) as usize])
                }
                CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => out(value.cast::<u64>(), p.threshold),
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => out(value.cast::<u64>(), p.reserved),
                CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => out(value.cast::<u64>(), p.reserved_high),
                CU_MEMPOOL_ATTR_USED_MEM_CURRENT => out(value.cast::<u64>(), p.used),
                CU_MEMPOOL_ATTR_USED_MEM_HIGH => out(value.cast::<u64>(), p.used_high),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    }
}

/// Stream-ordered allocation is not captured (the real driver makes memory
/// nodes): on a capturing stream it fails and invalidates the capture.
fn refuse_capture(inner: &mut Inner, sref: StreamRef) -> Result<(), CUresult> {
    match inner.capture_of(sref) {
        Some(id) => {
            inner.invalidate_capture(id);
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        }
        None => Ok(()),
    }
}

/// Allocates from `pool` (or the stream device's current pool).
fn alloc_async(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
) -> Result<(), CUresult> {
    let cfg = check_init()?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (sref, ctx, device) = inner.stream(stream)?;
    refuse_capture(&mut inner, sref)?;
    let pool = match pool {
        Some(p) => {
            let h = p as u64;
            match inner.pools.get(&h) {
                Some(p) if p.device == device => h,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        None => inner.current_pool(cfg, device),
    };
    let addr = inner.pool_alloc(cfg, pool, ctx, size as u64)?;
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(dptr, addr) }
}

twin!(cuMemAllocAsync, cuMemAllocAsync_ptsz, (dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) {
    alloc_async(dptr, bytesize, None, stream)
});

twin!(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, (
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) {
    alloc_async(dptr, bytesize, Some(pool), stream)
});

/// Returns a pool allocation to its pool (or frees ordinary device memory).
fn free_async(dptr: CUdeviceptr, stream: CUstream) -> Result<(), CUresult> {
    check_init()?;
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    refuse_capture(&mut inner, sref)?;
    match inner.region_at(dptr).map(|r| r.kind) {
        Some(RegionKind::PoolAlloc { .. } | RegionKind::Device | RegionKind::Managed) => {
            inner.free_region(dptr)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

twin!(cuMemFreeAsync, cuMemFreeAsync_ptsz, (dptr: CUdeviceptr, stream: CUstream) {
    free_async(dptr, stream)
});
