//! Finding this node's GPUs through NVML (`nvml-wrapper`, loaded from a path
//! the operator gives, so tests can point it at the simulated GPU).

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::path::Path;
use thiserror::Error;
use vgpu_common::decision::GpuInfo;

/// Most GPUs read from NVML (a guard against a broken library).
const MAX_GPUS: u32 = 64;

#[derive(Debug, Error)]
pub enum GpuError {
    #[error("cannot load NVML from {path}: {source}")]
    Load {
        path: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML: {what}: {source}")]
    Query {
        what: String,
        #[source]
        source: NvmlError,
    },
}

fn query(what: impl Into<String>) -> impl FnOnce(NvmlError) -> GpuError {
    let what = what.into();
    move |source| GpuError::Query { what, source }
}

/// Loads NVML from `library`.
pub fn open(library: &Path) -> Result<Nvml, GpuError> {
    Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .map_err(|source| GpuError::Load {
            path: library.display().to_string(),
            source,
        })
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

/// The NUMA node of a PCI bus ID (`00000000:3B:00.0`) as the kernel reports
/// it, if any.
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

/// Every GPU NVML reports, each to be shared by at most `split_count`
/// containers; all healthy to start with.
pub fn discover(nvml: &Nvml, split_count: u32) -> Result<Vec<GpuInfo>, GpuError> {
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
        gpus.push(GpuInfo {
            uuid,
            index,
            model: device.name().unwrap_or_default(),
            memory_bytes: memory.total,
            sm_count: sm_count(&device),
            split_count,
            numa: numa_node(&device),
            healthy: true,
        });
    }
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes_come_from_sysfs() {
        let root = std::env::temp_dir().join(format!("vgpu-plugin-sysfs-{}", std::process::id()));
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
}
