//! The node's GPUs as NVML reports them on the host, for the daemons that
//! run there (device plugin, node monitor). NVML is `nvml-wrapper`, loaded
//! at run time from a path the operator gives, so a daemon starts on a node
//! without NVIDIA's library and tests can point it at the simulated GPU.
//!
//! - [`open`]: load NVML.
//! - [`describe`]: each GPU's fixed facts (UUID, model, memory, SMs, NUMA
//!   node), read once at start.
//! - [`Sampler`]: each GPU's changing figures (memory used, utilization,
//!   temperature, power, per-process SM use), read every monitor pass.

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Device;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use thiserror::Error;

pub use nvml_wrapper::Nvml;

/// Most GPUs read from NVML (a guard against a broken library).
pub const MAX_GPUS: u32 = 64;
/// Most per-process samples kept per device.
const MAX_PROCESS_SAMPLES: usize = 4096;
/// What the dynamic loader is asked for when no path is given.
const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

#[derive(Debug, Error)]
pub enum NvmlHostError {
    #[error("cannot load NVML from {path}")]
    Load {
        path: PathBuf,
        #[source]
        source: NvmlError,
    },
    #[error("NVML: {what}")]
    Query {
        what: String,
        #[source]
        source: NvmlError,
    },
}

fn query(what: impl Into<String>) -> impl FnOnce(NvmlError) -> NvmlHostError {
    let what = what.into();
    move |source| NvmlHostError::Query { what, source }
}

/// Loads NVML from `library` (the system's library when `None`).
pub fn open(library: Option<&Path>) -> Result<Nvml, NvmlHostError> {
    let mut builder = Nvml::builder();
    if let Some(path) = library {
        builder.lib_path(path.as_os_str());
    }
    builder.init().map_err(|source| NvmlHostError::Load {
        path: library.map_or_else(|| PathBuf::from(DEFAULT_LIBRARY), Path::to_path_buf),
        source,
    })
}

/// What does not change about a GPU while the node runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFacts {
    /// NVML's index, which is PCI order.
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_bytes: u64,
    pub sm_count: u32,
    /// NUMA node, if known.
    pub numa: Option<u32>,
}

/// Every GPU NVML reports, in NVML's order.
pub fn describe(nvml: &Nvml) -> Result<Vec<GpuFacts>, NvmlHostError> {
    let count = nvml.device_count().map_err(query("device count"))?;
    let mut gpus = Vec::with_capacity(count.min(MAX_GPUS) as usize);
    for index in 0..count.min(MAX_GPUS) {
        let device = nvml
            .device_by_index(index)
            .map_err(query(format!("GPU {index}")))?;
        let uuid = device.uuid().map_err(query(format!("GPU {index} UUID")))?;
        let memory = device
            .memory_info()
            .map_err(query(format!("GPU {index} memory")))?;
        gpus.push(GpuFacts {
            index,
            uuid,
            model: device.name().unwrap_or_default(),
            memory_bytes: memory.total,
            sm_count: sm_count(&device),
            numa: numa_node(&device),
        });
    }
    Ok(gpus)
}

/// CUDA cores per multiprocessor for a compute capability (NVML reports
/// cores, not multiprocessors, on GPUs without MIG).
fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (3, _) => Some(192),
        (5, _) => Some(128),
        (6, 0) => Some(64),
        (6, _) => Some(128),
        (7, _) => Some(64),
        (8, 0) => Some(64),
        (8, _) => Some(128),
        (m, _) if m >= 9 => Some(128),
        _ => None,
    }
}

fn sm_count(device: &Device<'_>) -> u32 {
    if let Ok(attributes) = device.attributes() {
        if attributes.multiprocessor_count > 0 {
            return attributes.multiprocessor_count;
        }
    }
    let cores = device.num_cores().ok();
    let per_sm = device
        .cuda_compute_capability()
        .ok()
        .and_then(|cc| cores_per_sm(cc.major, cc.minor));
    match (cores, per_sm) {
        (Some(cores), Some(per_sm)) => cores / per_sm,
        _ => 0,
    }
}

/// The NUMA node of a PCI bus ID (`00000000:3B:00.0`) as the kernel under
/// `sysfs` reports it, if any.
pub fn numa_node_of_bus(bus_id: &str, sysfs: &Path) -> Option<u32> {
    let lower = bus_id.to_ascii_lowercase();
    // NVML writes an 8-digit domain, sysfs a 4-digit one.
    let (domain, rest) = lower.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let name = format!("{domain:04x}:{rest}");
    let text =
        std::fs::read_to_string(sysfs.join("bus/pci/devices").join(name).join("numa_node")).ok()?;
    let node: i64 = text.trim().parse().ok()?;
    u32::try_from(node).ok()
}

fn numa_node(device: &Device<'_>) -> Option<u32> {
    if let Ok(node) = device.numa_node_id() {
        return Some(node);
    }
    let bus_id = device.pci_info().ok()?.bus_id;
    numa_node_of_bus(&bus_id, Path::new("/sys"))
}

/// One GPU's figures at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_used: Option<u64>,
    pub memory_total: Option<u64>,
    /// 0..=1, over the driver's last sample period.
    pub utilization: Option<f64>,
    pub temperature_celsius: Option<u32>,
    pub power_watts: Option<f64>,
    /// The device answers queries (handle, UUID and memory).
    pub healthy: bool,
    /// SM utilization per PID (0..=100) over the activity window.
    pub process_sm_percent: HashMap<u32, u32>,
    /// The processes holding a compute context on the GPU, by host PID.
    pub compute_processes: Vec<GpuProcess>,
}

/// A process NVML lists on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuProcess {
    /// PID in the host's PID namespace (NVML's view).
    pub pid: u32,
    /// Device memory it uses, when the driver says.
    pub used_bytes: Option<u64>,
}

/// Reads every GPU's changing figures; a failing query is logged once per
/// GPU and kind, not every pass.
pub struct Sampler {
    nvml: Nvml,
    failures_logged: HashSet<(u32, &'static str)>,
}

impl Sampler {
    /// Loads NVML from `library` (the system's library when `None`).
    pub fn open(library: Option<&Path>) -> Result<Self, NvmlHostError> {
        let nvml = open(library)?;
        let count = nvml.device_count().map_err(query("device count"))?;
        tracing::info!("NVML loaded: {count} GPU(s)");
        Ok(Self {
            nvml,
            failures_logged: HashSet::new(),
        })
    }

    /// Reads every GPU. `since_unix_us` bounds the per-process samples
    /// (wall-clock microseconds, as NVML takes them).
    pub fn sample(&mut self, since_unix_us: u64) -> Vec<GpuSample> {
        let count = match self.nvml.device_count() {
            Ok(count) => count.min(MAX_GPUS),
            Err(error) => {
                self.log_once(u32::MAX, "count", &error);
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let mut info = GpuSample {
                index,
                ..GpuSample::default()
            };
            let device = match self.nvml.device_by_index(index) {
                Ok(device) => device,
                Err(error) => {
                    // Reported unhealthy, with whatever else is known.
                    self.log_once(index, "device handle", &error);
                    out.push(info);
                    continue;
                }
            };
            let uuid = device.uuid();
            let memory = device.memory_info();
            info.healthy = uuid.is_ok() && memory.is_ok();
            info.uuid = uuid.unwrap_or_default();
            if let Ok(memory) = memory {
                info.memory_used = Some(memory.used);
                info.memory_total = Some(memory.total);
            }
            info.name = device.name().unwrap_or_default();
            info.utilization = device
                .utilization_rates()
                .ok()
                .map(|u| f64::from(u.gpu.min(100)) / 100.0);
            info.temperature_celsius = device.temperature(TemperatureSensor::Gpu).ok();
            info.power_watts = device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0);
            let processes = device.process_utilization_stats(since_unix_us);
            let compute = device.running_compute_processes();
            match processes {
                Ok(samples) => {
                    for sample in samples.into_iter().take(MAX_PROCESS_SAMPLES) {
                        let entry = info.process_sm_percent.entry(sample.pid).or_insert(0);
                        *entry = (*entry).max(sample.sm_util.min(100));
                    }
                }
                Err(NvmlError::NotFound) | Err(NvmlError::NotSupported) => {}
                Err(error) => self.log_once(index, "process utilization", &error),
            }
            match compute {
                Ok(processes) => {
                    info.compute_processes = processes
                        .into_iter()
                        .take(MAX_PROCESS_SAMPLES)
                        .map(|process| GpuProcess {
                            pid: process.pid,
                            used_bytes: match process.used_gpu_memory {
                                UsedGpuMemory::Used(bytes) => Some(bytes),
                                UsedGpuMemory::Unavailable => None,
                            },
                        })
                        .collect();
                }
                Err(NvmlError::NotSupported) => {}
                Err(error) => self.log_once(index, "process list", &error),
            }
            out.push(info);
        }
        out
    }

    fn log_once(&mut self, index: u32, what: &'static str, error: &NvmlError) {
        if self.failures_logged.insert((index, what)) {
            tracing::warn!(error = %error, "NVML {what} (GPU {index}) failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes_come_from_sysfs() {
        let root = std::env::temp_dir().join(format!("vgpu-nvml-sysfs-{}", std::process::id()));
        let dev = root.join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).expect("mkdir");
        std::fs::write(dev.join("numa_node"), "1\n").expect("write");
        let other = root.join("bus/pci/devices/0000:5e:00.0");
        std::fs::create_dir_all(&other).expect("mkdir");
        std::fs::write(other.join("numa_node"), "-1\n").expect("write");
        assert_eq!(numa_node_of_bus("00000000:3B:00.0", &root), Some(1));
        assert_eq!(numa_node_of_bus("00000000:5E:00.0", &root), None);
        assert_eq!(numa_node_of_bus("00000000:99:00.0", &root), None);
        assert_eq!(numa_node_of_bus("junk", &root), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn multiprocessors_from_cores() {
        assert_eq!(cores_per_sm(9, 0), Some(128));
        assert_eq!(cores_per_sm(8, 0), Some(64));
        assert_eq!(cores_per_sm(8, 6), Some(128));
        assert_eq!(cores_per_sm(7, 5), Some(64));
        assert_eq!(cores_per_sm(2, 0), None);
    }

    #[test]
    fn a_missing_library_is_named() {
        let path = Path::new("/nonexistent/libnvidia-ml.so.1");
        let Err(error) = open(Some(path)) else {
            panic!("a missing NVML loaded");
        };
        assert!(error.to_string().contains("/nonexistent"), "{error}");
        assert!(std::error::Error::source(&error).is_some());
    }
}
