//! Initialisation, versions, devices, attributes and error strings.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use vgpu_cuda_abi::cuda::*;

use super::out;
use crate::config::{self, Config};
use crate::driver::{self, check_device, check_init};
use crate::ffi::{cstr, write_cstr};

cuda_fn! {
    /// Reads the configuration, opens the shared state and claims this
    /// process's slot.
    fn cuInit(flags: c_uint) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let cfg = config::get().map_err(|()| CUDA_ERROR_INVALID_VALUE)?;
        if cfg.devices == 0 {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        driver::shared()?
            .ensure_slot()
            .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
        driver::set_initialized();
        Ok(())
    }
}

cuda_fn! {
    fn cuDriverGetVersion(version: *mut c_int) {
        let v = config::get().map(|c| c.driver_version).unwrap_or(12080);
        // SAFETY: C API out-pointer.
        unsafe { out(version, v) }
    }
}

cuda_fn! {
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) {
        let cfg = check_init()?;
        let d = check_device(cfg, ordinal)?;
        // SAFETY: C API out-pointer.
        unsafe { out(device, d as CUdevice) }
    }
}

cuda_fn! {
    fn cuDeviceGetCount(count: *mut c_int) {
        let cfg = check_init()?;
        // SAFETY: C API out-pointer.
        unsafe { out(count, cfg.devices as c_int) }
    }
}

cuda_fn! {
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) {
        let cfg = check_init()?;
        check_device(cfg, dev)?;
        if len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller provides `len` writable bytes.
        if unsafe { write_cstr(name, len as usize, &cfg.name, true) } {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

fn uuid(dev: CUdevice, uuid: *mut CUuuid) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let d = check_device(cfg, dev)?;
    // SAFETY: C API out-pointer.
    unsafe {
        out(
            uuid,
            CUuuid {
                bytes: cfg.uuids[d],
            },
        )
    }
}

cuda_fn! {
    fn cuDeviceGetUuid(uuid_out: *mut CUuuid, dev: CUdevice) {
        uuid(dev, uuid_out)
    }
}

cuda_fn! {
    fn cuDeviceGetUuid_v2(uuid_out: *mut CUuuid, dev: CUdevice) {
        uuid(dev, uuid_out)
    }
}

cuda_fn! {
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        // SAFETY: C API out-pointer.
        unsafe { out(bytes, cfg.memory[d] as usize) }
    }
}

// CUdevice_attribute values (cuda.h) answered with non-zero values.
const ATTR_MAX_THREADS_PER_BLOCK: c_int = 1;
const ATTR_MAX_BLOCK_DIM_X: c_int = 2;
const ATTR_MAX_BLOCK_DIM_Y: c_int = 3;
const ATTR_MAX_BLOCK_DIM_Z: c_int = 4;
const ATTR_MAX_GRID_DIM_X: c_int = 5;
const ATTR_MAX_GRID_DIM_Y: c_int = 6;
const ATTR_MAX_GRID_DIM_Z: c_int = 7;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK: c_int = 8;
const ATTR_TOTAL_CONSTANT_MEMORY: c_int = 9;
const ATTR_WARP_SIZE: c_int = 10;
const ATTR_MAX_PITCH: c_int = 11;
const ATTR_MAX_REGISTERS_PER_BLOCK: c_int = 12;
const ATTR_CLOCK_RATE: c_int = 13;
const ATTR_TEXTURE_ALIGNMENT: c_int = 14;
const ATTR_GPU_OVERLAP: c_int = 15;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const ATTR_CAN_MAP_HOST_MEMORY: c_int = 19;
const ATTR_CONCURRENT_KERNELS: c_int = 31;
const ATTR_ECC_ENABLED: c_int = 32;
const ATTR_PCI_BUS_ID: c_int = 33;
const ATTR_PCI_DEVICE_ID: c_int = 34;
const ATTR_MEMORY_CLOCK_RATE: c_int = 36;
const ATTR_GLOBAL_MEMORY_BUS_WIDTH: c_int = 37;
const ATTR_L2_CACHE_SIZE: c_int = 38;
const ATTR_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
const ATTR_ASYNC_ENGINE_COUNT: c_int = 40;
const ATTR_UNIFIED_ADDRESSING: c_int = 41;
const ATTR_PCI_DOMAIN_ID: c_int = 50;
const ATTR_TEXTURE_PITCH_ALIGNMENT: c_int = 51;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const ATTR_STREAM_PRIORITIES_SUPPORTED: c_int = 78;
const ATTR_GLOBAL_L1_CACHE_SUPPORTED: c_int = 79;
const ATTR_LOCAL_L1_CACHE_SUPPORTED: c_int = 80;
const ATTR_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: c_int = 81;
const ATTR_MAX_REGISTERS_PER_MULTIPROCESSOR: c_int = 82;
const ATTR_MANAGED_MEMORY: c_int = 83;
const ATTR_CONCURRENT_MANAGED_ACCESS: c_int = 89;
const ATTR_COMPUTE_PREEMPTION_SUPPORTED: c_int = 90;
const ATTR_COOPERATIVE_LAUNCH: c_int = 95;
const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
const ATTR_HOST_REGISTER_SUPPORTED: c_int = 99;
const ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
const ATTR_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: c_int = 103;
const ATTR_MAX_BLOCKS_PER_MULTIPROCESSOR: c_int = 106;
const ATTR_MEMORY_POOLS_SUPPORTED: c_int = 115;
/// One past the largest attribute value any CUDA 12/13 header defines.
const ATTR_LIMIT: c_int = 200;

/// The value of a device attribute (an H100-like device).
pub fn attribute(cfg: &Config, device: usize, attr: c_int) -> Option<c_int> {
    let v = match attr {
        ATTR_MAX_THREADS_PER_BLOCK => 1024,
        ATTR_MAX_BLOCK_DIM_X | ATTR_MAX_BLOCK_DIM_Y => 1024,
        ATTR_MAX_BLOCK_DIM_Z => 64,
        ATTR_MAX_GRID_DIM_X => i32::MAX,
        ATTR_MAX_GRID_DIM_Y | ATTR_MAX_GRID_DIM_Z => 65535,
        ATTR_MAX_SHARED_MEMORY_PER_BLOCK => 49152,
        ATTR_TOTAL_CONSTANT_MEMORY => 65536,
        ATTR_WARP_SIZE => 32,
        ATTR_MAX_PITCH => i32::MAX,
        ATTR_MAX_REGISTERS_PER_BLOCK => 65536,
        ATTR_CLOCK_RATE => 1_980_000,
        ATTR_TEXTURE_ALIGNMENT => 512,
        ATTR_GPU_OVERLAP => 1,
        ATTR_MULTIPROCESSOR_COUNT => cfg.sm_count,
        ATTR_CAN_MAP_HOST_MEMORY => 1,
        ATTR_CONCURRENT_KERNELS => 1,
        ATTR_ECC_ENABLED => 1,
        ATTR_PCI_BUS_ID => cfg.pci_bus(device) as c_int,
        ATTR_PCI_DEVICE_ID => 0,
        ATTR_MEMORY_CLOCK_RATE => 2_619_000,
        ATTR_GLOBAL_MEMORY_BUS_WIDTH => 5120,
        ATTR_L2_CACHE_SIZE => 50 << 20,
        ATTR_MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        ATTR_ASYNC_ENGINE_COUNT => 3,
        ATTR_UNIFIED_ADDRESSING => 1,
        ATTR_PCI_DOMAIN_ID => 0,
        ATTR_TEXTURE_PITCH_ALIGNMENT => 32,
        ATTR_COMPUTE_CAPABILITY_MAJOR => 9,
        ATTR_COMPUTE_CAPABILITY_MINOR => 0,
        ATTR_STREAM_PRIORITIES_SUPPORTED => 1,
        ATTR_GLOBAL_L1_CACHE_SUPPORTED | ATTR_LOCAL_L1_CACHE_SUPPORTED => 1,
        ATTR_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 233_472,
        ATTR_MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        ATTR_MANAGED_MEMORY => 1,
        ATTR_CONCURRENT_MANAGED_ACCESS => 1,
        ATTR_COMPUTE_PREEMPTION_SUPPORTED => 1,
        ATTR_COOPERATIVE_LAUNCH => 1,
        ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 232_448,
        ATTR_HOST_REGISTER_SUPPORTED => 1,
        ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => 1,
        ATTR_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED => 1,
        ATTR_MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        ATTR_MEMORY_POOLS_SUPPORTED => 1,
        a if (1..ATTR_LIMIT).contains(&a) => 0,
        _ => return None,
    };
    Some(v)
}

cuda_fn! {
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        let v = attribute(cfg, d, attrib).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: C API out-pointer.
        unsafe { out(pi, v) }
    }
}

cuda_fn! {
    fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) {
        let cfg = check_init()?;
        check_device(cfg, dev)?;
        // SAFETY: C API out-pointers.
        unsafe {
            out(major, 9)?;
            out(minor, 0)
        }
    }
}

cuda_fn! {
    fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: CUdevice) {
        let cfg = check_init()?;
        let d = check_device(cfg, dev)?;
        if len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("0000:{:02x}:00.0", cfg.pci_bus(d));
        // SAFETY: the caller provides `len` writable bytes.
        if unsafe { write_cstr(bus_id, len as usize, &text, true) } {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

/// Parses `[domain:]bus:device[.function]` (hex, any case) into the bus.
pub fn parse_bus_id(text: &str) -> Option<u32> {
    let mut parts: Vec<&str> = text.trim().split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    if parts.len() != 3 {
        return None;
    }
    let domain = u32::from_str_radix(parts[0], 16).ok()?;
    let bus = u32::from_str_radix(parts[1], 16).ok()?;
    let dev_fn = parts[2];
    let device = dev_fn.split('.').next()?;
    let device = u32::from_str_radix(device, 16).ok()?;
    (domain == 0 && device == 0).then_some(bus)
}

cuda_fn! {
    fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus_id: *const c_char) {
        let cfg = check_init()?;
        // SAFETY: C string from the caller.
        let text = unsafe { cstr(bus_id) }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let bus = parse_bus_id(text).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let index = (0..cfg.devices)
            .find(|&i| cfg.pci_bus(i) == bus)
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        // SAFETY: C API out-pointer.
        unsafe { out(dev, index as CUdevice) }
    }
}

cuda_fn! {
    fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) {
        let cfg = check_init()?;
        check_device(cfg, dev)?;
        check_device(cfg, peer)?;
        // SAFETY: C API out-pointer.
        unsafe { out(can, 0) }
    }
}

cuda_fn! {
    fn cuGetExportTable(table: *mut *const c_void, id: *const c_void) {
        let _ = (table, id);
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
}

/// (code, name, description) of every result code the simulation knows.
const ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (
        5,
        c"CUDA_ERROR_PROFILER_DISABLED",
        c"profiler disabled while using external profiling tool",
    ),
    (
        34,
        c"CUDA_ERROR_STUB_LIBRARY",
        c"CUDA driver is a stub library",
    ),
    (
        46,
        c"CUDA_ERROR_DEVICE_UNAVAILABLE",
        c"CUDA-capable device(s) is/are busy or unavailable",
    ),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (
        200,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        201,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        202,
        c"CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        c"context already current",
    ),
    (
        205,
        c"CUDA_ERROR_MAP_FAILED",
        c"mapping of buffer object failed",
    ),
    (
        206,
        c"CUDA_ERROR_UNMAP_FAILED",
        c"unmapping of buffer object failed",
    ),
    (
        208,
        c"CUDA_ERROR_ALREADY_MAPPED",
        c"resource already mapped",
    ),
    (
        209,
        c"CUDA_ERROR_NO_BINARY_FOR_GPU",
        c"no kernel image is available for execution on the device",
    ),
    (211, c"CUDA_ERROR_NOT_MAPPED", c"resource not mapped"),
    (
        216,
        c"CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        c"exclusive-thread device already in use by a different thread",
    ),
    (
        218,
        c"CUDA_ERROR_INVALID_PTX",
        c"a PTX JIT compilation failed",
    ),
    (
        300,
        c"CUDA_ERROR_INVALID_SOURCE",
        c"device kernel image is invalid",
    ),
    (301, c"CUDA_ERROR_FILE_NOT_FOUND", c"file not found"),
    (
        304,
        c"CUDA_ERROR_OPERATING_SYSTEM",
        c"OS call failed or operation not supported on this OS",
    ),
    (
        400,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (
        401,
        c"CUDA_ERROR_ILLEGAL_STATE",
        c"the operation cannot be performed in the present state",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (
        700,
        c"CUDA_ERROR_ILLEGAL_ADDRESS",
        c"an illegal memory access was encountered",
    ),
    (
        701,
        c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        c"too many resources requested for launch",
    ),
    (
        702,
        c"CUDA_ERROR_LAUNCH_TIMEOUT",
        c"the launch timed out and was terminated",
    ),
    (
        709,
        c"CUDA_ERROR_CONTEXT_IS_DESTROYED",
        c"context is destroyed",
    ),
    (
        719,
        c"CUDA_ERROR_LAUNCH_FAILED",
        c"unspecified launch failure",
    ),
    (
        720,
        c"CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        c"too many blocks in cooperative launch",
    ),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (
        802,
        c"CUDA_ERROR_SYSTEM_NOT_READY",
        c"system not yet initialized",
    ),
    (
        803,
        c"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        c"system has unsupported display driver / cuda driver combination",
    ),
    (
        900,
        c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        c"operation not permitted when stream is capturing",
    ),
    (
        901,
        c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        c"operation failed due to a previous error during capture",
    ),
    (
        902,
        c"CUDA_ERROR_STREAM_CAPTURE_MERGE",
        c"operation would result in a merge of separate capture sequences",
    ),
    (
        903,
        c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        c"capture was not ended in the same stream as it began",
    ),
    (
        904,
        c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        c"capturing stream has unjoined work",
    ),
    (
        905,
        c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        c"dependency created on uncaptured work in another stream",
    ),
    (
        906,
        c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        c"operation would make the legacy stream depend on a capturing blocking stream",
    ),
    (
        907,
        c"CUDA_ERROR_CAPTURED_EVENT",
        c"operation not permitted on an event last recorded in a capturing stream",
    ),
    (
        908,
        c"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        c"attempt to terminate a thread-local capture sequence from another thread",
    ),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

fn lookup_error(code: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    ERRORS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|&(_, name, text)| (name, text))
}

cuda_fn! {
    fn cuGetErrorString(error: CUresult, text: *mut *const c_char) {
        match lookup_error(error) {
            Some((_, s)) => {
                // SAFETY: C API out-pointer; the string is 'static.
                unsafe { out(text, s.as_ptr()) }
            }
            None => {
                // SAFETY: C API out-pointer (NULL tolerated).
                let _ = unsafe { out(text, std::ptr::null()) };
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        }
    }
}

cuda_fn! {
    fn cuGetErrorName(error: CUresult, text: *mut *const c_char) {
        match lookup_error(error) {
            Some((name, _)) => {
                // SAFETY: C API out-pointer; the string is 'static.
                unsafe { out(text, name.as_ptr()) }
            }
            None => {
                // SAFETY: C API out-pointer (NULL tolerated).
                let _ = unsafe { out(text, std::ptr::null()) };
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        }
    }
}

/// Test hook: bytes in use on `device` by all processes (the driver's own
/// record, after reclaiming dead processes' memory); `u64::MAX` on error.
#[no_mangle]
pub extern "C" fn simgpu_device_used_bytes(device: c_int) -> u64 {
    std::panic::catch_unwind(|| {
        let Ok(cfg) = config::get() else {
            return u64::MAX;
        };
        if device < 0 || device as usize >= cfg.devices {
            return u64::MAX;
        }
        match crate::state::shared() {
            Ok(s) => s.memory(device as usize).1,
            Err(_) => u64::MAX,
        }
    })
    .unwrap_or(u64::MAX)
}

/// Kernel time `device` has spent so far, for one pid or all (`None`);
/// `u64::MAX` on error. Reads the shared state file (no `cuInit` needed).
fn busy_hook(device: c_int, pid: Option<u32>) -> u64 {
    std::panic::catch_unwind(|| {
        let Ok(cfg) = config::get() else {
            return u64::MAX;
        };
        if device < 0 || device as usize >= cfg.devices {
            return u64::MAX;
        }
        match crate::state::shared() {
            Ok(s) => s.elapsed_busy(device as usize, pid).unwrap_or(u64::MAX),
            Err(_) => u64::MAX,
        }
    })
    .unwrap_or(u64::MAX)
}

/// Test hook: nanoseconds `device` has spent running kernels of process
/// `pid`, counting only time already elapsed (a queued kernel counts from
/// its start up to now); 0 for a pid that has no slot; `u64::MAX` for a bad
/// device or an unusable state file.
#[no_mangle]
pub extern "C" fn simgpu_process_busy_ns(device: c_int, pid: u32) -> u64 {
    busy_hook(device, Some(pid))
}

/// Test hook: the same as [`simgpu_process_busy_ns`] for all processes.
#[no_mangle]
pub extern "C" fn simgpu_device_busy_ns(device: c_int) -> u64 {
    busy_hook(device, None)
}

/// One of `device`'s switch counters (wall timing); `u64::MAX` on error.
/// Reads the shared state file (no `cuInit` needed).
fn switch_hook(device: c_int, pick: fn((u64, u64)) -> u64) -> u64 {
    std::panic::catch_unwind(|| {
        let Ok(cfg) = config::get() else {
            return u64::MAX;
        };
        if device < 0 || device as usize >= cfg.devices {
            return u64::MAX;
        }
        match crate::state::shared() {
            Ok(s) => pick(s.switches(device as usize)),
            Err(_) => u64::MAX,
        }
    })
    .unwrap_or(u64::MAX)
}

/// Test hook: how many times `device` has passed from one process's work
/// to another's (wall timing; completed switches); `u64::MAX` for a bad
/// device or an unusable state file.
#[no_mangle]
pub extern "C" fn simgpu_device_switches(device: c_int) -> u64 {
    switch_hook(device, |(switches, _)| switches)
}

/// Test hook: device time those switches took (`SIMGPU_SWITCH_COST` each),
/// in no process's busy time nor the device's; `u64::MAX` on error.
#[no_mangle]
pub extern "C" fn simgpu_device_switch_ns(device: c_int) -> u64 {
    switch_hook(device, |(_, ns)| ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids() {
        assert_eq!(parse_bus_id("0000:01:00.0"), Some(1));
        assert_eq!(parse_bus_id("00000000:0A:00.0"), Some(10));
        assert_eq!(parse_bus_id("0a:00.0"), Some(10));
        assert_eq!(parse_bus_id("0001:01:00.0"), None);
        assert_eq!(parse_bus_id("junk"), None);
    }

    #[test]
    fn every_error_has_strings() {
        for code in [
            0, 1, 2, 3, 100, 101, 200, 201, 400, 500, 600, 801, 900, 907, 999,
        ] {
            assert!(lookup_error(code).is_some(), "{code}");
        }
        assert!(lookup_error(12345).is_none());
    }
}
