//! CUDA arrays and mipmapped arrays: opaque handles that cost device memory.

use std::ffi::c_uint;

use vgpu_cuda_abi::cuda::*;

use super::{inp, out};
use crate::driver::{charge, check_init, lock, new_handle, uncharge, Array};

/// Bytes of one array level: width × max(height,1) × max(depth,1) × element.
pub fn level_bytes(
    width: u64,
    height: u64,
    depth: u64,
    format: CUarray_format,
    channels: c_uint,
) -> Option<u64> {
    if width == 0 || !matches!(channels, 1 | 2 | 4) {
        return None;
    }
    let element = array_format_bytes(format)?.checked_mul(u64::from(channels))?;
    width
        .checked_mul(height.max(1))?
        .checked_mul(depth.max(1))?
        .checked_mul(element)
}

/// Bytes of a mipmapped array: every level halves each dimension (min 1).
pub fn mipmap_bytes(desc: &CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> Option<u64> {
    if levels == 0 {
        return None;
    }
    let (mut w, mut h, mut d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    let mut total = 0u64;
    for _ in 0..levels {
        total = total.checked_add(level_bytes(w, h, d, desc.format, desc.num_channels)?)?;
        w = (w / 2).max(1);
        h = if h == 0 { 0 } else { (h / 2).max(1) };
        d = if d == 0 { 0 } else { (d / 2).max(1) };
    }
    Some(total)
}

fn create(
    handle: *mut *mut std::ffi::c_void,
    bytes: Option<u64>,
    mipmapped: bool,
) -> Result<(), CUresult> {
    check_init()?;
    if handle.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = bytes.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut inner = lock();
    let (ctx, device) = inner.current()?;
    charge(device, bytes)?;
    let h = new_handle();
    inner.arrays.insert(
        h,
        Array {
            ctx,
            device,
            bytes,
            mipmapped,
        },
    );
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(handle, h as *mut std::ffi::c_void) }
}

fn destroy(handle: u64, mipmapped: bool) -> Result<(), CUresult> {
    check_init()?;
    let mut inner = lock();
    match inner.arrays.get(&handle) {
        Some(a) if a.mipmapped == mipmapped => {}
        _ => return Err(CUDA_ERROR_INVALID_HANDLE),
    }
    if let Some(a) = inner.arrays.remove(&handle) {
        uncharge(a.device, a.bytes);
    }
    Ok(())
}

cuda_fn! {
    fn cuArrayCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        // SAFETY: caller's descriptor (NULL rejected).
        let d = unsafe { inp(desc) }?;
        let bytes = level_bytes(d.width as u64, d.height as u64, 0, d.format, d.num_channels);
        create(handle, bytes, false)
    }
}

cuda_fn! {
    fn cuArray3DCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        // SAFETY: caller's descriptor (NULL rejected).
        let d = unsafe { inp(desc) }?;
        let bytes = level_bytes(d.width as u64, d.height as u64, d.depth as u64, d.format, d.num_channels);
        create(handle, bytes, false)
    }
}

cuda_fn! {
    fn cuArrayDestroy(array: CUarray) {
        destroy(array as u64, false)
    }
}

cuda_fn! {
    fn cuMipmappedArrayCreate(
        handle: *mut CUmipmappedArray,
        desc: *const CUDA_ARRAY3D_DESCRIPTOR,
        num_levels: c_uint,
    ) {
        // SAFETY: caller's descriptor (NULL rejected).
        let d = unsafe { inp(desc) }?;
        create(handle, mipmap_bytes(&d, num_levels), true)
    }
}

cuda_fn! {
    fn cuMipmappedArrayDestroy(array: CUmipmappedArray) {
        destroy(array as u64, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(level_bytes(100, 0, 0, CU_AD_FORMAT_FLOAT, 4), Some(1600));
        assert_eq!(level_bytes(100, 10, 2, CU_AD_FORMAT_HALF, 1), Some(4000));
        assert_eq!(level_bytes(100, 10, 2, 0x99, 1), None);
        assert_eq!(level_bytes(100, 10, 2, CU_AD_FORMAT_FLOAT, 3), None);
        let desc = CUDA_ARRAY3D_DESCRIPTOR {
            width: 8,
            height: 4,
            depth: 0,
            format: CU_AD_FORMAT_UNSIGNED_INT8,
            num_channels: 1,
            flags: 0,
        };
        // 8x4 + 4x2 + 2x1 + 1x1
        assert_eq!(mipmap_bytes(&desc, 4), Some(32 + 8 + 2 + 1));
    }
}
