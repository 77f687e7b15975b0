//! Exported CUDA driver API entry points.

pub mod array;
pub mod ctx;
pub mod device;
pub mod graph;
pub mod mem;
pub mod module;
pub mod pool;
pub mod procaddr;
pub mod stream;
pub mod vmm;

use vgpu_cuda_abi::cuda::CUDA_ERROR_INVALID_VALUE;

/// Writes through a CUDA out-pointer (NULL → `CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `ptr` must be NULL or valid for writing one `T`.
pub unsafe fn out<T>(ptr: *mut T, value: T) -> Result<(), u32> {
    // SAFETY: forwarded caller contract.
    unsafe { crate::ffi::put(ptr, value, CUDA_ERROR_INVALID_VALUE) }
}

/// Reads through a CUDA in-pointer (NULL → `CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `ptr` must be NULL or valid for reading one `T`.
pub unsafe fn inp<T: Copy>(ptr: *const T) -> Result<T, u32> {
    // SAFETY: forwarded caller contract.
    unsafe { crate::ffi::get(ptr, CUDA_ERROR_INVALID_VALUE) }
}
