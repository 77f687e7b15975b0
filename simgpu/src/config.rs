//! Configuration from the environment, read once per process.
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `SIMGPU_DEVICES` | number of devices the machine has (0..=16) | 1 |
//! | `SIMGPU_VISIBLE_DEVICES` | the ones this process sees, as a container runtime exposes them: `all`, `none`, or indices and UUIDs separated by commas | `all` |
//! | `SIMGPU_MEMORY` | memory per device (size string) | `16Gi` |
//! | `SIMGPU_MEMORY_<i>` | memory of device `i` | `SIMGPU_MEMORY` |
//! | `SIMGPU_SM_COUNT` | multiprocessors per device (1..=1024) | 132 |
//! | `SIMGPU_NAME` | device name | `vgpu Simulated GPU` |
//! | `SIMGPU_UUID_SEED` | any text; changes every device UUID | none |
//! | `SIMGPU_STATE` | path of the shared state file | `/tmp/simgpu-state-<uid>` |
//! | `SIMGPU_CONTEXT_BYTES` | device memory one context costs (size) | 0 |
//! | `SIMGPU_DRIVER_VERSION` | `cuDriverGetVersion` value | 12080 |
//! | `SIMGPU_NVML_DRIVER_VERSION` | NVML driver version string | `580.00.00` |
//! | `SIMGPU_NUMA` | NUMA node of each device, in device order (`0,0,1,1`) | unknown |
//! | `SIMGPU_NVLINK` | NVLink groups, `;`-separated, each joined all-to-all (`0,2;1,3`) | no NVLink |
//! | `SIMGPU_LOST_DEVICES` | devices fallen off the bus, by the machine's index (`1,3`): NVML queries on them answer `NVML_ERROR_GPU_IS_LOST` | none |
//! | `SIMGPU_TIMING` | `timeline`: a launch places its kernel on the shared timeline at once, with its exact duration; `wall`: each process's device is a thread that runs the queued work in wall-clock time (see [`crate::executor`]) | `timeline` |
//! | `SIMGPU_LAUNCH_OVERHEAD` | host time each launch call spends before its work reaches the device (a duration) | `4us` with `wall`, else `0ns` |
//! | `SIMGPU_KERNELS` | durations that replace what module images declare, by kernel name: `k1ms=200us,k30ms=5ms` | none |
//! | `SIMGPU_SWITCH_COST` | wall timing only: device time spent, and given to no process, each time the device passes from one process's work to another's, as a GPU spends it saving one context and loading the next (a duration up to 1s: `60us`) | `0ns` |
//! | `SIMGPU_LATE_RETURNS` | launch calls that return late, as a call whose thread is preempted just after its kernel reached the device does: `3ms@2-6` holds the 2nd to 6th kernel launch calls of each process for 3 ms after their work was handed over (a duration up to 1s, calls counted from 1) | none |
//! | `CUDA_LAUNCH_BLOCKING` | `1`: every kernel and graph launch returns only once its work has finished, as NVIDIA's driver does with the same variable | `0` |
//! | `SIMGPU_KERNEL_JITTER` | how much a kernel's time varies from run to run, as a GPU's does with its clocks: each kernel runs its duration times a factor drawn uniformly from 1 ± this (`5%`, below 100 %) | `0%` |
//!
//! The topology variables are described in [`crate::topology`].
//!
//! A bad value is reported in one line on stderr; `cuInit` then returns
//! `CUDA_ERROR_INVALID_VALUE` and `nvmlInit` `NVML_ERROR_UNKNOWN`.

use std::path::PathBuf;
use std::sync::OnceLock;

use vgpu_node_contract::size::parse_size;

use crate::clock::parse_duration;
use crate::topology::{self, Topology};

/// Most devices the simulation supports (and the state file lays out).
pub const MAX_DEVICES: usize = 16;

/// How kernels take their time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// A launch places its kernel on the shared timeline when it is made:
    /// it starts when the device is free and lasts exactly its duration.
    Timeline,
    /// Each process's device is a thread that runs the queued work as it
    /// comes, in wall-clock time (see [`crate::executor`]).
    Wall,
}

/// Host time a launch costs in `wall` timing unless configured: about what
/// `cuLaunchKernel` takes on current GPUs.
pub const WALL_LAUNCH_OVERHEAD_NS: u64 = 4_000;

/// The simulated machine, and the devices this process sees of it.
///
/// `devices`, `memory` and `uuids` describe the visible devices, by the
/// process's ordinal (0..devices, in the machine's order, as CUDA and NVML
/// number them inside a container); the shared state is laid out for the
/// whole machine (`machine_devices`, `machine_memory`).
#[derive(Debug, Clone)]
pub struct Config {
    pub devices: usize,
    pub memory: Vec<u64>,
    /// The machine's index of each visible device.
    pub visible: Vec<usize>,
    pub machine_devices: usize,
    pub machine_memory: Vec<u64>,
    pub sm_count: i32,
    pub name: String,
    pub uuids: Vec<[u8; 16]>,
    pub state_path: PathBuf,
    pub context_bytes: u64,
    pub driver_version: i32,
    pub nvml_driver_version: String,
    /// NUMA nodes and NVLinks, in the machine's indices.
    pub topology: Topology,
    /// The machine's indices of the devices NVML reports lost.
    pub lost: Vec<usize>,
    pub timing: Timing,
    /// Host time a launch call spends before its work reaches the device.
    pub launch_overhead_ns: u64,
    /// Kernel durations that replace the modules' own, by name.
    pub kernel_durations: Vec<(String, u64)>,
    /// A kernel's time varies by up to this fraction either way.
    pub kernel_jitter: f64,
    /// Wall timing: device time each switch between processes costs.
    pub switch_cost_ns: u64,
    /// Launch calls held up after handing their kernel over.
    pub late_returns: Option<LateReturns>,
    /// Launch calls return only once their work has finished
    /// (`CUDA_LAUNCH_BLOCKING=1`).
    pub launch_blocking: bool,
}

/// Launch calls `first..=last` of a process (counted from 1) return
/// `delay_ns` after their work reached the device (`SIMGPU_LATE_RETURNS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateReturns {
    pub delay_ns: u64,
    pub first: u64,
    pub last: u64,
}

impl LateReturns {
    /// How long launch call number `call` (from 1) is held after its work
    /// left.
    pub fn delay_of(&self, call: u64) -> u64 {
        if (self.first..=self.last).contains(&call) {
            self.delay_ns
        } else {
            0
        }
    }
}

impl Config {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` for device `index`.
    pub fn uuid_string(&self, index: usize) -> String {
        format_uuid(&self.uuids[index])
    }

    /// Whether visible device `index` has fallen off the bus.
    pub fn is_lost(&self, index: usize) -> bool {
        self.lost.contains(&self.visible[index])
    }

    /// How long kernel `name` runs: `SIMGPU_KERNELS`' duration for it, else
    /// what its module declared.
    pub fn kernel_duration(&self, name: &str, declared_ns: u64) -> u64 {
        self.kernel_durations
            .iter()
            .find(|(kernel, _)| kernel == name)
            .map_or(declared_ns, |&(_, ns)| ns)
    }

    /// How long one run of a kernel of `duration_ns` takes: the duration
    /// varied by up to `kernel_jitter` either way (uniformly, so on average
    /// it is the duration).
    pub fn draw_duration(&self, duration_ns: u64) -> u64 {
        if self.kernel_jitter <= 0.0 {
            return duration_ns;
        }
        let factor = 1.0 + self.kernel_jitter * (2.0 * uniform() - 1.0);
        (duration_ns as f64 * factor).round() as u64
    }

    /// PCI bus number of device `index` (domain 0, device 0, function 0):
    /// the machine's, so it is the same in every process.
    pub fn pci_bus(&self, index: usize) -> u32 {
        machine_pci_bus(self.visible[index])
    }
}

/// PCI bus number of the machine's device `machine`.
pub fn machine_pci_bus(machine: usize) -> u32 {
    machine as u32 + 1
}

/// Formats 16 bytes the way NVIDIA prints GPU UUIDs.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();

/// The process's configuration; the first call reads the environment and
/// reports a bad value on stderr (once).
pub fn get() -> Result<&'static Config, ()> {
    let loaded = CONFIG.get_or_init(|| {
        let result = from_env(|name| std::env::var(name).ok());
        if let Err(message) = &result {
            crate::ffi::warn(message);
        }
        result
    });
    loaded.as_ref().map_err(|_| ())
}

/// A uniform draw from [0, 1): SplitMix64 over a per-process counter,
/// seeded from the clock and the pid (not reproducible between runs, and
/// not meant to be).
fn uniform() -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STATE: AtomicU64 = AtomicU64::new(0);
    if STATE.load(Ordering::Relaxed) == 0 {
        let seed = (crate::clock::now_ns() ^ u64::from(std::process::id()).rotate_left(32)) | 1;
        // Another thread may have seeded it first; either seed will do.
        let _ = STATE.compare_exchange(0, seed, Ordering::Relaxed, Ordering::Relaxed);
    }
    let x = splitmix64(STATE.fetch_add(1, Ordering::Relaxed));
    (x >> 11) as f64 / (1u64 << 53) as f64
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Deterministic UUID bytes for a device index and seed.
fn uuid_bytes(seed: u64, index: usize) -> [u8; 16] {
    let a = splitmix64(seed ^ (index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5157);
    let b = splitmix64(a ^ 0x6a09_e667_f3bc_c908);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&a.to_be_bytes());
    out[8..].copy_from_slice(&b.to_be_bytes());
    out
}

fn parse_int<T: std::str::FromStr + PartialOrd + Copy + std::fmt::Display>(
    name: &str,
    text: &str,
    min: T,
    max: T,
) -> Result<T, String> {
    match text.trim().parse::<T>() {
        Ok(v) if v >= min && v <= max => Ok(v),
        _ => Err(format!(
            "bad {name}={text:?}: expected a whole number from {min} to {max}"
        )),
    }
}

fn parse_bytes(name: &str, text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|e| format!("bad {name}={text:?}: {e}"))
}

/// The machine's indices `SIMGPU_VISIBLE_DEVICES` names, in the machine's
/// order: `all`, `none` (also `void` and empty, as the NVIDIA runtime
/// reads them), or indices and UUIDs separated by commas.
fn parse_visible(text: &str, uuids: &[[u8; 16]]) -> Result<Vec<usize>, String> {
    let text = text.trim();
    match text {
        "all" => return Ok((0..uuids.len()).collect()),
        "" | "none" | "void" => return Ok(Vec::new()),
        _ => {}
    }
    let mut visible = Vec::new();
    for item in text.split(',').map(str::trim) {
        let index = match item.parse::<usize>() {
            Ok(index) if index < uuids.len() => Some(index),
            Ok(_) => None,
            Err(_) => uuids
                .iter()
                .position(|uuid| format_uuid(uuid).eq_ignore_ascii_case(item)),
        };
        match index {
            Some(index) if !visible.contains(&index) => visible.push(index),
            Some(_) => {}
            None => {
                return Err(format!(
                    "bad SIMGPU_VISIBLE_DEVICES={text:?}: {item:?} is no device of this machine (it has {})",
                    uuids.len()
                ))
            }
        }
    }
    visible.sort_unstable();
    Ok(visible)
}

/// Builds the configuration from a variable lookup (the environment, or a
/// map in unit tests).
pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
    let devices = match var("SIMGPU_DEVICES") {
        Some(v) => parse_int("SIMGPU_DEVICES", &v, 0usize, MAX_DEVICES)?,
        None => 1,
    };
    let default_memory = match var("SIMGPU_MEMORY") {
        Some(v) => parse_bytes("SIMGPU_MEMORY", &v)?,
        None => 16 << 30,
    };
    if default_memory == 0 {
        return Err("bad SIMGPU_MEMORY=\"0\": a device needs some memory".to_string());
    }
    let mut memory = Vec::with_capacity(devices);
    for i in 0..devices {
        let name = format!("SIMGPU_MEMORY_{i}");
        let bytes = match var(&name) {
            Some(v) => parse_bytes(&name, &v)?,
            None => default_memory,
        };
        if bytes == 0 {
            return Err(format!("bad {name}=\"0\": a device needs some memory"));
        }
        memory.push(bytes);
    }
    let sm_count = match var("SIMGPU_SM_COUNT") {
        Some(v) => parse_int("SIMGPU_SM_COUNT", &v, 1i32, 1024)?,
        None => 132,
    };
    let name = match var("SIMGPU_NAME") {
        Some(v) if v.trim().is_empty() || v.len() > 95 => {
            return Err(format!(
                "bad SIMGPU_NAME={v:?}: expected 1 to 95 characters"
            ))
        }
        Some(v) => v,
        None => "vgpu Simulated GPU".to_string(),
    };
    let seed = var("SIMGPU_UUID_SEED").map(|s| fnv1a(&s)).unwrap_or(0);
    let uuids: Vec<[u8; 16]> = (0..devices).map(|i| uuid_bytes(seed, i)).collect();
    let state_path = match var("SIMGPU_STATE") {
        Some(v) if v.trim().is_empty() => {
            return Err("bad SIMGPU_STATE=\"\": expected a file path".to_string())
        }
        Some(v) => PathBuf::from(v),
        None => {
            // SAFETY: getuid has no preconditions and cannot fail.
            let uid = unsafe { libc::getuid() };
            PathBuf::from(format!("/tmp/simgpu-state-{uid}"))
        }
    };
    let context_bytes = match var("SIMGPU_CONTEXT_BYTES") {
        Some(v) => parse_bytes("SIMGPU_CONTEXT_BYTES", &v)?,
        None => 0,
    };
    let driver_version = match var("SIMGPU_DRIVER_VERSION") {
        Some(v) => parse_int("SIMGPU_DRIVER_VERSION", &v, 1000i32, 99_990)?,
        None => 12080,
    };
    let nvml_driver_version = match var("SIMGPU_NVML_DRIVER_VERSION") {
        Some(v) if v.trim().is_empty() || v.len() > 70 => {
            return Err(format!(
                "bad SIMGPU_NVML_DRIVER_VERSION={v:?}: expected 1 to 70 characters"
            ))
        }
        Some(v) => v,
        None => "580.00.00".to_string(),
    };
    let topology = topology::from_env(&var, devices)?;
    let visible = match var("SIMGPU_VISIBLE_DEVICES") {
        Some(v) => parse_visible(&v, &uuids)?,
        None => (0..devices).collect(),
    };
    let lost = match var("SIMGPU_LOST_DEVICES") {
        Some(v) => parse_lost(&v, devices)?,
        None => Vec::new(),
    };
    let timing = match var("SIMGPU_TIMING").as_deref().map(str::trim) {
        None | Some("timeline") => Timing::Timeline,
        Some("wall") => Timing::Wall,
        Some(other) => {
            return Err(format!(
                "bad SIMGPU_TIMING={other:?}: expected timeline or wall"
            ))
        }
    };
    let launch_overhead_ns = match var("SIMGPU_LAUNCH_OVERHEAD") {
        Some(v) => parse_duration(&v)
            .filter(|&ns| ns <= 1_000_000_000)
            .ok_or_else(|| {
                format!("bad SIMGPU_LAUNCH_OVERHEAD={v:?}: expected a duration up to 1s (4us)")
            })?,
        None if timing == Timing::Wall => WALL_LAUNCH_OVERHEAD_NS,
        None => 0,
    };
    let switch_cost_ns = match var("SIMGPU_SWITCH_COST") {
        Some(v) => {
            let ns = parse_duration(&v)
                .filter(|&ns| ns <= 1_000_000_000)
                .ok_or_else(|| {
                    format!("bad SIMGPU_SWITCH_COST={v:?}: expected a duration up to 1s (60us)")
                })?;
            // Timeline timing places kernels back to back when they are
            // launched and never hands the device between processes: a
            // cost there would silently do nothing.
            if ns > 0 && timing != Timing::Wall {
                return Err(format!(
                    "bad SIMGPU_SWITCH_COST={v:?}: only wall timing switches between processes (SIMGPU_TIMING=wall)"
                ));
            }
            ns
        }
        None => 0,
    };
    let kernel_durations = match var("SIMGPU_KERNELS") {
        Some(v) => parse_kernel_durations(&v)?,
        None => Vec::new(),
    };
    let late_returns = match var("SIMGPU_LATE_RETURNS") {
        Some(v) => Some(parse_late_returns(&v).ok_or_else(|| {
            format!(
                "bad SIMGPU_LATE_RETURNS={v:?}: expected DURATION@FIRST-LAST, a duration up to 1s and launch calls counted from 1 (3ms@2-6)"
            )
        })?),
        None => None,
    };
    let launch_blocking = match var("CUDA_LAUNCH_BLOCKING").as_deref().map(str::trim) {
        None | Some("") | Some("0") => false,
        Some("1") => true,
        Some(other) => {
            return Err(format!(
                "bad CUDA_LAUNCH_BLOCKING={other:?}: expected 0 or 1"
            ))
        }
    };
    let kernel_jitter = match var("SIMGPU_KERNEL_JITTER") {
        Some(v) => parse_fraction(&v).ok_or_else(|| {
            format!("bad SIMGPU_KERNEL_JITTER={v:?}: expected a percentage below 100 (5%)")
        })?,
        None => 0.0,
    };
    Ok(Config {
        devices: visible.len(),
        memory: visible.iter().map(|&i| memory[i]).collect(),
        uuids: visible.iter().map(|&i| uuids[i]).collect(),
        visible,
        machine_devices: devices,
        machine_memory: memory,
        sm_count,
        name,
        state_path,
        context_bytes,
        driver_version,
        nvml_driver_version,
        topology,
        lost,
        timing,
        launch_overhead_ns,
        kernel_durations,
        kernel_jitter,
        switch_cost_ns,
        late_returns,
        launch_blocking,
    })
}

/// `DURATION@FIRST-LAST` (`SIMGPU_LATE_RETURNS`); a single call number
/// stands for itself.
fn parse_late_returns(text: &str) -> Option<LateReturns> {
    let (duration, calls) = text.trim().split_once('@')?;
    let delay_ns = parse_duration(duration).filter(|&ns| ns <= 1_000_000_000)?;
    let (first, last) = calls.split_once('-').unwrap_or((calls, calls));
    let first: u64 = first.trim().parse().ok()?;
    let last: u64 = last.trim().parse().ok()?;
    (first >= 1 && first <= last).then_some(LateReturns {
        delay_ns,
        first,
        last,
    })
}

/// A percentage from 0 up to (not including) 100 as a fraction: `5%`.
fn parse_fraction(text: &str) -> Option<f64> {
    let percent: f64 = text.trim().strip_suffix('%')?.trim().parse().ok()?;
    (0.0..100.0).contains(&percent).then_some(percent / 100.0)
}

/// `name=duration` pairs separated by commas (`SIMGPU_KERNELS`).
fn parse_kernel_durations(text: &str) -> Result<Vec<(String, u64)>, String> {
    let mut durations: Vec<(String, u64)> = Vec::new();
    for item in text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
    {
        let parsed = item.split_once('=').and_then(|(name, duration)| {
            let name = name.trim();
            let ns = parse_duration(duration)?;
            (!name.is_empty() && !name.contains(char::is_whitespace))
                .then(|| (name.to_string(), ns))
        });
        match parsed {
            Some((name, ns)) => {
                durations.retain(|(kernel, _)| *kernel != name);
                durations.push((name, ns));
            }
            None => {
                return Err(format!(
                    "bad SIMGPU_KERNELS={text:?}: {item:?} is not NAME=DURATION (k1ms=200us)"
                ))
            }
        }
    }
    Ok(durations)
}

/// The machine's indices `SIMGPU_LOST_DEVICES` names: indices separated by
/// commas (empty: none).
fn parse_lost(text: &str, devices: usize) -> Result<Vec<usize>, String> {
    let mut lost = Vec::new();
    for item in text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
    {
        match item.parse::<usize>() {
            Ok(index) if index < devices => {
                if !lost.contains(&index) {
                    lost.push(index);
                }
            }
            _ => {
                return Err(format!(
                    "bad SIMGPU_LOST_DEVICES={text:?}: {item:?} is no device index of this machine (it has {devices})"
                ))
            }
        }
    }
    Ok(lost)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).expect("defaults are valid");
        assert_eq!(c.devices, 1);
        assert_eq!(c.memory, vec![16 << 30]);
        assert_eq!(c.sm_count, 132);
        assert_eq!(c.driver_version, 12080);
        assert_eq!(c.context_bytes, 0);
        assert!(c
            .state_path
            .to_string_lossy()
            .starts_with("/tmp/simgpu-state-"));
    }

    #[test]
    fn per_device_memory() {
        let c = cfg(&[
            ("SIMGPU_DEVICES", "3"),
            ("SIMGPU_MEMORY", "8Gi"),
            ("SIMGPU_MEMORY_1", "4096m"),
        ])
        .expect("valid");
        assert_eq!(c.memory, vec![8 << 30, 4 << 30, 8 << 30]);
    }

    #[test]
    fn bad_values() {
        for pairs in [
            [("SIMGPU_DEVICES", "17")],
            [("SIMGPU_DEVICES", "x")],
            [("SIMGPU_MEMORY", "1.5g")],
            [("SIMGPU_MEMORY", "0")],
            [("SIMGPU_SM_COUNT", "0")],
            [("SIMGPU_CONTEXT_BYTES", "lots")],
            [("SIMGPU_DRIVER_VERSION", "twelve")],
            [("SIMGPU_NAME", "")],
            [("SIMGPU_NUMA", "0,1")],
            [("SIMGPU_NVLINK", "0,1")],
            [("SIMGPU_TIMING", "virtual")],
            [("SIMGPU_LAUNCH_OVERHEAD", "4")],
            [("SIMGPU_LAUNCH_OVERHEAD", "2s")],
            [("SIMGPU_KERNELS", "k1ms")],
            [("SIMGPU_KERNELS", "k1ms=fast")],
            [("SIMGPU_KERNELS", "=1ms")],
            [("SIMGPU_KERNEL_JITTER", "5")],
            [("SIMGPU_KERNEL_JITTER", "100%")],
            [("SIMGPU_KERNEL_JITTER", "-1%")],
            [("SIMGPU_SWITCH_COST", "60")],
            [("SIMGPU_SWITCH_COST", "2s")],
            [("SIMGPU_SWITCH_COST", "60us")],
        ] {
            let err = cfg(&pairs).expect_err("must be rejected");
            assert!(err.contains(pairs[0].0), "{err}");
            assert!(!err.contains('\n'));
        }
    }

    #[test]
    fn timing_launch_overhead_and_kernel_durations() {
        let plain = cfg(&[]).expect("valid");
        assert_eq!(
            (plain.timing, plain.launch_overhead_ns),
            (Timing::Timeline, 0)
        );
        assert!(plain.kernel_durations.is_empty());
        assert_eq!(plain.kernel_duration("k1ms", 1_000_000), 1_000_000);
        let wall = cfg(&[("SIMGPU_TIMING", "wall")]).expect("valid");
        assert_eq!(
            (wall.timing, wall.launch_overhead_ns),
            (Timing::Wall, WALL_LAUNCH_OVERHEAD_NS)
        );
        let tuned = cfg(&[
            ("SIMGPU_TIMING", "wall"),
            ("SIMGPU_LAUNCH_OVERHEAD", "10us"),
            ("SIMGPU_KERNELS", "k1ms=200us, k30ms=5ms,k1ms=250us"),
        ])
        .expect("valid");
        assert_eq!(tuned.launch_overhead_ns, 10_000);
        assert_eq!(
            tuned.kernel_duration("k1ms", 1_000_000),
            250_000,
            "the last one wins"
        );
        assert_eq!(tuned.kernel_duration("k30ms", 30_000_000), 5_000_000);
        assert_eq!(tuned.kernel_duration("k20us", 20_000), 20_000);
        let timeline_with_overhead = cfg(&[("SIMGPU_LAUNCH_OVERHEAD", "2us")]).expect("valid");
        assert_eq!(timeline_with_overhead.launch_overhead_ns, 2_000);
    }

    #[test]
    fn late_returns_name_a_duration_and_a_range_of_calls() {
        assert_eq!(cfg(&[]).expect("valid").late_returns, None);
        let late = cfg(&[("SIMGPU_LATE_RETURNS", "3ms@2-6")])
            .expect("valid")
            .late_returns
            .expect("set");
        assert_eq!(
            (
                late.delay_of(1),
                late.delay_of(2),
                late.delay_of(6),
                late.delay_of(7)
            ),
            (0, 3_000_000, 3_000_000, 0)
        );
        let one = cfg(&[("SIMGPU_LATE_RETURNS", " 50us @ 3 ")])
            .expect("valid")
            .late_returns
            .expect("set");
        assert_eq!((one.first, one.last, one.delay_ns), (3, 3, 50_000));
        for bad in ["3ms", "3ms@0-2", "3ms@5-2", "2s@1-2", "x@1-2", "3ms@1-"] {
            let err = cfg(&[("SIMGPU_LATE_RETURNS", bad)]).expect_err(bad);
            assert!(err.contains("SIMGPU_LATE_RETURNS"), "{err}");
        }
    }

    #[test]
    fn a_switch_cost_is_a_duration_for_wall_timing() {
        assert_eq!(cfg(&[]).expect("valid").switch_cost_ns, 0);
        let wall = cfg(&[("SIMGPU_TIMING", "wall"), ("SIMGPU_SWITCH_COST", "60us")]);
        assert_eq!(wall.expect("valid").switch_cost_ns, 60_000);
        // Timeline timing refuses a cost it would not charge (see
        // `bad_values`), but not an explicit zero.
        let zero = cfg(&[("SIMGPU_SWITCH_COST", "0us")]).expect("valid");
        assert_eq!(zero.switch_cost_ns, 0);
        let err = cfg(&[("SIMGPU_SWITCH_COST", "60us")]).expect_err("timeline");
        assert!(err.contains("SIMGPU_TIMING=wall"), "{err}");
    }

    #[test]
    fn jitter_varies_a_kernel_within_its_band_around_its_duration() {
        let steady = cfg(&[]).expect("valid");
        assert_eq!(steady.draw_duration(200_000), 200_000);
        let jittery = cfg(&[("SIMGPU_KERNEL_JITTER", "10%")]).expect("valid");
        assert_eq!(jittery.kernel_jitter, 0.1);
        let draws: Vec<u64> = (0..20_000)
            .map(|_| jittery.draw_duration(200_000))
            .collect();
        assert!(draws.iter().all(|d| (180_000..=220_000).contains(d)));
        let mean = draws.iter().sum::<u64>() as f64 / draws.len() as f64;
        // The mean of 20000 uniform draws is within 0.2 % of the middle
        // (its standard error is 0.04 %).
        assert!((mean / 200_000.0 - 1.0).abs() < 0.002, "{mean}");
        let low = draws.iter().filter(|&&d| d < 190_000).count();
        assert!((4_500..5_500).contains(&low), "a quarter below -5 %: {low}");
    }

    #[test]
    fn topology_is_read_for_the_whole_machine() {
        let c = cfg(&[
            ("SIMGPU_DEVICES", "4"),
            ("SIMGPU_NUMA", "0,0,1,1"),
            ("SIMGPU_NVLINK", "0,2;1,3"),
            ("SIMGPU_VISIBLE_DEVICES", "1,2"),
        ])
        .expect("valid");
        assert_eq!(c.topology.numa, Some(vec![0, 0, 1, 1]));
        assert_eq!(
            c.topology.nvlinks,
            Some(vec![vec![2], vec![3], vec![0], vec![1]])
        );
        let error =
            cfg(&[("SIMGPU_DEVICES", "2"), ("SIMGPU_NVLINK", "0,2")]).expect_err("GPU 2 of 2");
        assert!(error.contains("GPU 2"), "{error}");
    }

    #[test]
    fn uuids_are_deterministic_and_distinct() {
        let a = cfg(&[("SIMGPU_DEVICES", "4")]).expect("valid");
        let b = cfg(&[("SIMGPU_DEVICES", "4")]).expect("valid");
        let c = cfg(&[("SIMGPU_DEVICES", "4"), ("SIMGPU_UUID_SEED", "x")]).expect("valid");
        assert_eq!(a.uuids, b.uuids);
        assert_ne!(a.uuids, c.uuids);
        let s = a.uuid_string(0);
        assert_eq!(s.len(), 40);
        assert!(s.starts_with("GPU-"));
        let parts: Vec<usize> = s[4..].split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12]);
        assert_ne!(a.uuids[0], a.uuids[1]);
    }

    #[test]
    fn visible_devices_pick_the_machines_devices_in_its_order() {
        let machine = cfg(&[("SIMGPU_DEVICES", "4"), ("SIMGPU_MEMORY_2", "8Gi")]).expect("valid");
        let third = machine.uuid_string(2);
        let some = cfg(&[
            ("SIMGPU_DEVICES", "4"),
            ("SIMGPU_MEMORY_2", "8Gi"),
            (
                "SIMGPU_VISIBLE_DEVICES",
                &format!("{},1", third.to_lowercase()),
            ),
        ])
        .expect("valid");
        assert_eq!(some.visible, vec![1, 2]);
        assert_eq!(some.devices, 2);
        assert_eq!(some.uuid_string(1), third);
        assert_eq!(some.memory, vec![16 << 30, 8 << 30]);
        assert_eq!(some.machine_devices, 4);
        assert_eq!(some.machine_memory.len(), 4);
        assert_eq!(some.pci_bus(0), machine.pci_bus(1));
        for none in ["none", "void", ""] {
            let hidden =
                cfg(&[("SIMGPU_DEVICES", "2"), ("SIMGPU_VISIBLE_DEVICES", none)]).expect("valid");
            assert_eq!((hidden.devices, hidden.machine_devices), (0, 2));
        }
        let all =
            cfg(&[("SIMGPU_DEVICES", "2"), ("SIMGPU_VISIBLE_DEVICES", "all")]).expect("valid");
        assert_eq!(all.visible, vec![0, 1]);
        for bad in ["2", "GPU-00000000-0000-0000-0000-000000000000", "0,x"] {
            let error =
                cfg(&[("SIMGPU_DEVICES", "2"), ("SIMGPU_VISIBLE_DEVICES", bad)]).expect_err(bad);
            assert!(error.contains("SIMGPU_VISIBLE_DEVICES"), "{error}");
        }
    }

    #[test]
    fn lost_devices_are_named_by_the_machines_index() {
        let machine =
            cfg(&[("SIMGPU_DEVICES", "3"), ("SIMGPU_LOST_DEVICES", "2, 0,2")]).expect("valid");
        assert_eq!(machine.lost, vec![2, 0]);
        assert_eq!(
            (0..3).map(|i| machine.is_lost(i)).collect::<Vec<_>>(),
            vec![true, false, true]
        );
        // A container that sees only device 2 sees it lost as its device 0.
        let container = cfg(&[
            ("SIMGPU_DEVICES", "3"),
            ("SIMGPU_LOST_DEVICES", "2"),
            ("SIMGPU_VISIBLE_DEVICES", "2"),
        ])
        .expect("valid");
        assert!(container.is_lost(0));
        assert!(cfg(&[("SIMGPU_LOST_DEVICES", "")])
            .expect("valid")
            .lost
            .is_empty());
        for bad in ["1", "x", "0,-1"] {
            let error = cfg(&[("SIMGPU_LOST_DEVICES", bad)]).expect_err(bad);
            assert!(error.contains("SIMGPU_LOST_DEVICES"), "{error}");
        }
    }
}
