//! `cuGetProcAddress` and `cuGetProcAddress_v2`, like the real driver.
//!
//! `symbol` is a base name ("cuMemAlloc"). Each base name has variants, each
//! introduced at some CUDA version (cudaTypedefs.h `PFN_*_v<version>`), and
//! some have a per-thread-default-stream twin. The newest variant not newer
//! than `cudaVersion` is returned; flag `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
//! selects its `_ptds`/`_ptsz` twin where one exists.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use vgpu_cuda_abi::cuda::*;

use super::array::*;
use super::ctx::*;
use super::device::*;
use super::graph::*;
use super::mem::*;
use super::module::*;
use super::out;
use super::pool::*;
use super::stream::*;
use super::vmm::*;
use crate::ffi::cstr;

/// One variant of a driver entry point.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    /// CUDA version that introduced it (e.g. 3020 for 3.2).
    pub version: c_int,
    pub legacy: usize,
    pub per_thread: Option<usize>,
}

macro_rules! variants {
    (@opt) => { None };
    (@opt $p:path) => { Some($p as *const () as usize) };
    ($( $name:literal => [ $( ($ver:expr, $f:path $(, $p:path)?) ),+ $(,)? ] ),+ $(,)?) => {{
        let mut m: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        $(
            m.insert($name, vec![ $( Variant {
                version: $ver,
                legacy: $f as *const () as usize,
                per_thread: variants!(@opt $($p)?),
            } ),+ ]);
        )+
        m
    }};
}

/// Base name → variants, for every exported driver function.
pub fn table() -> &'static HashMap<&'static str, Vec<Variant>> {
    static TABLE: OnceLock<HashMap<&'static str, Vec<Variant>>> = OnceLock::new();
    TABLE.get_or_init(|| {
        variants! {
            "cuGetErrorString" => [(6000, cuGetErrorString)],
            "cuGetErrorName" => [(6000, cuGetErrorName)],
            "cuInit" => [(2000, cuInit)],
            "cuDriverGetVersion" => [(2020, cuDriverGetVersion)],
            "cuDeviceGet" => [(2000, cuDeviceGet)],
            "cuDeviceGetCount" => [(2000, cuDeviceGetCount)],
            "cuDeviceGetName" => [(2000, cuDeviceGetName)],
            "cuDeviceGetUuid" => [(9020, cuDeviceGetUuid), (11040, cuDeviceGetUuid_v2)],
            "cuDeviceTotalMem" => [(3020, cuDeviceTotalMem_v2)],
            "cuDeviceGetAttribute" => [(2000, cuDeviceGetAttribute)],
            "cuDeviceComputeCapability" => [(2000, cuDeviceComputeCapability)],
            "cuDeviceGetPCIBusId" => [(4010, cuDeviceGetPCIBusId)],
            "cuDeviceGetByPCIBusId" => [(4010, cuDeviceGetByPCIBusId)],
            "cuDeviceCanAccessPeer" => [(4000, cuDeviceCanAccessPeer)],
            "cuGetExportTable" => [(3000, cuGetExportTable)],
            "cuGetProcAddress" => [(11030, cuGetProcAddress), (12000, cuGetProcAddress_v2)],

            "cuCtxCreate" => [(3020, cuCtxCreate_v2), (11040, cuCtxCreate_v3), (12050, cuCtxCreate_v4)],
            "cuCtxDestroy" => [(4000, cuCtxDestroy_v2)],
            "cuCtxGetCurrent" => [(4000, cuCtxGetCurrent)],
            "cuCtxSetCurrent" => [(4000, cuCtxSetCurrent)],
            "cuCtxPushCurrent" => [(4000, cuCtxPushCurrent_v2)],
            "cuCtxPopCurrent" => [(4000, cuCtxPopCurrent_v2)],
            "cuCtxGetDevice" => [(2000, cuCtxGetDevice)],
            "cuCtxGetFlags" => [(7000, cuCtxGetFlags)],
            "cuCtxGetStreamPriorityRange" => [(5050, cuCtxGetStreamPriorityRange)],
            "cuCtxSynchronize" => [(2000, cuCtxSynchronize)],
            "cuDevicePrimaryCtxRetain" => [(7000, cuDevicePrimaryCtxRetain)],
            "cuDevicePrimaryCtxRelease" => [(7000, cuDevicePrimaryCtxRelease), (11000, cuDevicePrimaryCtxRelease_v2)],
            "cuDevicePrimaryCtxReset" => [(7000, cuDevicePrimaryCtxReset), (11000, cuDevicePrimaryCtxReset_v2)],
            "cuDevicePrimaryCtxGetState" => [(7000, cuDevicePrimaryCtxGetState)],
            "cuDevicePrimaryCtxSetFlags" => [(7000, cuDevicePrimaryCtxSetFlags), (11000, cuDevicePrimaryCtxSetFlags_v2)],

            "cuMemGetInfo" => [(3020, cuMemGetInfo_v2)],
            "cuMemAlloc" => [(3020, cuMemAlloc_v2)],
            "cuMemAllocPitch" => [(3020, cuMemAllocPitch_v2)],
            "cuMemAllocManaged" => [(6000, cuMemAllocManaged)],
            "cuMemFree" => [(3020, cuMemFree_v2)],
            "cuMemAllocHost" => [(3020, cuMemAllocHost_v2)],
            "cuMemHostAlloc" => [(2020, cuMemHostAlloc)],
            "cuMemFreeHost" => [(2000, cuMemFreeHost)],
            "cuMemHostGetDevicePointer" => [(3020, cuMemHostGetDevicePointer_v2)],
            "cuMemGetAddressRange" => [(3020, cuMemGetAddressRange_v2)],
            "cuPointerGetAttribute" => [(4000, cuPointerGetAttribute)],
            "cuMemcpy" => [(4000, cuMemcpy, cuMemcpy_ptds)],
            "cuMemcpyHtoD" => [(3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds)],
            "cuMemcpyDtoH" => [(3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds)],
            "cuMemcpyDtoD" => [(3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds)],
            "cuMemcpyAsync" => [(4000, cuMemcpyAsync, cuMemcpyAsync_ptsz)],
            "cuMemcpyHtoDAsync" => [(3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz)],
            "cuMemcpyDtoHAsync" => [(3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz)],
            "cuMemcpyDtoDAsync" => [(3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz)],
            "cuMemsetD8" => [(3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds)],
            "cuMemsetD16" => [(3020, cuMemsetD16_v2, cuMemsetD16_v2_ptds)],
            "cuMemsetD32" => [(3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds)],
            "cuMemsetD8Async" => [(3020, cuMemsetD8Async, cuMemsetD8Async_ptsz)],
            "cuMemsetD16Async" => [(3020, cuMemsetD16Async, cuMemsetD16Async_ptsz)],
            "cuMemsetD32Async" => [(3020, cuMemsetD32Async, cuMemsetD32Async_ptsz)],

            "cuMemGetAllocationGranularity" => [(10020, cuMemGetAllocationGranularity)],
            "cuMemCreate" => [(10020, cuMemCreate)],
            "cuMemRelease" => [(10020, cuMemRelease)],
            "cuMemRetainAllocationHandle" => [(11000, cuMemRetainAllocationHandle)],
            "cuMemGetAllocationPropertiesFromHandle" => [(10020, cuMemGetAllocationPropertiesFromHandle)],
            "cuMemAddressReserve" => [(10020, cuMemAddressReserve)],
            "cuMemAddressFree" => [(10020, cuMemAddressFree)],
            "cuMemMap" => [(10020, cuMemMap)],
            "cuMemUnmap" => [(10020, cuMemUnmap)],
            "cuMemSetAccess" => [(10020, cuMemSetAccess)],

            "cuDeviceGetDefaultMemPool" => [(11020, cuDeviceGetDefaultMemPool)],
            "cuDeviceGetMemPool" => [(11020, cuDeviceGetMemPool)],
            "cuDeviceSetMemPool" => [(11020, cuDeviceSetMemPool)],
            "cuMemPoolCreate" => [(11020, cuMemPoolCreate)],
            "cuMemPoolDestroy" => [(11020, cuMemPoolDestroy)],
            "cuMemPoolTrimTo" => [(11020, cuMemPoolTrimTo)],
            "cuMemPoolSetAttribute" => [(11020, cuMemPoolSetAttribute)],
            "cuMemPoolGetAttribute" => [(11020, cuMemPoolGetAttribute)],
            "cuMemAllocAsync" => [(11020, cuMemAllocAsync, cuMemAllocAsync_ptsz)],
            "cuMemAllocFromPoolAsync" => [(11020, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz)],
            "cuMemFreeAsync" => [(11020, cuMemFreeAsync, cuMemFreeAsync_ptsz)],

            "cuArrayCreate" => [(3020, cuArrayCreate_v2)],
            "cuArray3DCreate" => [(3020, cuArray3DCreate_v2)],
            "cuArrayDestroy" => [(2000, cuArrayDestroy)],
            "cuMipmappedArrayCreate" => [(5000, cuMipmappedArrayCreate)],
            "cuMipmappedArrayDestroy" => [(5000, cuMipmappedArrayDestroy)],

            "cuStreamCreate" => [(2000, cuStreamCreate)],
            "cuStreamCreateWithPriority" => [(5050, cuStreamCreateWithPriority)],
            "cuStreamDestroy" => [(4000, cuStreamDestroy_v2)],
            "cuStreamSynchronize" => [(2000, cuStreamSynchronize, cuStreamSynchronize_ptsz)],
            "cuStreamQuery" => [(2000, cuStreamQuery, cuStreamQuery_ptsz)],
            "cuStreamWaitEvent" => [(3020, cuStreamWaitEvent, cuStreamWaitEvent_ptsz)],
            "cuStreamGetCtx" => [(9020, cuStreamGetCtx, cuStreamGetCtx_ptsz)],
            "cuStreamIsCapturing" => [(10000, cuStreamIsCapturing, cuStreamIsCapturing_ptsz)],
            "cuStreamGetPriority" => [(5050, cuStreamGetPriority, cuStreamGetPriority_ptsz)],
            "cuStreamGetFlags" => [(5050, cuStreamGetFlags, cuStreamGetFlags_ptsz)],
            "cuEventCreate" => [(2000, cuEventCreate)],
            "cuEventRecord" => [(2000, cuEventRecord, cuEventRecord_ptsz)],
            "cuEventRecordWithFlags" => [(11010, cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz)],
            "cuEventSynchronize" => [(2000, cuEventSynchronize)],
            "cuEventQuery" => [(2000, cuEventQuery)],
            "cuEventElapsedTime" => [(2000, cuEventElapsedTime)],
            "cuEventDestroy" => [(4000, cuEventDestroy_v2)],

            "cuModuleLoad" => [(2000, cuModuleLoad)],
            "cuModuleLoadData" => [(2000, cuModuleLoadData)],
            "cuModuleLoadDataEx" => [(2010, cuModuleLoadDataEx)],
            "cuModuleLoadFatBinary" => [(2000, cuModuleLoadFatBinary)],
            "cuModuleUnload" => [(2000, cuModuleUnload)],
            "cuModuleGetFunction" => [(2000, cuModuleGetFunction)],
            "cuLibraryLoadData" => [(12000, cuLibraryLoadData)],
            "cuLibraryLoadFromFile" => [(12000, cuLibraryLoadFromFile)],
            "cuLibraryUnload" => [(12000, cuLibraryUnload)],
            "cuLibraryGetModule" => [(12000, cuLibraryGetModule)],
            "cuModuleGetGlobal" => [(3020, cuModuleGetGlobal_v2)],
            "cuFuncGetAttribute" => [(2020, cuFuncGetAttribute)],
            "cuFuncSetAttribute" => [(9000, cuFuncSetAttribute)],
            "cuFuncSetCacheConfig" => [(3000, cuFuncSetCacheConfig)],
            "cuFuncGetModule" => [(11000, cuFuncGetModule)],
            "cuLaunchKernel" => [(4000, cuLaunchKernel, cuLaunchKernel_ptsz)],
            "cuLaunchKernelEx" => [(11060, cuLaunchKernelEx, cuLaunchKernelEx_ptsz)],
            "cuLaunchCooperativeKernel" => [(9000, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz)],
            "cuLaunchCooperativeKernelMultiDevice" => [(9000, cuLaunchCooperativeKernelMultiDevice)],

            "cuStreamBeginCapture" => [
                (10000, cuStreamBeginCapture, cuStreamBeginCapture_ptsz),
                (10010, cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz),
            ],
            "cuStreamEndCapture" => [(10000, cuStreamEndCapture, cuStreamEndCapture_ptsz)],
            "cuStreamGetCaptureInfo" => [
                (10010, cuStreamGetCaptureInfo, cuStreamGetCaptureInfo_ptsz),
                (11030, cuStreamGetCaptureInfo_v2, cuStreamGetCaptureInfo_v2_ptsz),
                (12030, cuStreamGetCaptureInfo_v3, cuStreamGetCaptureInfo_v3_ptsz),
            ],
            "cuThreadExchangeStreamCaptureMode" => [(10010, cuThreadExchangeStreamCaptureMode)],
            "cuGraphCreate" => [(10000, cuGraphCreate)],
            "cuGraphDestroy" => [(10000, cuGraphDestroy)],
            "cuGraphAddKernelNode" => [(10000, cuGraphAddKernelNode), (12000, cuGraphAddKernelNode_v2)],
            "cuGraphGetNodes" => [(10000, cuGraphGetNodes)],
            "cuGraphNodeGetType" => [(10000, cuGraphNodeGetType)],
            "cuGraphKernelNodeGetParams" => [
                (10000, cuGraphKernelNodeGetParams),
                (12000, cuGraphKernelNodeGetParams_v2),
            ],
            // CUDA 12's cuda.h: `#define cuGraphInstantiate cuGraphInstantiateWithFlags`.
            "cuGraphInstantiate" => [
                (10000, cuGraphInstantiate),
                (11000, cuGraphInstantiate_v2),
                (12000, cuGraphInstantiateWithFlags),
            ],
            "cuGraphInstantiateWithFlags" => [(11040, cuGraphInstantiateWithFlags)],
            "cuGraphInstantiateWithParams" => [(12000, cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz)],
            "cuGraphExecDestroy" => [(10000, cuGraphExecDestroy)],
            "cuGraphUpload" => [(11010, cuGraphUpload, cuGraphUpload_ptsz)],
            "cuGraphLaunch" => [(10000, cuGraphLaunch, cuGraphLaunch_ptsz)],
        }
    })
}

/// Resolves a base name: (function, status, result).
pub fn resolve(
    symbol: &str,
    cuda_version: c_int,
    flags: u64,
) -> (usize, CUdriverProcAddressQueryResult, CUresult) {
    let Some(variants) = table().get(symbol) else {
        return (
            0,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
            CUDA_ERROR_NOT_FOUND,
        );
    };
    let Some(best) = variants
        .iter()
        .filter(|v| v.version <= cuda_version)
        .max_by_key(|v| v.version)
    else {
        return (
            0,
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
            CUDA_ERROR_NOT_FOUND,
        );
    };
    let f = if flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0 {
        best.per_thread.unwrap_or(best.legacy)
    } else {
        best.legacy
    };
    (f, CU_GET_PROC_ADDRESS_SUCCESS, CUDA_SUCCESS)
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut CUdriverProcAddressQueryResult,
) -> Result<(), CUresult> {
    let valid_flags =
        CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    // SAFETY: C string from the caller.
    let name = unsafe { cstr(symbol) };
    let (Some(name), false, 0) = (name, pfn.is_null(), flags & !valid_flags) else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    let (f, st, result) = resolve(name, cuda_version, flags);
    // SAFETY: C API out-pointers (pfn checked non-NULL; status optional).
    unsafe {
        out(pfn, f as *mut c_void)?;
        if !status.is_null() {
            out(status, st)?;
        }
    }
    if result == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(result)
    }
}

cuda_fn! {
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) {
        get_proc_address(symbol, pfn, cuda_version, flags, std::ptr::null_mut())
    }
}

cuda_fn! {
    fn cuGetProcAddress_v2(
        symbol: *const c_char,
        pfn: *mut *mut c_void,
        cuda_version: c_int,
        flags: u64,
        status: *mut CUdriverProcAddressQueryResult,
    ) {
        get_proc_address(symbol, pfn, cuda_version, flags, status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_flags() {
        let (v2, st, r) = resolve("cuCtxCreate", 11030, 0);
        assert_eq!((st, r), (CU_GET_PROC_ADDRESS_SUCCESS, CUDA_SUCCESS));
        assert_eq!(v2, cuCtxCreate_v2 as *const () as usize);
        assert_eq!(
            resolve("cuCtxCreate", 11040, 0).0,
            cuCtxCreate_v3 as *const () as usize
        );
        assert_eq!(
            resolve("cuCtxCreate", 12080, 0).0,
            cuCtxCreate_v4 as *const () as usize
        );
        assert_eq!(
            resolve("cuCtxCreate", 3000, 0).1,
            CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
        );
        assert_eq!(
            resolve("cuNope", 12080, 0).1,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
        );
        let legacy = resolve("cuMemcpyHtoD", 12080, 0).0;
        let ptds = resolve("cuMemcpyHtoD", 12080, 2).0;
        assert_eq!(legacy, cuMemcpyHtoD_v2 as *const () as usize);
        assert_eq!(ptds, cuMemcpyHtoD_v2_ptds as *const () as usize);
        assert_ne!(legacy, ptds);
        // No per-thread twin: the normal one.
        assert_eq!(
            resolve("cuMemAlloc", 12080, 2).0,
            cuMemAlloc_v2 as *const () as usize
        );
    }
}
