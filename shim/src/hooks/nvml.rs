//! NVML: how `nvidia-smi` and monitoring libraries see the device from
//! inside the container. Total memory is the cap, used memory is what the
//! container holds, and the process list shows the container's processes
//! with the memory charged to each.

use crate::driver::nvml as real;
use crate::driver::nvml::signature;
use crate::enforcer::{mode, Enforcer, Mode};
use std::ffi::{c_char, CStr};
use vgpu_cuda_abi::nvml::*;
use vgpu_interpose::Real;
use vgpu_node_contract::region::MAX_DEVICES;

/// The CUDA ordinal an NVML device corresponds to: by UUID when a process of
/// the container has recorded the devices' UUIDs, else by NVML index (the
/// same order inside a container whose devices the runtime restricted).
fn ordinal_of(enforcer: &Enforcer, device: nvmlDevice_t) -> Option<usize> {
    let mut buffer = [0 as c_char; 96];
    // SAFETY: buffer and length agree.
    if unsafe { real::nvmlDeviceGetUUID(device, buffer.as_mut_ptr(), buffer.len() as u32) }
        == NVML_SUCCESS
    {
        // SAFETY: NVML NUL-terminates within the given length.
        let uuid = unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy();
        if let Some(ordinal) =
            (0..MAX_DEVICES).find(|i| enforcer.region.device_uuid(*i).as_deref() == Some(&uuid))
        {
            return Some(ordinal);
        }
    }
    let mut index = 0u32;
    // SAFETY: valid out-pointer.
    if unsafe { real::nvmlDeviceGetIndex(device, &mut index) } == NVML_SUCCESS
        && (index as usize) < MAX_DEVICES
    {
        return Some(index as usize);
    }
    None
}

/// The capped view of a device: (total, used), when it has a cap. Host
/// memory swap counts in both, as `cuMemGetInfo` reports it.
fn capped_memory(enforcer: &Enforcer, device: nvmlDevice_t) -> Option<(u64, u64)> {
    let ordinal = ordinal_of(enforcer, device)?;
    let limit = enforcer.region.device_limit(ordinal);
    (limit > 0).then(|| {
        let region = &enforcer.region;
        (
            limit.saturating_add(region.device_swap_limit(ordinal)),
            region
                .device_used(ordinal)
                .saturating_add(region.device_swap_used(ordinal)),
        )
    })
}

#[inline(always)]
pub(crate) unsafe fn nvmlInit_v2(driver: Real<signature::nvmlInit_v2>) -> nvmlReturn_t {
    if let Mode::FailClosed = mode() {
        return NVML_ERROR_UNKNOWN;
    }
    // SAFETY: forwarded unchanged.
    unsafe { (driver.call)() }
}

#[inline(always)]
pub(crate) unsafe fn nvmlInitWithFlags(
    driver: Real<signature::nvmlInitWithFlags>,
    flags: u32,
) -> nvmlReturn_t {
    if let Mode::FailClosed = mode() {
        return NVML_ERROR_UNKNOWN;
    }
    // SAFETY: forwarded unchanged.
    unsafe { (driver.call)(flags) }
}

#[inline(always)]
pub(crate) unsafe fn nvmlDeviceGetMemoryInfo(
    driver: Real<signature::nvmlDeviceGetMemoryInfo>,
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(device, memory) };
    match mode() {
        Mode::FailClosed => NVML_ERROR_UNKNOWN,
        Mode::Enforce(enforcer) if code == NVML_SUCCESS && !memory.is_null() => {
            if let Some((total, used)) = capped_memory(enforcer, device) {
                // SAFETY: written by the successful call.
                let memory = unsafe { &mut *memory };
                memory.total = total;
                memory.used = used.min(total);
                memory.free = total.saturating_sub(used);
            }
            code
        }
        _ => code,
    }
}

#[inline(always)]
pub(crate) unsafe fn nvmlDeviceGetMemoryInfo_v2(
    driver: Real<signature::nvmlDeviceGetMemoryInfo_v2>,
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: forwarded unchanged.
    let code = unsafe { (driver.call)(device, memory) };
    match mode() {
        Mode::FailClosed => NVML_ERROR_UNKNOWN,
        Mode::Enforce(enforcer) if code == NVML_SUCCESS && !memory.is_null() => {
            if let Some((total, used)) = capped_memory(enforcer, device) {
                // SAFETY: written by the successful call.
                let memory = unsafe { &mut *memory };
                memory.total = total;
                memory.reserved = 0;
                memory.used = used.min(total);
                memory.free = total.saturating_sub(used);
            }
            code
        }
        _ => code,
    }
}

/// Keeps only the container's processes in an NVML process list, each with
/// the memory charged to it, compacting the array in place.
///
/// # Safety
/// `count` and `infos` must be as NVML returned them for a successful call.
unsafe fn filter_processes<T>(
    enforcer: &Enforcer,
    device: nvmlDevice_t,
    count: *mut u32,
    infos: *mut T,
    pid: impl Fn(&T) -> u32,
    set_memory: impl Fn(&mut T, u64),
) {
    if count.is_null() || infos.is_null() {
        return;
    }
    let Some(ordinal) = ordinal_of(enforcer, device) else {
        return;
    };
    // SAFETY: NVML wrote `*count` entries.
    let entries = unsafe { std::slice::from_raw_parts_mut(infos, *count as usize) };
    let slots = &enforcer.region.layout().slots;
    let mut kept = 0;
    for index in 0..entries.len() {
        let process_pid = pid(&entries[index]);
        let charged = enforcer
            .region
            .active_slots()
            .map(|slot| &slots[slot])
            .find(|slot| slot.nvml_pid() == process_pid)
            .map(|slot| slot.devices[ordinal].device_bytes());
        if let Some(bytes) = charged {
            entries.swap(kept, index);
            set_memory(&mut entries[kept], bytes);
            kept += 1;
        }
    }
    // SAFETY: as above.
    unsafe { *count = kept as u32 };
}

macro_rules! process_list_hook {
    ($name:ident, $info:ty) => {
        #[inline(always)]
        pub(crate) unsafe fn $name(
            driver: Real<signature::$name>,
            device: nvmlDevice_t,
            count: *mut u32,
            infos: *mut $info,
        ) -> nvmlReturn_t {
            // SAFETY: forwarded unchanged.
            let code = unsafe { (driver.call)(device, count, infos) };
            if let (NVML_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
                // SAFETY: the call succeeded, so `count` and `infos` hold the list.
                unsafe {
                    filter_processes(
                        enforcer,
                        device,
                        count,
                        infos,
                        |info| info.pid,
                        |info, bytes| info.used_gpu_memory = bytes,
                    )
                };
            }
            code
        }
    };
}

process_list_hook!(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t);
process_list_hook!(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_t);
process_list_hook!(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t);
