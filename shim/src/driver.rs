//! The real CUDA driver and NVML underneath the shim, and the shim's hooks.
//!
//! Each function the shim hooks or calls is declared here once, with its C
//! signature (see `vgpu_interpose::driver_library!` for everything that
//! one line produces). A hooked function's implementation is the function
//! of the same name under [`crate::hooks`]; its signature is checked against
//! the line here at compile time. `twin` names the driver's `_ptsz` variant
//! (per-thread default stream), hooked by the same implementation.

use std::ffi::{c_char, c_void, CStr};
#[allow(unused_imports)]
use vgpu_cuda_abi::cuda::*;
#[allow(unused_imports)]
use vgpu_cuda_abi::nvml::*;
use vgpu_interpose::driver_library;

/// Swaps a real driver address for our hook of the same function, if any.
pub fn redirect_any(address: *mut c_void, name: *const c_char) -> *mut c_void {
    if address.is_null() || name.is_null() {
        return address;
    }
    // SAFETY: the caller passed a NUL-terminated symbol name.
    let name = unsafe { CStr::from_ptr(name) };
    let bytes = name.to_bytes();
    let library = if bytes.starts_with(b"nvml") {
        &nvml::LIBRARY
    } else if bytes.starts_with(b"cu") {
        &cuda::LIBRARY
    } else {
        return address;
    };
    if !library.hooks_name(name) {
        return address;
    }
    library.redirect(address).unwrap_or(address)
}

driver_library! {
    library cuda, sonames ["libcuda.so.1", "libcuda.so"], missing CUDA_ERROR_NOT_SUPPORTED,
        on_panic CUDA_ERROR_UNKNOWN, hooks crate::hooks, resolve crate::dlsym::real_dlsym;
    hooked {
        fn cuInit(flags: u32) -> CUresult;
        fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: i32, flags: u64) -> CUresult;
        fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: i32, flags: u64, status: *mut CUdriverProcAddressQueryResult) -> CUresult;
        fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult;
        fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult;
        fn cuCtxCreate_v2(ctx: *mut CUcontext, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxCreate_v3(ctx: *mut CUcontext, params: *mut c_void, num_params: i32, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxCreate_v4(ctx: *mut CUcontext, params: *mut c_void, flags: u32, device: CUdevice) -> CUresult;
        fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult;
        fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice) -> CUresult;
        fn cuDevicePrimaryCtxRelease(device: CUdevice) -> CUresult; alias cuDevicePrimaryCtxRelease_v2;
        fn cuDevicePrimaryCtxReset(device: CUdevice) -> CUresult; alias cuDevicePrimaryCtxReset_v2;
        fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult;
        fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, element_bytes: u32) -> CUresult;
        fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, flags: u32) -> CUresult;
        fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult;
        fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, bytes: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult;
        fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult;
        fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult; twin cuMemAllocAsync_ptsz;
        fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult; twin cuMemAllocFromPoolAsync_ptsz;
        fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult; twin cuMemFreeAsync_ptsz;
        fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult;
        fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult;
        fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult;
        fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, device: CUdevice) -> CUresult;
        fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, device: CUdevice) -> CUresult;
        fn cuArrayCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult;
        fn cuArray3DCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
        fn cuArrayDestroy(array: CUarray) -> CUresult;
        fn cuMipmappedArrayCreate(array: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> CUresult;
        fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult;
        fn cuModuleLoad(module: *mut CUmodule, path: *const c_char) -> CUresult;
        fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult;
        fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, num_options: u32, options: *mut c_void, values: *mut *mut c_void) -> CUresult;
        fn cuModuleLoadFatBinary(module: *mut CUmodule, image: *const c_void) -> CUresult;
        fn cuModuleUnload(module: CUmodule) -> CUresult;
        fn cuLibraryLoadData(library: *mut CUlibrary, code: *const c_void, jit_options: *mut c_void, jit_values: *mut *mut c_void, jit_count: u32, library_options: *mut c_void, library_values: *mut *mut c_void, library_count: u32) -> CUresult;
        fn cuLibraryLoadFromFile(library: *mut CUlibrary, path: *const c_char, jit_options: *mut c_void, jit_values: *mut *mut c_void, jit_count: u32, library_options: *mut c_void, library_values: *mut *mut c_void, library_count: u32) -> CUresult;
        fn cuLibraryUnload(library: CUlibrary) -> CUresult;
        fn cuLaunchKernel(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult; twin cuLaunchKernel_ptsz;
        fn cuLaunchKernelEx(config: *const CUlaunchConfig, function: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult; twin cuLaunchKernelEx_ptsz;
        fn cuLaunchCooperativeKernel(function: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shared: u32, stream: CUstream, params: *mut *mut c_void) -> CUresult; twin cuLaunchCooperativeKernel_ptsz;
        fn cuLaunchCooperativeKernelMultiDevice(launches: *mut CUDA_LAUNCH_PARAMS, count: u32, flags: u32) -> CUresult;
        fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult; twin cuGraphLaunch_ptsz;
        fn cuStreamBeginCapture(stream: CUstream) -> CUresult; twin cuStreamBeginCapture_ptsz;
        fn cuStreamBeginCapture_v2(stream: CUstream, mode: i32) -> CUresult; twin cuStreamBeginCapture_v2_ptsz;
        fn cuStreamBeginCaptureToGraph(stream: CUstream, graph: CUgraph, dependencies: *const CUgraphNode, edges: *const c_void, count: usize, mode: i32) -> CUresult; twin cuStreamBeginCaptureToGraph_ptsz;
        fn cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph) -> CUresult; twin cuStreamEndCapture_ptsz;
    }
    used {
        fn cuEventCreate(event: *mut CUevent, flags: u32) -> CUresult;
        fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult;
        fn cuEventRecord_ptsz(event: CUevent, stream: CUstream) -> CUresult;
        fn cuEventQuery(event: CUevent) -> CUresult;
        fn cuEventElapsedTime(milliseconds: *mut f32, start: CUevent, end: CUevent) -> CUresult;
        fn cuEventDestroy_v2(event: CUevent) -> CUresult;
        fn cuStreamIsCapturing(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CUresult;
        fn cuStreamIsCapturing_ptsz(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CUresult;
        fn cuStreamGetCtx(stream: CUstream, context: *mut CUcontext) -> CUresult;
        fn cuStreamQuery(stream: CUstream) -> CUresult;
        fn cuStreamSynchronize(stream: CUstream) -> CUresult;
        fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult;
        fn cuMemHostAlloc(pointer: *mut *mut c_void, bytes: usize, flags: u32) -> CUresult;
        fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, pointer: *mut c_void, flags: u32) -> CUresult;
        fn cuMemFreeHost(pointer: *mut c_void) -> CUresult;
        fn cuStreamQuery_ptsz(stream: CUstream) -> CUresult;
        fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult;
        fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult;
        fn cuDeviceGetCount(count: *mut i32) -> CUresult;
        fn cuDeviceGetUuid(uuid: *mut CUuuid, device: CUdevice) -> CUresult;
        fn cuMemPoolGetAttribute(pool: CUmemoryPool, attribute: CUmemPool_attribute, value: *mut c_void) -> CUresult;
    }
}

driver_library! {
    library nvml, sonames ["libnvidia-ml.so.1", "libnvidia-ml.so"], missing NVML_ERROR_FUNCTION_NOT_FOUND,
        on_panic NVML_ERROR_UNKNOWN, hooks crate::hooks, resolve crate::dlsym::real_dlsym;
    hooked {
        fn nvmlInit_v2() -> nvmlReturn_t;
        fn nvmlInitWithFlags(flags: u32) -> nvmlReturn_t;
        fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t;
        fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses_v2(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
        fn nvmlDeviceGetComputeRunningProcesses_v3(device: nvmlDevice_t, count: *mut u32, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    }
    used {
        fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: u32) -> nvmlReturn_t;
        fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut u32) -> nvmlReturn_t;
        fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t;
    }
}
