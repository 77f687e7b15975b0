//! CUDA driver API (`cuda.h`) types and constants.

use core::ffi::{c_int, c_uint, c_void};

/// `CUresult`: every driver call returns one of these codes.
pub type CUresult = c_uint;
/// `CUdevice`: a device ordinal.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device address (unified address space on 64-bit).
pub type CUdeviceptr = u64;
/// `CUmemGenericAllocationHandle`: a physical allocation made by `cuMemCreate`.
pub type CUmemGenericAllocationHandle = u64;

pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUlibrary = *mut c_void;
pub type CUkernel = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUgraphNode = *mut c_void;

// Result codes.
pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_CONTEXT_ALREADY_CURRENT: CUresult = 202;
pub const CUDA_ERROR_MAP_FAILED: CUresult = 205;
pub const CUDA_ERROR_UNMAP_FAILED: CUresult = 206;
pub const CUDA_ERROR_ALREADY_MAPPED: CUresult = 208;
pub const CUDA_ERROR_INVALID_SOURCE: CUresult = 300;
pub const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

// cuGetProcAddress flags (`CUdriverProcAddress_flags`).
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// `CUdriverProcAddressQueryResult`, written through `symbolStatus`.
pub type CUdriverProcAddressQueryResult = c_int;
pub const CU_GET_PROC_ADDRESS_SUCCESS: CUdriverProcAddressQueryResult = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: CUdriverProcAddressQueryResult = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: CUdriverProcAddressQueryResult = 2;

/// `CUdevice_attribute` values the project reads.
pub type CUdevice_attribute = c_int;
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: CUdevice_attribute = 1;
pub const CU_DEVICE_ATTRIBUTE_WARP_SIZE: CUdevice_attribute = 10;
pub const CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: CUdevice_attribute = 14;
pub const CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: CUdevice_attribute = 51;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: CUdevice_attribute = 16;
pub const CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: CUdevice_attribute = 33;
pub const CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: CUdevice_attribute = 34;
pub const CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: CUdevice_attribute = 41;
pub const CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: CUdevice_attribute = 50;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: CUdevice_attribute = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: CUdevice_attribute = 76;
pub const CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: CUdevice_attribute = 83;
pub const CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: CUdevice_attribute = 89;
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: CUdevice_attribute = 102;
pub const CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: CUdevice_attribute = 115;

/// `CUmemLocationType`.
pub type CUmemLocationType = c_int;
pub const CU_MEM_LOCATION_TYPE_INVALID: CUmemLocationType = 0;
pub const CU_MEM_LOCATION_TYPE_DEVICE: CUmemLocationType = 1;
pub const CU_MEM_LOCATION_TYPE_HOST: CUmemLocationType = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: CUmemLocationType = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: CUmemLocationType = 4;

/// `CUmemAllocationType`.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemLocation {
    pub type_: CUmemLocationType,
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemAllocationPropFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`, the description of a `cuMemCreate` allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: CUmemAllocationPropFlags,
}

/// `CUmemPoolProps`, the description of a `cuMemPoolCreate` pool.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemPoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUmemPool_attribute` values.
pub type CUmemPool_attribute = c_int;
pub const CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: CUmemPool_attribute = 1;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: CUmemPool_attribute = 2;
pub const CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: CUmemPool_attribute = 3;
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: CUmemPool_attribute = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: CUmemPool_attribute = 5;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: CUmemPool_attribute = 6;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: CUmemPool_attribute = 7;
pub const CU_MEMPOOL_ATTR_USED_MEM_HIGH: CUmemPool_attribute = 8;

/// `CUarray_format`.
pub type CUarray_format = c_uint;
pub const CU_AD_FORMAT_UNSIGNED_INT8: CUarray_format = 0x01;
pub const CU_AD_FORMAT_UNSIGNED_INT16: CUarray_format = 0x02;
pub const CU_AD_FORMAT_UNSIGNED_INT32: CUarray_format = 0x03;
pub const CU_AD_FORMAT_SIGNED_INT8: CUarray_format = 0x08;
pub const CU_AD_FORMAT_SIGNED_INT16: CUarray_format = 0x09;
pub const CU_AD_FORMAT_SIGNED_INT32: CUarray_format = 0x0a;
pub const CU_AD_FORMAT_HALF: CUarray_format = 0x10;
pub const CU_AD_FORMAT_FLOAT: CUarray_format = 0x20;

/// Bytes of one channel of one element, or `None` for formats vgpu does not
/// size exactly (block-compressed and planar video formats).
pub fn array_format_bytes(format: CUarray_format) -> Option<u64> {
    match format {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => Some(1),
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => Some(2),
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => Some(4),
        _ => None,
    }
}

/// `CUDA_ARRAY_DESCRIPTOR` (`cuArrayCreate_v2`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: CUarray_format,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`cuArray3DCreate_v2`, `cuMipmappedArrayCreate`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: CUarray_format,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// `CUlaunchConfig` (`cuLaunchKernelEx`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUlaunchConfig {
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUpointer_attribute` values.
pub type CUpointer_attribute = c_int;
pub const CU_POINTER_ATTRIBUTE_CONTEXT: CUpointer_attribute = 1;
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: CUpointer_attribute = 2;
pub const CU_POINTER_ATTRIBUTE_DEVICE_POINTER: CUpointer_attribute = 3;
pub const CU_POINTER_ATTRIBUTE_HOST_POINTER: CUpointer_attribute = 4;
pub const CU_POINTER_ATTRIBUTE_IS_MANAGED: CUpointer_attribute = 8;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: CUpointer_attribute = 9;
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: CUpointer_attribute = 11;
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: CUpointer_attribute = 12;

/// `CUmemorytype`.
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

/// `CUstreamCaptureStatus`.
pub type CUstreamCaptureStatus = c_int;
pub const CU_STREAM_CAPTURE_STATUS_NONE: CUstreamCaptureStatus = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: CUstreamCaptureStatus = 1;
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: CUstreamCaptureStatus = 2;

/// Special stream handles.
pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// `cuMemAttachGlobal` for `cuMemAllocManaged`.
pub const CU_MEM_ATTACH_GLOBAL: c_uint = 0x1;

// Stream capture and graphs.
pub const CUDA_ERROR_STREAM_CAPTURE_MERGE: CUresult = 902;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
pub const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: CUresult = 904;
pub const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: CUresult = 905;
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;
pub const CUDA_ERROR_CAPTURED_EVENT: CUresult = 907;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;

/// `CUstreamCaptureMode`.
pub type CUstreamCaptureMode = c_int;
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: CUstreamCaptureMode = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: CUstreamCaptureMode = 1;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: CUstreamCaptureMode = 2;

/// `CUgraphNodeType`.
pub type CUgraphNodeType = c_int;
pub const CU_GRAPH_NODE_TYPE_KERNEL: CUgraphNodeType = 0;
pub const CU_GRAPH_NODE_TYPE_MEMCPY: CUgraphNodeType = 1;
pub const CU_GRAPH_NODE_TYPE_MEMSET: CUgraphNodeType = 2;
pub const CU_GRAPH_NODE_TYPE_HOST: CUgraphNodeType = 3;
pub const CU_GRAPH_NODE_TYPE_GRAPH: CUgraphNodeType = 4;
pub const CU_GRAPH_NODE_TYPE_EMPTY: CUgraphNodeType = 5;
pub const CU_GRAPH_NODE_TYPE_WAIT_EVENT: CUgraphNodeType = 6;
pub const CU_GRAPH_NODE_TYPE_EVENT_RECORD: CUgraphNodeType = 7;

/// `CUgraphInstantiate_flags`.
pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH: u64 = 4;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY: u64 = 8;

/// `CUgraphInstantiateResult`.
pub type CUgraphInstantiateResult = c_int;
pub const CUDA_GRAPH_INSTANTIATE_SUCCESS: CUgraphInstantiateResult = 0;
pub const CUDA_GRAPH_INSTANTIATE_ERROR: CUgraphInstantiateResult = 1;

/// `CUevent_record_flags` / `CUevent_wait_flags`.
pub const CU_EVENT_RECORD_EXTERNAL: c_uint = 0x1;
pub const CU_EVENT_WAIT_EXTERNAL: c_uint = 0x1;

/// `cuLaunchCooperativeKernelMultiDevice` flags.
pub const CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC: c_uint = 0x1;
pub const CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC: c_uint = 0x2;

/// `CUDA_KERNEL_NODE_PARAMS_v1` (`cuGraphAddKernelNode`, CUDA 10.0).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS_v1 {
    pub func: CUfunction,
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (`cuGraphAddKernelNode_v2`, CUDA 12.0; what
/// `CUDA_KERNEL_NODE_PARAMS` names since then).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS_v2 {
    pub func: CUfunction,
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: CUkernel,
    pub ctx: CUcontext,
}

/// `CUDA_LAUNCH_PARAMS` (`cuLaunchCooperativeKernelMultiDevice`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_LAUNCH_PARAMS {
    pub function: CUfunction,
    pub grid_dim_x: c_uint,
    pub grid_dim_y: c_uint,
    pub grid_dim_z: c_uint,
    pub block_dim_x: c_uint,
    pub block_dim_y: c_uint,
    pub block_dim_z: c_uint,
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
    pub kernel_params: *mut *mut c_void,
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (`cuGraphInstantiateWithParams`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_GRAPH_INSTANTIATE_PARAMS {
    pub flags: u64,
    pub h_upload_stream: CUstream,
    pub h_err_node_out: CUgraphNode,
    pub result_out: CUgraphInstantiateResult,
}
