//! Device, managed and host memory; copies and fills; pointer queries.

use std::ffi::{c_int, c_uint, c_void};

use vgpu_cuda_abi::cuda::*;

use super::out;
use crate::driver::{check_init, lock, round_up, shared, Inner, NodeOp, Region, RegionKind};

cuda_fn! {
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        check_init()?;
        let (_, device) = lock().current()?;
        let (t, used) = shared()?.memory(device);
        // SAFETY: C API out-pointers.
        unsafe {
            out(free, t.saturating_sub(used) as usize)?;
            out(total, t as usize)
        }
    }
}

fn alloc(dptr: *mut CUdeviceptr, size: u64, kind: RegionKind) -> Result<(), CUresult> {
    let cfg = check_init()?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (ctx, device) = inner.current()?;
    let addr = inner.alloc_device(cfg, ctx, device, size, kind)?;
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(dptr, addr) }
}

cuda_fn! {
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) {
        alloc(dptr, bytesize as u64, RegionKind::Device)
    }
}

cuda_fn! {
    /// Pitch is the width rounded up to 512 bytes; element size 4, 8 or 16.
    fn cuMemAllocPitch_v2(
        dptr: *mut CUdeviceptr,
        pitch: *mut usize,
        width_bytes: usize,
        height: usize,
        element_size: c_uint,
    ) {
        if !matches!(element_size, 4 | 8 | 16) || width_bytes == 0 || height == 0 || pitch.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = round_up(width_bytes as u64, 512);
        let bytes = p.checked_mul(height as u64).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        alloc(dptr, bytes, RegionKind::Device)?;
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(pitch, p as usize) }
    }
}

cuda_fn! {
    /// Managed memory counts as device memory.
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) {
        if flags != CU_MEM_ATTACH_GLOBAL && flags != 0x2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        alloc(dptr, bytesize as u64, RegionKind::Managed)
    }
}

cuda_fn! {
    fn cuMemFree_v2(dptr: CUdeviceptr) {
        check_init()?;
        if dptr == 0 {
            return Ok(());
        }
        let mut inner = lock();
        match inner.region_at(dptr) {
            Some(Region { kind: RegionKind::Host | RegionKind::Mapping { .. }, .. }) | None => {
                Err(CUDA_ERROR_INVALID_VALUE)
            }
            Some(_) => inner.free_region(dptr),
        }
    }
}

fn host_alloc(pp: *mut *mut c_void, size: usize) -> Result<(), CUresult> {
    check_init()?;
    if pp.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (ctx, device) = inner.current()?;
    let span = round_up(size as u64, 4096);
    // SAFETY: a fresh anonymous private mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    inner.regions.insert(
        p as u64,
        Region {
            size: size as u64,
            span,
            kind: RegionKind::Host,
            device,
            ctx,
        },
    );
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(pp, p) }
}

cuda_fn! {
    /// Page-locked host memory: not device memory, not counted.
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) {
        host_alloc(pp, bytesize)
    }
}

cuda_fn! {
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, flags: c_uint) {
        if flags & !0x7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        host_alloc(pp, bytesize)
    }
}

cuda_fn! {
    fn cuMemFreeHost(p: *mut c_void) {
        check_init()?;
        let mut inner = lock();
        match inner.region_at(p as u64) {
            Some(Region { kind: RegionKind::Host, .. }) => inner.free_region(p as u64),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

cuda_fn! {
    fn cuMemHostGetDevicePointer_v2(pdptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        check_init()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = lock();
        match inner.region_containing(p as u64) {
            Some((_, Region { kind: RegionKind::Host, .. })) => {
                // SAFETY: C API out-pointer.
                unsafe { out(pdptr, p as u64) }
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

cuda_fn! {
    fn cuMemGetAddressRange_v2(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) {
        check_init()?;
        let inner = lock();
        let (start, r) = inner
            .region_containing(dptr)
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        if !pbase.is_null() {
            // SAFETY: C API out-pointer, non-NULL.
            unsafe { out(pbase, start) }?;
        }
        if !psize.is_null() {
            // SAFETY: C API out-pointer, non-NULL.
            unsafe { out(psize, r.size as usize) }?;
        }
        Ok(())
    }
}

cuda_fn! {
    fn cuPointerGetAttribute(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr) {
        check_init()?;
        if data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = lock();
        let (start, r) = inner
            .region_containing(ptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let host = r.kind == RegionKind::Host;
        // SAFETY: (all arms) `data` is the caller's buffer for the type the
        // attribute documents; checked non-NULL above.
        unsafe {
            match attribute {
                CU_POINTER_ATTRIBUTE_CONTEXT => out(data.cast::<CUcontext>(), r.ctx as CUcontext),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE => out(
                    data.cast::<c_uint>(),
                    if host { CU_MEMORYTYPE_HOST } else { CU_MEMORYTYPE_DEVICE },
                ),
                CU_POINTER_ATTRIBUTE_DEVICE_POINTER => out(data.cast::<CUdeviceptr>(), ptr),
                CU_POINTER_ATTRIBUTE_HOST_POINTER if host || r.kind == RegionKind::Managed => {
                    out(data.cast::<*mut c_void>(), ptr as *mut c_void)
                }
                CU_POINTER_ATTRIBUTE_IS_MANAGED => {
                    out(data.cast::<u8>(), u8::from(r.kind == RegionKind::Managed))
                }
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => out(data.cast::<c_int>(), r.device as c_int),
                CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => out(data.cast::<CUdeviceptr>(), start),
                CU_POINTER_ATTRIBUTE_RANGE_SIZE => out(data.cast::<usize>(), r.size as usize),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    }
}

/// What one end of a copy may be.
#[derive(Clone, Copy)]
enum End {
    /// Live device-addressable memory.
    Device,
    /// Ordinary host memory (any non-NULL pointer).
    Host,
    /// Unified addressing: either of the above, decided by the address.
    Unified,
}

fn check_end(inner: &Inner, addr: u64, len: u64, end: End) -> Result<(), CUresult> {
    match end {
        End::Device => inner.check_device_range(addr, len),
        End::Host if addr == 0 => Err(CUDA_ERROR_INVALID_VALUE),
        End::Host => Ok(()),
        End::Unified => {
            if inner.region_containing(addr).is_some() || inner.in_device_space(addr) {
                inner.check_device_range(addr, len)
            } else if addr == 0 {
                Err(CUDA_ERROR_INVALID_VALUE)
            } else {
                Ok(())
            }
        }
    }
}

/// The capture sequence of a copy's or fill's stream (`None` for the
/// synchronous calls, which use the default stream).
fn stream_capture(inner: &Inner, stream: Option<CUstream>) -> Result<Option<u64>, CUresult> {
    match stream {
        Some(s) => {
            let (sref, _, _) = inner.stream(s)?;
            Ok(inner.capture_of(sref))
        }
        None => {
            inner.current()?;
            Ok(None)
        }
    }
}

/// Copies `n` bytes at once (the simulated copy engine is instantaneous).
/// On a capturing stream the copy becomes a memcpy node that copies when
/// the graph is launched.
fn copy(
    dst: u64,
    dst_end: End,
    src: u64,
    src_end: End,
    n: usize,
    stream: Option<CUstream>,
) -> Result<(), CUresult> {
    check_init()?;
    let mut inner = lock();
    let capture = stream_capture(&inner, stream)?;
    if n == 0 {
        return Ok(());
    }
    check_end(&inner, dst, n as u64, dst_end)?;
    check_end(&inner, src, n as u64, src_end)?;
    if let Some(id) = capture {
        let op = NodeOp::Memcpy {
            dst,
            src,
            bytes: n as u64,
        };
        return inner.capture_append(id, op);
    }
    copy_now(&inner, dst, src, n)
}

/// A graph's memcpy node, run at launch: both ends are checked again (the
/// memory may have been freed since the capture).
pub(crate) fn replay_copy(inner: &Inner, dst: u64, src: u64, n: u64) -> Result<(), CUresult> {
    check_end(inner, dst, n, End::Unified)?;
    check_end(inner, src, n, End::Unified)?;
    copy_now(inner, dst, src, n as usize)
}

/// Copies checked ranges.
fn copy_now(_inner: &Inner, dst: u64, src: u64, n: usize) -> Result<(), CUresult> {
    // SAFETY: both ranges were checked to be live simulated device memory
    // (host memory of ours) or caller-provided host buffers of `n` bytes;
    // `copy` tolerates overlap. The process lock keeps them from being
    // freed meanwhile.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
    Ok(())
}

twin!(cuMemcpy, cuMemcpy_ptds, (dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
    copy(dst, End::Unified, src, End::Unified, n, None)
});
twin!(cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, (dst: CUdeviceptr, src: *const c_void, n: usize) {
    copy(dst, End::Device, src as u64, End::Host, n, None)
});
twin!(cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, (dst: *mut c_void, src: CUdeviceptr, n: usize) {
    copy(dst as u64, End::Host, src, End::Device, n, None)
});
twin!(cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, (dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
    copy(dst, End::Device, src, End::Device, n, None)
});
twin!(cuMemcpyAsync, cuMemcpyAsync_ptsz, (dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
    copy(dst, End::Unified, src, End::Unified, n, Some(stream))
});
twin!(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz, (dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
    copy(dst, End::Device, src as u64, End::Host, n, Some(stream))
});
twin!(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz, (dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
    copy(dst as u64, End::Host, src, End::Device, n, Some(stream))
});
twin!(cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz, (dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
    copy(dst, End::Device, src, End::Device, n, Some(stream))
});

/// Fills `count` elements of `T` at `dst` with `value`. On a capturing
/// stream the fill becomes a memset node that fills when the graph is
/// launched.
fn fill<T: Copy + Into<u32>>(
    dst: CUdeviceptr,
    value: T,
    count: usize,
    stream: Option<CUstream>,
) -> Result<(), CUresult> {
    check_init()?;
    let mut inner = lock();
    let capture = stream_capture(&inner, stream)?;
    if let Some(id) = capture {
        check_fill::<T>(&inner, dst, count)?;
        let op = NodeOp::Memset {
            dst,
            value: value.into(),
            elem: std::mem::size_of::<T>() as u8,
            count: count as u64,
        };
        return inner.capture_append(id, op);
    }
    fill_now(&inner, dst, value, count)
}

/// A graph's memset node, run at launch.
pub(crate) fn replay_fill(
    inner: &Inner,
    dst: u64,
    value: u32,
    elem: u8,
    count: u64,
) -> Result<(), CUresult> {
    let count = usize::try_from(count).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    match elem {
        1 => fill_now(inner, dst, value as u8, count),
        2 => fill_now(inner, dst, value as u16, count),
        _ => fill_now(inner, dst, value, count),
    }
}

/// Checks a fill's alignment and range.
fn check_fill<T>(inner: &Inner, dst: CUdeviceptr, count: usize) -> Result<(), CUresult> {
    let size = std::mem::size_of::<T>();
    if !dst.is_multiple_of(size as u64) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = count.checked_mul(size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    inner.check_device_range(dst, bytes as u64)
}

/// Fills now, after checking the range.
fn fill_now<T: Copy>(
    inner: &Inner,
    dst: CUdeviceptr,
    value: T,
    count: usize,
) -> Result<(), CUresult> {
    check_fill::<T>(inner, dst, count)?;
    if count == 0 {
        return Ok(());
    }
    // SAFETY: the range is live simulated device memory, aligned for T
    // (checked), and the process lock keeps it alive while we write.
    unsafe { std::slice::from_raw_parts_mut(dst as *mut T, count) }.fill(value);
    Ok(())
}

twin!(cuMemsetD8_v2, cuMemsetD8_v2_ptds, (dst: CUdeviceptr, uc: u8, n: usize) {
    fill(dst, uc, n, None)
});
twin!(cuMemsetD16_v2, cuMemsetD16_v2_ptds, (dst: CUdeviceptr, us: u16, n: usize) {
    fill(dst, us, n, None)
});
twin!(cuMemsetD32_v2, cuMemsetD32_v2_ptds, (dst: CUdeviceptr, ui: c_uint, n: usize) {
    fill(dst, ui, n, None)
});
twin!(cuMemsetD8Async, cuMemsetD8Async_ptsz, (dst: CUdeviceptr, uc: u8, n: usize, stream: CUstream) {
    fill(dst, uc, n, Some(stream))
});
twin!(cuMemsetD16Async, cuMemsetD16Async_ptsz, (dst: CUdeviceptr, us: u16, n: usize, stream: CUstream) {
    fill(dst, us, n, Some(stream))
});
twin!(cuMemsetD32Async, cuMemsetD32Async_ptsz, (dst: CUdeviceptr, ui: c_uint, n: usize, stream: CUstream) {
    fill(dst, ui, n, Some(stream))
});
