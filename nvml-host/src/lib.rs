//! The node's GPUs as NVML reports them on the host, for the daemons that
//! run there (device plugin, node monitor). NVML is `nvml-wrapper`, loaded
//! at run time from a path the operator gives, so a daemon starts on a node
//! without NVIDIA's library and tests can point it at the simulated GPU.
//!
//! - [`open`]: load NVML.
//! - [`describe`]: each GPU's fixed facts (UUID, model, memory, SMs, NUMA
//!   node, NVLink peers and island), read once at start.
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
/// `NVML_NVLINK_MAX_LINKS`: the link numbers NVML answers for.
const NVLINK_MAX_LINKS: u32 = 18;
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
    /// The GPUs (NVML indices) at the far end of this one's active
    /// NVLinks, ascending, each once.
    pub nvlink_peers: Vec<u32>,
    /// The NVLink island: the GPUs joined to this one by NVLink, directly or
    /// through an NVSwitch, named by the lowest NVML index among them;
    /// `None` when the GPU has no active NVLink.
    pub nvlink_island: Option<u32>,
}

/// Every GPU NVML reports, in NVML's order.
pub fn describe(nvml: &Nvml) -> Result<Vec<GpuFacts>, NvmlHostError> {
    let count = nvml.device_count().map_err(query("device count"))?;
    let mut gpus = Vec::with_capacity(count.min(MAX_GPUS) as usize);
    let mut links = Vec::with_capacity(gpus.capacity());
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
            nvlink_peers: Vec::new(),
            nvlink_island: None,
        });
        links.push(GpuLinks {
            bus_id: device
                .pci_info()
                .ok()
                .map(|pci| normalize_bus_id(&pci.bus_id)),
            remotes: nvlink_remotes(&device, index),
        });
    }
    let topology = nvlink_topology(&links);
    for (gpu, (peers, island)) in gpus.iter_mut().zip(topology) {
        gpu.nvlink_peers = peers;
        gpu.nvlink_island = island;
    }
    Ok(gpus)
}

/// One GPU's place in the NVLink graph, as NVML reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuLinks {
    /// The GPU's own PCI bus ID (normalized), if NVML gave it.
    pub bus_id: Option<String>,
    /// The PCI bus ID (normalized) at the far end of each active link: a
    /// GPU's, or an NVSwitch's.
    pub remotes: Vec<String>,
}

/// A PCI bus ID in one spelling: lower case with an 8-digit domain (NVML
/// writes `00000000:3B:00.0`, sysfs and some tools `0000:3b:00.0`).
pub fn normalize_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(domain) => format!("{domain:08x}:{rest}"),
            Err(_) => lower,
        },
        None => lower,
    }
}

/// The far ends of `device`'s active NVLinks. A GPU without NVLink answers
/// `NOT_SUPPORTED` for link 0, and one with fewer links than NVML's maximum
/// `INVALID_ARGUMENT` past its last: either ends the walk.
fn nvlink_remotes(device: &Device<'_>, index: u32) -> Vec<String> {
    let mut remotes = Vec::new();
    for number in 0..NVLINK_MAX_LINKS {
        let link = device.link_wrapper_for(number);
        match link.is_active() {
            Ok(true) => match link.remote_pci_info() {
                Ok(pci) => remotes.push(normalize_bus_id(&pci.bus_id)),
                Err(error) => tracing::debug!(
                    error = %error,
                    "GPU {index} NVLink {number}: active, far end unknown"
                ),
            },
            Ok(false) => {}
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::FunctionNotFound) => {
                break
            }
            Err(error) => {
                tracing::debug!(error = %error, "GPU {index} NVLink {number} state");
                break;
            }
        }
    }
    remotes
}

/// Each GPU's NVLink peers (indices into `gpus`, ascending, each once) and
/// island: the connected components of the graph whose vertices are the
/// GPUs and the far ends that are not GPUs (NVSwitches, which join every GPU
/// linked to them), each named by the lowest GPU index in it. A GPU with
/// no active link has no island.
pub fn nvlink_topology(gpus: &[GpuLinks]) -> Vec<(Vec<u32>, Option<u32>)> {
    let mut vertices = Vertices::new(gpus);
    let mut parent: Vec<usize> = (0..gpus.len()).collect();
    let mut peers: Vec<Vec<u32>> = vec![Vec::new(); gpus.len()];
    for (gpu, links) in gpus.iter().enumerate() {
        for remote in &links.remotes {
            let far = vertices.of(remote, &mut parent);
            if far < gpus.len() && far != gpu {
                peers[gpu].push(far as u32);
            }
            union(&mut parent, gpu, far);
        }
    }
    peers
        .into_iter()
        .enumerate()
        .map(|(gpu, mut list)| {
            list.sort_unstable();
            list.dedup();
            // A set's root is its lowest vertex, and GPUs come first.
            let island = (!gpus[gpu].remotes.is_empty()).then(|| find(&mut parent, gpu) as u32);
            (list, island)
        })
        .collect()
}

/// Vertex numbers of the NVLink graph: GPUs first (their positions), then
/// each far end that is no GPU, numbered as first met.
struct Vertices {
    ids: HashMap<String, usize>,
}

impl Vertices {
    fn new(gpus: &[GpuLinks]) -> Self {
        let ids = gpus
            .iter()
            .enumerate()
            .filter_map(|(i, gpu)| Some((gpu.bus_id.clone()?, i)))
            .collect();
        Self { ids }
    }

    /// The vertex of `bus_id`, added (with its own set) when new.
    fn of(&mut self, bus_id: &str, parent: &mut Vec<usize>) -> usize {
        if let Some(&vertex) = self.ids.get(bus_id) {
            return vertex;
        }
        let vertex = parent.len();
        parent.push(vertex);
        self.ids.insert(bus_id.to_string(), vertex);
        vertex
    }
}

fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

/// Joins two sets, keeping the smaller root, so a set's root is its lowest
/// vertex (GPUs come before switches).
fn union(parent: &mut [usize], a: usize, b: usize) {
    let (ra, rb) = (find(parent, a), find(parent, b));
    let (low, high) = if ra < rb { (ra, rb) } else { (rb, ra) };
    parent[high] = low;
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

    fn links(bus: &str, remotes: &[&str]) -> GpuLinks {
        GpuLinks {
            bus_id: Some(normalize_bus_id(bus)),
            remotes: remotes.iter().map(|r| normalize_bus_id(r)).collect(),
        }
    }

    #[test]
    fn bus_ids_are_compared_in_one_spelling() {
        assert_eq!(normalize_bus_id("0000:3b:00.0"), "00000000:3b:00.0");
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "00000000:3b:00.0");
        assert_eq!(normalize_bus_id("junk"), "junk");
    }

    #[test]
    fn islands_are_the_nvlink_graphs_components() {
        // Islands {0,2} and {1,3}; GPU 4 has no NVLink; the remote IDs in
        // another spelling.
        let gpus = [
            links("00000000:01:00.0", &["0000:03:00.0", "0000:03:00.0"]),
            links("00000000:02:00.0", &["0000:04:00.0"]),
            links("00000000:03:00.0", &["0000:01:00.0", "0000:01:00.0"]),
            links("00000000:04:00.0", &["0000:02:00.0"]),
            links("00000000:05:00.0", &[]),
        ];
        let topology = nvlink_topology(&gpus);
        let islands: Vec<Option<u32>> = topology.iter().map(|(_, i)| *i).collect();
        assert_eq!(islands, vec![Some(0), Some(1), Some(0), Some(1), None]);
        // A bonded pair is one peer.
        assert_eq!(topology[0].0, vec![2]);
        assert_eq!(topology[3].0, vec![1]);
        assert!(topology[4].0.is_empty());
    }

    #[test]
    fn a_chain_is_one_island_named_by_its_lowest_gpu() {
        // 3 - 1 - 2, and 0 alone.
        let gpus = [
            links("00000000:01:00.0", &[]),
            links("00000000:02:00.0", &["0000:03:00.0", "0000:04:00.0"]),
            links("00000000:03:00.0", &["0000:02:00.0"]),
            links("00000000:04:00.0", &["0000:02:00.0"]),
        ];
        let topology = nvlink_topology(&gpus);
        let islands: Vec<Option<u32>> = topology.iter().map(|(_, i)| *i).collect();
        assert_eq!(islands, vec![None, Some(1), Some(1), Some(1)]);
        assert_eq!(topology[1].0, vec![2, 3]);
    }

    #[test]
    fn gpus_on_one_nvswitch_share_an_island() {
        // GPUs 1 and 2 reach switch A, GPU 3 switch B only; 0 has none.
        let gpus = [
            links("00000000:01:00.0", &[]),
            links("00000000:02:00.0", &["0000:a0:00.0", "0000:a0:00.0"]),
            links("00000000:03:00.0", &["0000:a0:00.0"]),
            links("00000000:04:00.0", &["0000:b0:00.0"]),
        ];
        let topology = nvlink_topology(&gpus);
        let islands: Vec<Option<u32>> = topology.iter().map(|(_, i)| *i).collect();
        assert_eq!(islands, vec![None, Some(1), Some(1), Some(3)]);
        // A switch is no peer GPU.
        assert!(topology[1].0.is_empty());
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
