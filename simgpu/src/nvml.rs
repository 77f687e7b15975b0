//! Exported NVML entry points.
//!
//! NVML works without any CUDA call in the same process: it reads the shared
//! state file, so an nvidia-smi-like client sees every process's memory and
//! the kernel timeline. Memory and process queries first reclaim the memory
//! of dead processes.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::sync::atomic::{AtomicU32, Ordering};

use vgpu_cuda_abi::nvml::*;

use crate::clock;
use crate::config::{self, Config};
use crate::ffi::{cstr, put, write_cstr};
use crate::state::{self, Shared};
use crate::topology::Link;

/// A device handle points at one of these (stable for the process).
#[repr(C)]
pub struct NvmlDevice {
    index: usize,
}

const fn make_devices() -> [NvmlDevice; config::MAX_DEVICES] {
    let mut out = [const { NvmlDevice { index: 0 } }; config::MAX_DEVICES];
    let mut i = 0;
    while i < config::MAX_DEVICES {
        out[i] = NvmlDevice { index: i };
        i += 1;
    }
    out
}

static DEVICES: [NvmlDevice; config::MAX_DEVICES] = make_devices();
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

const NVML_FEATURE_DISABLED: c_uint = 0;
const NVML_FEATURE_ENABLED: c_uint = 1;
const NVML_COMPUTEMODE_DEFAULT: c_uint = 0;
const NVML_DEVICE_ARCH_HOPPER: c_uint = 9;
const MIG_INSTANCE_NONE: c_uint = 0xFFFF_FFFF;
const PCI_DEVICE_ID: c_uint = 0x2330_10DE;
const PCI_SUBSYSTEM_ID: c_uint = 0x16C1_10DE;
const POWER_IDLE_MW: u64 = 70_000;
const POWER_LIMIT_MW: c_uint = 700_000;
const ONE_SECOND_NS: u64 = 1_000_000_000;

/// Writes through an NVML out-pointer (NULL → INVALID_ARGUMENT).
///
/// # Safety
/// `ptr` must be NULL or valid for writing one `T`.
unsafe fn out<T>(ptr: *mut T, value: T) -> Result<(), nvmlReturn_t> {
    // SAFETY: forwarded caller contract.
    unsafe { put(ptr, value, NVML_ERROR_INVALID_ARGUMENT) }
}

/// Reads an in/out count (NULL → INVALID_ARGUMENT).
///
/// # Safety
/// `ptr` must be NULL or valid for reading a `c_uint`.
unsafe fn read_count(ptr: *const c_uint) -> Result<c_uint, nvmlReturn_t> {
    // SAFETY: forwarded caller contract.
    unsafe { crate::ffi::get(ptr, NVML_ERROR_INVALID_ARGUMENT) }
}

fn init() -> Result<(), nvmlReturn_t> {
    config::get().map_err(|()| NVML_ERROR_UNKNOWN)?;
    state::shared().map_err(|_| NVML_ERROR_UNKNOWN)?;
    INIT_COUNT.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

fn ready() -> Result<(&'static Config, &'static Shared), nvmlReturn_t> {
    if INIT_COUNT.load(Ordering::Acquire) == 0 {
        return Err(NVML_ERROR_UNINITIALIZED);
    }
    let cfg = config::get().map_err(|()| NVML_ERROR_UNINITIALIZED)?;
    let shared = state::shared().map_err(|_| NVML_ERROR_UNKNOWN)?;
    Ok((cfg, shared))
}

fn handle(index: usize) -> nvmlDevice_t {
    &DEVICES[index] as *const NvmlDevice as nvmlDevice_t
}

/// Validates a device handle: (config, state, device index). A device
/// configured lost (`SIMGPU_LOST_DEVICES`) answers every query with
/// `NVML_ERROR_GPU_IS_LOST`, as a GPU fallen off the bus does.
fn device(h: nvmlDevice_t) -> Result<(&'static Config, &'static Shared, usize), nvmlReturn_t> {
    let (cfg, shared) = ready()?;
    let index = (0..cfg.devices)
        .find(|&i| handle(i) == h)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    if cfg.is_lost(index) {
        return Err(NVML_ERROR_GPU_IS_LOST);
    }
    Ok((cfg, shared, index))
}

/// Writes a string into a caller buffer; too small → INSUFFICIENT_SIZE.
fn string_out(buf: *mut c_char, length: c_uint, text: &str) -> Result<(), nvmlReturn_t> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: the caller provides `length` writable bytes.
    if unsafe { write_cstr(buf, length as usize, text, false) } {
        Ok(())
    } else {
        Err(NVML_ERROR_INSUFFICIENT_SIZE)
    }
}

nvml_fn! {
    fn nvmlInit() {
        init()
    }
}

nvml_fn! {
    fn nvmlInit_v2() {
        init()
    }
}

nvml_fn! {
    fn nvmlInitWithFlags(flags: c_uint) {
        let _ = flags;
        init()
    }
}

nvml_fn! {
    fn nvmlShutdown() {
        INIT_COUNT
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| NVML_ERROR_UNINITIALIZED)
    }
}

/// (code, text) of NVML results.
const ERRORS: &[(nvmlReturn_t, &CStr)] = &[
    (0, c"Success"),
    (1, c"Uninitialized"),
    (2, c"Invalid Argument"),
    (3, c"Not Supported"),
    (4, c"Insufficient Permissions"),
    (5, c"Already Initialized"),
    (6, c"Not Found"),
    (7, c"Insufficient Size"),
    (8, c"Insufficient External Power"),
    (9, c"Driver Not Loaded"),
    (10, c"Timeout"),
    (11, c"Interrupt Request Issue"),
    (12, c"NVML Shared Library Not Found"),
    (13, c"Function Not Found"),
    (14, c"Corrupted infoROM"),
    (15, c"GPU is lost"),
    (16, c"GPU requires restart"),
    (17, c"Driver/library version mismatch"),
    (18, c"In use by another client"),
    (19, c"Memory Error"),
    (20, c"No data"),
    (21, c"Requested vgpu operation is not available"),
    (22, c"Insufficient resources"),
    (23, c"Frequency not supported"),
    (24, c"Argument version mismatch"),
    (25, c"Argument version mismatch"),
    (26, c"Deprecated"),
    (27, c"Not Ready"),
    (999, c"Unknown Error"),
];

/// `nvmlErrorString`: a static string for every code.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    ERRORS
        .iter()
        .find(|(c, _)| *c == result)
        .map_or(c"Unknown Error".as_ptr(), |(_, s)| s.as_ptr())
}

nvml_fn! {
    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) {
        let (cfg, _) = ready()?;
        string_out(version, length, &cfg.nvml_driver_version)
    }
}

nvml_fn! {
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) {
        let (cfg, _) = ready()?;
        let text = format!("{}.{}", cfg.driver_version / 1000, cfg.nvml_driver_version);
        string_out(version, length, &text)
    }
}

nvml_fn! {
    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) {
        let (cfg, _) = ready()?;
        // SAFETY: NVML out-pointer.
        unsafe { out(version, cfg.driver_version) }
    }
}

nvml_fn! {
    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) {
        let (cfg, _) = ready()?;
        // SAFETY: NVML out-pointer.
        unsafe { out(version, cfg.driver_version) }
    }
}

fn count(out_count: *mut c_uint) -> Result<(), nvmlReturn_t> {
    let (cfg, _) = ready()?;
    // SAFETY: NVML out-pointer.
    unsafe { out(out_count, cfg.devices as c_uint) }
}

nvml_fn! {
    fn nvmlDeviceGetCount(device_count: *mut c_uint) {
        count(device_count)
    }
}

nvml_fn! {
    fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) {
        count(device_count)
    }
}

fn by_index(index: c_uint, dev: *mut nvmlDevice_t) -> Result<(), nvmlReturn_t> {
    let (cfg, _) = ready()?;
    if index as usize >= cfg.devices {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: NVML out-pointer.
    unsafe { out(dev, handle(index as usize)) }
}

nvml_fn! {
    fn nvmlDeviceGetHandleByIndex(index: c_uint, dev: *mut nvmlDevice_t) {
        by_index(index, dev)
    }
}

nvml_fn! {
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, dev: *mut nvmlDevice_t) {
        by_index(index, dev)
    }
}

nvml_fn! {
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, dev: *mut nvmlDevice_t) {
        let (cfg, _) = ready()?;
        // SAFETY: C string from the caller.
        let text = unsafe { cstr(uuid) }.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
        let index = (0..cfg.devices)
            .find(|&i| cfg.uuid_string(i).eq_ignore_ascii_case(text.trim()))
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(dev, handle(index)) }
    }
}

fn by_bus_id(bus_id: *const c_char, dev: *mut nvmlDevice_t) -> Result<(), nvmlReturn_t> {
    let (cfg, _) = ready()?;
    // SAFETY: C string from the caller.
    let text = unsafe { cstr(bus_id) }.ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    let bus = crate::cu::device::parse_bus_id(text).ok_or(NVML_ERROR_NOT_FOUND)?;
    let index = (0..cfg.devices)
        .find(|&i| cfg.pci_bus(i) == bus)
        .ok_or(NVML_ERROR_NOT_FOUND)?;
    // SAFETY: NVML out-pointer.
    unsafe { out(dev, handle(index)) }
}

nvml_fn! {
    fn nvmlDeviceGetHandleByPciBusId(bus_id: *const c_char, dev: *mut nvmlDevice_t) {
        by_bus_id(bus_id, dev)
    }
}

nvml_fn! {
    fn nvmlDeviceGetHandleByPciBusId_v2(bus_id: *const c_char, dev: *mut nvmlDevice_t) {
        by_bus_id(bus_id, dev)
    }
}

nvml_fn! {
    fn nvmlDeviceGetIndex(dev: nvmlDevice_t, index: *mut c_uint) {
        let (_, _, i) = device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(index, i as c_uint) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetMinorNumber(dev: nvmlDevice_t, minor: *mut c_uint) {
        let (_, _, i) = device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(minor, i as c_uint) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetName(dev: nvmlDevice_t, name: *mut c_char, length: c_uint) {
        let (cfg, _, _) = device(dev)?;
        string_out(name, length, &cfg.name)
    }
}

nvml_fn! {
    fn nvmlDeviceGetUUID(dev: nvmlDevice_t, uuid: *mut c_char, length: c_uint) {
        let (cfg, _, i) = device(dev)?;
        string_out(uuid, length, &cfg.uuid_string(i))
    }
}

fn copy_bytes<const N: usize>(text: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let n = text.len().min(N - 1);
    out[..n].copy_from_slice(&text.as_bytes()[..n]);
    out
}

fn pci_info(cfg: &Config, index: usize) -> nvmlPciInfo_t {
    pci_info_of_bus(cfg.pci_bus(index))
}

/// PCI info of the device on `bus` (every simulated GPU is domain 0,
/// device 0, function 0 of its own bus).
fn pci_info_of_bus(bus: u32) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        bus_id_legacy: copy_bytes(&format!("0000:{bus:02X}:00.0")),
        domain: 0,
        bus,
        device: 0,
        pci_device_id: PCI_DEVICE_ID,
        pci_sub_system_id: PCI_SUBSYSTEM_ID,
        bus_id: copy_bytes(&format!("00000000:{bus:02X}:00.0")),
    }
}

nvml_fn! {
    fn nvmlDeviceGetPciInfo_v3(dev: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        let (cfg, _, i) = device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(pci, pci_info(cfg, i)) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetPciInfo_v2(dev: nvmlDevice_t, pci: *mut nvmlPciInfo_t) {
        let (cfg, _, i) = device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(pci, pci_info(cfg, i)) }
    }
}

/// The original (v1) PCI info layout: a 16-byte bus id and reserved words.
#[repr(C)]
#[derive(Clone, Copy)]
struct PciInfoV1 {
    bus_id: [u8; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    reserved: [c_uint; 4],
}

nvml_fn! {
    fn nvmlDeviceGetPciInfo(dev: nvmlDevice_t, pci: *mut c_void) {
        let (cfg, _, i) = device(dev)?;
        let v3 = pci_info(cfg, i);
        let v1 = PciInfoV1 {
            bus_id: v3.bus_id_legacy,
            domain: v3.domain,
            bus: v3.bus,
            device: v3.device,
            pci_device_id: v3.pci_device_id,
            pci_sub_system_id: v3.pci_sub_system_id,
            reserved: [0; 4],
        };
        // SAFETY: NVML out-pointer for the v1 struct.
        unsafe { out(pci.cast::<PciInfoV1>(), v1) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, memory: *mut nvmlMemory_t) {
        let (_, shared, i) = device(dev)?;
        let (total, used) = shared.memory(i);
        let info = nvmlMemory_t {
            total,
            free: total.saturating_sub(used),
            used,
        };
        // SAFETY: NVML out-pointer.
        unsafe { out(memory, info) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetMemoryInfo_v2(dev: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) {
        let (_, shared, i) = device(dev)?;
        // SAFETY: NVML in/out struct; only the version word is read.
        let version = unsafe { crate::ffi::get(memory.cast::<c_uint>(), NVML_ERROR_INVALID_ARGUMENT) }?;
        if version != NVML_MEMORY_V2 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (total, used) = shared.memory(i);
        let info = nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free: total.saturating_sub(used),
            used,
        };
        // SAFETY: NVML out-pointer.
        unsafe { out(memory, info) }
    }
}

/// The NVML process-list protocol over this device's live processes.
fn process_list<T>(
    dev: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut T,
    graphics: bool,
    make: impl Fn(u32, u64) -> T,
) -> Result<(), nvmlReturn_t> {
    let (_, shared, i) = device(dev)?;
    // SAFETY: NVML in/out count.
    let capacity = unsafe { read_count(count) }? as usize;
    let procs = if graphics {
        Vec::new()
    } else {
        shared.processes(i)
    };
    if capacity < procs.len() {
        // SAFETY: NVML out-pointer (validated by the read above).
        unsafe { out(count, procs.len() as c_uint) }?;
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if !procs.is_empty() && infos.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (k, &(pid, used)) in procs.iter().enumerate() {
        // SAFETY: the caller's array holds `capacity >= procs.len()` entries.
        unsafe { infos.add(k).write_unaligned(make(pid, used)) };
    }
    // SAFETY: NVML out-pointer.
    unsafe { out(count, procs.len() as c_uint) }
}

fn v1(pid: u32, used: u64) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t {
        pid,
        used_gpu_memory: used,
    }
}

fn v2(pid: u32, used: u64) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid,
        used_gpu_memory: used,
        gpu_instance_id: MIG_INSTANCE_NONE,
        compute_instance_id: MIG_INSTANCE_NONE,
    }
}

nvml_fn! {
    fn nvmlDeviceGetComputeRunningProcesses(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        process_list(dev, count, infos, false, v1)
    }
}

nvml_fn! {
    fn nvmlDeviceGetComputeRunningProcesses_v2(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(dev, count, infos, false, v2)
    }
}

nvml_fn! {
    fn nvmlDeviceGetComputeRunningProcesses_v3(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(dev, count, infos, false, v2)
    }
}

nvml_fn! {
    fn nvmlDeviceGetGraphicsRunningProcesses(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        process_list(dev, count, infos, true, v1)
    }
}

nvml_fn! {
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(dev, count, infos, true, v2)
    }
}

nvml_fn! {
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(dev: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        process_list(dev, count, infos, true, v2)
    }
}

/// Percentage of `window` that `busy` covers, rounded, at most 100.
fn percent(busy: u64, window: u64) -> c_uint {
    if window == 0 {
        return 0;
    }
    (((busy as u128 * 100 + window as u128 / 2) / window as u128).min(100)) as c_uint
}

/// GPU utilization over the last second.
fn gpu_percent(shared: &Shared, index: usize) -> Result<c_uint, nvmlReturn_t> {
    let now = clock::now_ns();
    let busy = shared
        .busy_between(index, now.saturating_sub(ONE_SECOND_NS), now)
        .map_err(|_| NVML_ERROR_UNKNOWN)?;
    Ok(percent(busy.total_ns, ONE_SECOND_NS.min(now)))
}

nvml_fn! {
    fn nvmlDeviceGetUtilizationRates(dev: nvmlDevice_t, utilization: *mut nvmlUtilization_t) {
        let (_, shared, i) = device(dev)?;
        let gpu = gpu_percent(shared, i)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(utilization, nvmlUtilization_t { gpu, memory: 0 }) }
    }
}

nvml_fn! {
    /// Per-process SM utilization since `last_seen` (µs, wall clock), or
    /// over the last second when it is 0.
    fn nvmlDeviceGetProcessUtilization(
        dev: nvmlDevice_t,
        utilization: *mut nvmlProcessUtilizationSample_t,
        count: *mut c_uint,
        last_seen: c_ulonglong,
    ) {
        let (_, shared, i) = device(dev)?;
        // SAFETY: NVML in/out count.
        let capacity = unsafe { read_count(count) }? as usize;
        let now = clock::now_ns();
        let now_us = clock::realtime_us();
        let window = if last_seen == 0 {
            ONE_SECOND_NS
        } else {
            now_us.saturating_sub(last_seen).saturating_mul(1000)
        }
        .min(now);
        let busy = shared
            .busy_between(i, now - window, now)
            .map_err(|_| NVML_ERROR_UNKNOWN)?;
        let mut samples: Vec<(u32, u64)> = busy.per_pid;
        for (pid, _) in shared.processes(i) {
            if !samples.iter().any(|(p, _)| *p == pid) {
                samples.push((pid, 0));
            }
        }
        if samples.is_empty() || window == 0 {
            // SAFETY: NVML out-pointer.
            unsafe { out(count, 0) }?;
            return Err(NVML_ERROR_NOT_FOUND);
        }
        if utilization.is_null() || capacity < samples.len() {
            // SAFETY: NVML out-pointer.
            unsafe { out(count, samples.len() as c_uint) }?;
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (k, &(pid, ns)) in samples.iter().enumerate() {
            let sample = nvmlProcessUtilizationSample_t {
                pid,
                time_stamp: now_us,
                sm_util: percent(ns, window),
                mem_util: 0,
                enc_util: 0,
                dec_util: 0,
            };
            // SAFETY: the caller's array holds `capacity >= samples.len()`.
            unsafe { utilization.add(k).write_unaligned(sample) };
        }
        // SAFETY: NVML out-pointer.
        unsafe { out(count, samples.len() as c_uint) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetTemperature(dev: nvmlDevice_t, sensor: c_uint, temp: *mut c_uint) {
        let (_, shared, i) = device(dev)?;
        if sensor != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let util = gpu_percent(shared, i)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(temp, 35 + util * 45 / 100) }
    }
}

nvml_fn! {
    /// Milliwatts: idle power plus a share of the limit by utilization.
    fn nvmlDeviceGetPowerUsage(dev: nvmlDevice_t, power: *mut c_uint) {
        let (_, shared, i) = device(dev)?;
        let util = u64::from(gpu_percent(shared, i)?);
        let mw = POWER_IDLE_MW + (u64::from(POWER_LIMIT_MW) - POWER_IDLE_MW) * util / 100;
        // SAFETY: NVML out-pointer.
        unsafe { out(power, mw as c_uint) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetEnforcedPowerLimit(dev: nvmlDevice_t, limit: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(limit, POWER_LIMIT_MW) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetPowerManagementLimit(dev: nvmlDevice_t, limit: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(limit, POWER_LIMIT_MW) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetNumGpuCores(dev: nvmlDevice_t, cores: *mut c_uint) {
        let (cfg, _, _) = device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(cores, cfg.sm_count as c_uint * 128) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetCudaComputeCapability(dev: nvmlDevice_t, major: *mut c_int, minor: *mut c_int) {
        device(dev)?;
        // SAFETY: NVML out-pointers.
        unsafe {
            out(major, 9)?;
            out(minor, 0)
        }
    }
}

nvml_fn! {
    fn nvmlDeviceGetArchitecture(dev: nvmlDevice_t, arch: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(arch, NVML_DEVICE_ARCH_HOPPER) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetPersistenceMode(dev: nvmlDevice_t, mode: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(mode, NVML_FEATURE_ENABLED) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetComputeMode(dev: nvmlDevice_t, mode: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(mode, NVML_COMPUTEMODE_DEFAULT) }
    }
}

nvml_fn! {
    /// MIG is disabled (current and pending).
    fn nvmlDeviceGetMigMode(dev: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) {
        device(dev)?;
        // SAFETY: NVML out-pointers.
        unsafe {
            out(current, 0)?;
            out(pending, 0)
        }
    }
}

// ---- Topology ---------------------------------------------------------------
//
// NUMA nodes and NVLinks come from `SIMGPU_NUMA` / `SIMGPU_NVLINK` (see
// `crate::topology`), in the machine's device indices: a link's far end is
// reported by its PCI info even when this process does not see that device.

/// `nvmlNvLinkDeviceType_t` `NVML_NVLINK_DEVICE_TYPE_GPU`: every simulated
/// link joins two GPUs directly (no NVSwitch).
const NVML_NVLINK_DEVICE_TYPE_GPU: c_uint = 0;

/// The machine's index of the device behind a handle.
fn machine_device(h: nvmlDevice_t) -> Result<(&'static Config, usize), nvmlReturn_t> {
    let (cfg, _, index) = device(h)?;
    Ok((cfg, cfg.visible[index]))
}

/// The peer (machine index) of an active link; NVML's codes otherwise:
/// no NVLink on the machine or an inactive link is `NOT_SUPPORTED`, a link
/// number past `NVML_NVLINK_MAX_LINKS` `INVALID_ARGUMENT`.
fn active_link(h: nvmlDevice_t, link: c_uint) -> Result<usize, nvmlReturn_t> {
    let (cfg, machine) = machine_device(h)?;
    match cfg.topology.link(machine, link as usize) {
        Link::Active(peer) => Ok(peer),
        Link::Inactive | Link::NotSupported => Err(NVML_ERROR_NOT_SUPPORTED),
        Link::OutOfRange => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

nvml_fn! {
    /// The configured NUMA node; `NOT_SUPPORTED` when `SIMGPU_NUMA` is unset
    /// (as on machines whose GPUs are no NUMA nodes of their own).
    fn nvmlDeviceGetNumaNodeId(dev: nvmlDevice_t, node: *mut c_uint) {
        let (cfg, machine) = machine_device(dev)?;
        let numa = cfg.topology.numa_node(machine).ok_or(NVML_ERROR_NOT_SUPPORTED)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(node, numa) }
    }
}

nvml_fn! {
    /// `nvmlGpuTopologyLevel_t` of the two devices' closest common ancestor:
    /// `INTERNAL` for one device, `NODE` on one NUMA node, else `SYSTEM`.
    fn nvmlDeviceGetTopologyCommonAncestor(device1: nvmlDevice_t, device2: nvmlDevice_t, path_info: *mut c_uint) {
        let (cfg, a) = machine_device(device1)?;
        let (_, b) = machine_device(device2)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(path_info, cfg.topology.common_ancestor(a, b)) }
    }
}

nvml_fn! {
    /// `NVML_FEATURE_ENABLED` for a connected link, `DISABLED` for one of
    /// the device's other links.
    fn nvmlDeviceGetNvLinkState(dev: nvmlDevice_t, link: c_uint, is_active: *mut c_uint) {
        let (cfg, machine) = machine_device(dev)?;
        let state = match cfg.topology.link(machine, link as usize) {
            Link::Active(_) => NVML_FEATURE_ENABLED,
            Link::Inactive => NVML_FEATURE_DISABLED,
            Link::NotSupported => return Err(NVML_ERROR_NOT_SUPPORTED),
            Link::OutOfRange => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        // SAFETY: NVML out-pointer.
        unsafe { out(is_active, state) }
    }
}

nvml_fn! {
    /// The PCI info of the GPU at the far end of an active link.
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(dev: nvmlDevice_t, link: c_uint, pci: *mut nvmlPciInfo_t) {
        let peer = active_link(dev, link)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(pci, pci_info_of_bus(config::machine_pci_bus(peer))) }
    }
}

nvml_fn! {
    fn nvmlDeviceGetNvLinkRemoteDeviceType(dev: nvmlDevice_t, link: c_uint, kind: *mut c_uint) {
        active_link(dev, link)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(kind, NVML_NVLINK_DEVICE_TYPE_GPU) }
    }
}

// ---- Events ---------------------------------------------------------------
//
// Only XID critical errors exist in the simulation; tests inject them with
// `simgpu_inject_xid`. Each device keeps the last injected event (a sequence
// number and the XID) in the shared state file; an event set remembers the
// sequence it last reported per registered device and polls.

/// `nvmlEventTypeXidCriticalError`.
const NVML_EVENT_TYPE_XID_CRITICAL_ERROR: c_ulonglong = 0x8;
/// The event types the simulated devices can report.
const SUPPORTED_EVENT_TYPES: c_ulonglong = NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
/// GPU / compute instance id of an event on a device without MIG.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlEventData_t` (the layout `nvmlEventSetWait_v2` fills).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NvmlEventData {
    device: nvmlDevice_t,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// The older event data layout `nvmlEventSetWait` fills.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NvmlEventDataV1 {
    device: nvmlDevice_t,
    event_type: c_ulonglong,
    event_data: c_ulonglong,
}

/// What an `nvmlEventSet_t` points at.
pub struct NvmlEventSet {
    /// (device index, last reported `xid_event` word) per registered device.
    watched: std::sync::Mutex<Vec<(usize, u64)>>,
}

impl NvmlEventSet {
    fn watched(&self) -> std::sync::MutexGuard<'_, Vec<(usize, u64)>> {
        self.watched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The event set behind a handle, if it is non-NULL.
///
/// # Safety
/// `set` must be NULL or a handle from `nvmlEventSetCreate` not yet freed.
unsafe fn event_set<'a>(set: *mut c_void) -> Result<&'a NvmlEventSet, nvmlReturn_t> {
    if set.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: per the caller contract, a live Box<NvmlEventSet>.
    Ok(unsafe { &*(set as *const NvmlEventSet) })
}

nvml_fn! {
    fn nvmlDeviceGetSupportedEventTypes(dev: nvmlDevice_t, types: *mut c_ulonglong) {
        device(dev)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(types, SUPPORTED_EVENT_TYPES) }
    }
}

nvml_fn! {
    fn nvmlEventSetCreate(set: *mut *mut c_void) {
        ready()?;
        let created = Box::into_raw(Box::new(NvmlEventSet {
            watched: std::sync::Mutex::new(Vec::new()),
        }));
        // SAFETY: NVML out-pointer.
        let written = unsafe { out(set, created.cast::<c_void>()) };
        if written.is_err() {
            // SAFETY: just created by Box::into_raw and never shared.
            drop(unsafe { Box::from_raw(created) });
        }
        written
    }
}

nvml_fn! {
    /// Registers `event_types` of `dev` with `set`. Types the simulation
    /// cannot report give `NOT_SUPPORTED`, as on a real GPU.
    fn nvmlDeviceRegisterEvents(dev: nvmlDevice_t, event_types: c_ulonglong, set: *mut c_void) {
        let (_, shared, index) = device(dev)?;
        // SAFETY: C API contract for event set handles.
        let set = unsafe { event_set(set) }?;
        if event_types & !SUPPORTED_EVENT_TYPES != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if event_types == 0 {
            return Ok(());
        }
        let now = shared.device(index).xid_event.load(Ordering::Acquire);
        let mut watched = set.watched();
        if !watched.iter().any(|(i, _)| *i == index) {
            watched.push((index, now));
        }
        Ok(())
    }
}

/// Waits up to `timeout_ms` for an XID on a device registered with `set`.
fn wait_event(set: &NvmlEventSet, timeout_ms: c_uint) -> Result<NvmlEventData, nvmlReturn_t> {
    let (_, shared) = ready()?;
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(u64::from(timeout_ms));
    loop {
        let generation = shared.xid_generation();
        {
            let mut watched = set.watched();
            for (index, seen) in watched.iter_mut() {
                let word = shared.device(*index).xid_event.load(Ordering::Acquire);
                if word >> 32 != *seen >> 32 {
                    *seen = word;
                    return Ok(NvmlEventData {
                        device: handle(*index),
                        event_type: NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
                        event_data: word & 0xFFFF_FFFF,
                        gpu_instance_id: NO_INSTANCE,
                        compute_instance_id: NO_INSTANCE,
                    });
                }
            }
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return Err(NVML_ERROR_TIMEOUT);
        }
        // Blocks until an injection (as a real driver's wait does), not
        // polling: every node agent waits here all the time.
        shared.wait_for_xid(generation, deadline - now);
    }
}

nvml_fn! {
    fn nvmlEventSetWait_v2(set: *mut c_void, data: *mut NvmlEventData, timeout_ms: c_uint) {
        // SAFETY: C API contract for event set handles.
        let set = unsafe { event_set(set) }?;
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let event = wait_event(set, timeout_ms)?;
        // SAFETY: NVML out-pointer.
        unsafe { out(data, event) }
    }
}

nvml_fn! {
    fn nvmlEventSetWait(set: *mut c_void, data: *mut NvmlEventDataV1, timeout_ms: c_uint) {
        // SAFETY: C API contract for event set handles.
        let set = unsafe { event_set(set) }?;
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let event = wait_event(set, timeout_ms)?;
        let old = NvmlEventDataV1 {
            device: event.device,
            event_type: event.event_type,
            event_data: event.event_data,
        };
        // SAFETY: NVML out-pointer.
        unsafe { out(data, old) }
    }
}

nvml_fn! {
    fn nvmlEventSetFree(set: *mut c_void) {
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: C API contract: a handle from nvmlEventSetCreate, freed once.
        drop(unsafe { Box::from_raw(set.cast::<NvmlEventSet>()) });
        Ok(())
    }
}

/// Test hook: injects XID `xid` on `device`, as the driver reports a GPU
/// error. Every event set with the device registered reports it once (an
/// XID injected before a set is registered is not reported to it; of two
/// injected between waits, the later one is reported). Returns the event's
/// sequence number (from 1), or `u64::MAX` for a bad device or an unusable
/// state file.
#[no_mangle]
pub extern "C" fn simgpu_inject_xid(device: c_int, xid: u32) -> u64 {
    std::panic::catch_unwind(|| {
        let Ok(cfg) = config::get() else {
            return u64::MAX;
        };
        if device < 0 || device as usize >= cfg.devices {
            return u64::MAX;
        }
        let Ok(shared) = state::shared() else {
            return u64::MAX;
        };
        let word = &shared.device(device as usize).xid_event;
        let mut current = word.load(Ordering::Acquire);
        loop {
            let sequence = ((current >> 32) as u32).wrapping_add(1).max(1);
            let next = (u64::from(sequence) << 32) | u64::from(xid);
            match word.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    shared.xid_injected();
                    return u64::from(sequence);
                }
                Err(actual) => current = actual,
            }
        }
    })
    .unwrap_or(u64::MAX)
}
