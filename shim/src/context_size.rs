//! What a CUDA context really holds on its device.
//!
//! No driver call reports the memory a context keeps for itself (stacks for
//! every resident thread, the printf and heap buffers, the driver's own
//! tables), and it differs by device and driver: 518 MiB on an H100 with
//! CUDA 13, where a fixed 256 MiB charge let a process hold 262 MiB beyond
//! its cap. So unless an operator set `VGPU_CONTEXT_RESERVE`, the shim reads
//! the device through the driver's own NVML just before and just after it
//! creates a context and charges the difference.
//!
//! The reading prefers this process's own line in NVML's process list,
//! which no other tenant moves; where the process cannot find itself there
//! (a PID namespace that hides the host PID), it falls back to the memory
//! used on the whole device, which another tenant allocating at the same
//! instant would inflate. A difference beyond [`MEASURED_CEILING`] is taken
//! for such noise and ignored; one below the configured reserve is raised to
//! it, since a context also allocates some memory lazily.

use crate::driver::cuda;
use crate::driver::nvml;
use crate::uuid::format_uuid;
use std::ffi::CString;
use std::sync::OnceLock;
use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::nvml::*;

/// A context measured above this is another tenant's allocation caught in
/// the window, not the context.
pub const MEASURED_CEILING: u64 = 2 << 30;
/// Charges are rounded up to the device's allocation granularity.
const GRANULARITY: u64 = 2 << 20;
/// Process-list entries read at most (a device shared by more processes
/// falls back to the device-wide reading).
const MAX_PROCESSES: usize = 64;

/// One reading of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// Memory used on the whole device.
    pub device_used: u64,
    /// Memory this process holds on the device, if it found itself.
    pub process_used: Option<u64>,
}

/// How a context's size was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Process,
    Device,
}

/// The bytes a context holds, from readings before and after its creation:
/// `None` when the readings cannot say (no difference, or one above the
/// ceiling).
pub fn measured(before: Reading, after: Reading) -> Option<(u64, Source)> {
    let (bytes, source) = match (before.process_used, after.process_used) {
        (Some(before), Some(after)) => (after.checked_sub(before)?, Source::Process),
        // Not listed before the context existed: everything listed now is it.
        (None, Some(after)) => (after, Source::Process),
        _ => (
            after.device_used.checked_sub(before.device_used)?,
            Source::Device,
        ),
    };
    (bytes > 0 && bytes <= MEASURED_CEILING)
        .then(|| (bytes.div_ceil(GRANULARITY) * GRANULARITY, source))
}

/// Reads `device` through NVML; `None` where NVML is missing or cannot
/// find the device.
pub fn read(device: CUdevice) -> Option<Reading> {
    let handle = handle(device)?;
    let mut memory = nvmlMemory_t::default();
    // SAFETY: a handle NVML gave; valid out-pointer.
    if unsafe { nvml::nvmlDeviceGetMemoryInfo(handle, &mut memory) } != NVML_SUCCESS {
        return None;
    }
    Some(Reading {
        device_used: memory.used,
        process_used: process_used(handle),
    })
}

fn process_used(handle: nvmlDevice_t) -> Option<u64> {
    let mut infos = [nvmlProcessInfo_t::default(); MAX_PROCESSES];
    let mut count = MAX_PROCESSES as u32;
    // SAFETY: `infos` holds `count` entries.
    let code = unsafe {
        nvml::nvmlDeviceGetComputeRunningProcesses_v3(handle, &mut count, infos.as_mut_ptr())
    };
    if code != NVML_SUCCESS {
        return None;
    }
    let (pid, host_pid) = own_pids();
    infos[..(count as usize).min(MAX_PROCESSES)]
        .iter()
        .find(|info| info.pid == pid || Some(info.pid) == host_pid)
        // NVML reports "not available" as all ones.
        .filter(|info| info.used_gpu_memory != u64::MAX)
        .map(|info| info.used_gpu_memory)
}

fn own_pids() -> (u32, Option<u32>) {
    static HOST_PID: OnceLock<Option<u32>> = OnceLock::new();
    let host_pid = *HOST_PID.get_or_init(vgpu_node_contract::process::outermost_pid);
    (std::process::id(), host_pid)
}

/// NVML's handle for a CUDA device, matched by UUID (the two number
/// devices differently when `CUDA_VISIBLE_DEVICES` reorders them).
fn handle(device: CUdevice) -> Option<nvmlDevice_t> {
    static INITIALISED: OnceLock<bool> = OnceLock::new();
    // SAFETY: no preconditions; NVML counts initialisations, and the shim
    // never shuts it down (a program's own nvmlShutdown stays balanced).
    if !*INITIALISED.get_or_init(|| unsafe { nvml::nvmlInit_v2() } == NVML_SUCCESS) {
        return None;
    }
    let mut uuid = CUuuid::default();
    // SAFETY: valid out-pointer; the driver checks the ordinal.
    if unsafe { cuda::cuDeviceGetUuid(&mut uuid, device) } != CUDA_SUCCESS {
        return None;
    }
    let uuid = CString::new(format_uuid(&uuid.bytes)).ok()?;
    let mut handle: nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: NUL-terminated UUID; valid out-pointer.
    let code = unsafe { nvml::nvmlDeviceGetHandleByUUID(uuid.as_ptr(), &mut handle) };
    (code == NVML_SUCCESS && !handle.is_null()).then_some(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn reading(device: u64, process: Option<u64>) -> Reading {
        Reading {
            device_used: device * MIB,
            process_used: process.map(|p| p * MIB),
        }
    }

    #[test]
    fn the_process_line_wins_over_the_device() {
        // Another tenant allocated 4 GiB meanwhile: only our line is trusted.
        let before = reading(10_000, None);
        let after = reading(14_614, Some(518));
        assert_eq!(measured(before, after), Some((518 * MIB, Source::Process)));
        let before = reading(10_000, Some(1024));
        let after = reading(10_600, Some(1542));
        assert_eq!(measured(before, after), Some((518 * MIB, Source::Process)));
    }

    #[test]
    fn the_device_is_read_when_the_process_cannot_find_itself() {
        let before = reading(10_000, None);
        let after = reading(10_517, None);
        assert_eq!(
            measured(before, after),
            Some((518 * MIB, Source::Device)),
            "rounded up to 2 MiB"
        );
    }

    #[test]
    fn readings_that_cannot_be_a_context_say_nothing() {
        assert_eq!(measured(reading(10_000, None), reading(10_000, None)), None);
        assert_eq!(
            measured(reading(10_000, None), reading(9_000, None)),
            None,
            "another tenant freed memory meanwhile"
        );
        assert_eq!(
            measured(reading(10_000, None), reading(13_000, None)),
            None,
            "3 GiB is another tenant's allocation"
        );
        assert_eq!(measured(reading(0, Some(600)), reading(0, Some(500))), None);
    }
}
