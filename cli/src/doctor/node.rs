//! The driver, the GPUs and the DRA slice, read through the node agents'
//! own code: NVML loaded by `vgpu-nvml-host` as the agents load it, the
//! GPUs described and turned into inventory entries by the agents'
//! functions (`vgpu-node-agent`), health judged by their probe and
//! tracker, and the slice built by the DRA driver's `slice` module.

use super::findings::{mib, Findings, Section};
use crate::args::DoctorArgs;
use serde::Serialize;
use std::ffi::{c_char, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Instant;
use vgpu_cluster::decision::InventoryGpu;
use vgpu_dra::slice::{node_facts, resource_slice, slice_name};
use vgpu_node_agent::health::{self, HealthEvent, HealthTracker, Signal, DEFAULT_IGNORED_XIDS};
use vgpu_node_agent::inventory::inventory_gpus;
use vgpu_node_contract::region::limits::scaling::MemoryScaling;
use vgpu_nvml_host::{GpuFacts, Nvml};

/// The driver as NVML reports it.
#[derive(Debug, Default, Serialize)]
pub struct DriverFacts {
    /// The library asked for (`--nvml-library`).
    pub nvml_library: String,
    pub nvml_loaded: bool,
    /// The file the dynamic loader opened for it, as it names it.
    pub nvml_library_path: Option<String>,
    /// That file with every symbolic link resolved.
    pub nvml_library_file: Option<String>,
    /// `nvmlSystemGetDriverVersion`, e.g. `580.95.05`.
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports, `major.minor` (nvidia-smi's
    /// "CUDA Version").
    pub cuda_driver_version: Option<String>,
    /// The same as NVML gives it (`12080` for 12.8).
    pub cuda_driver_version_number: Option<i32>,
    pub nvml_version: Option<String>,
}

/// One GPU: the device plugin's inventory entry and what else NVML says.
#[derive(Debug, Serialize)]
pub struct GpuReport {
    /// NVML's index (PCI order, as nvidia-smi numbers GPUs).
    pub index: u32,
    pub uuid: String,
    /// The model, as NVML names it (nvidia-smi's "Product Name").
    pub name: String,
    pub memory_total_mib: u64,
    pub memory_total_bytes: u64,
    pub sm_count: u32,
    pub numa_node: Option<u32>,
    /// Named by the lowest NVML index in it; none without an active NVLink.
    pub nvlink_island: Option<u32>,
    pub nvlink_peers: Vec<u32>,
    /// As NVML writes it (`00000000:3B:00.0`, nvidia-smi's "Bus Id").
    pub pci_bus_id: Option<String>,
    /// `major.minor`, as the DRA driver publishes it.
    pub compute_capability: Option<String>,
    pub healthy: bool,
    pub unhealthy_reason: Option<String>,
}

/// What the node section found.
#[derive(Debug, Default)]
pub struct NodeView {
    pub driver: DriverFacts,
    pub gpus: Vec<GpuReport>,
    /// The slice, as the API server would receive it.
    pub slice: Option<serde_json::Value>,
}

const HINT_NO_NVML: &str = "Is NVIDIA's driver installed (does `nvidia-smi` work)? The \
    device plugin, the DRA driver and the monitor load NVML the same way and stop \
    without it; name another file with --nvml-library (their --nvml-library). In a \
    container, NVIDIA's container toolkit mounts the driver's libraries.";

/// Reads the driver, the GPUs and the slice, adding findings.
pub fn read(args: &DoctorArgs, findings: &mut Findings) -> NodeView {
    let library = args.nvml_library.display().to_string();
    let mut view = NodeView {
        driver: DriverFacts {
            nvml_library: library.clone(),
            ..DriverFacts::default()
        },
        ..NodeView::default()
    };
    let nvml = match vgpu_nvml_host::open(Some(&args.nvml_library)) {
        Ok(nvml) => nvml,
        Err(error) => {
            findings.fail(Section::Driver, chain(&error), HINT_NO_NVML);
            let skipped = "not read: NVML did not load (see above)";
            findings.warn(
                Section::Gpus,
                skipped,
                "the device plugin would not start either",
            );
            findings.warn(
                Section::Dra,
                skipped,
                "the DRA driver would not start either",
            );
            return view;
        }
    };
    driver(&nvml, &args.nvml_library, &mut view.driver, findings);
    let facts = match vgpu_nvml_host::describe(&nvml) {
        Ok(facts) => facts,
        Err(error) => {
            findings.fail(
                Section::Gpus,
                format!("the GPUs cannot be described: {}", chain(&error)),
                "The device plugin and the DRA driver read the same at start and \
                 would stop here. Check `nvidia-smi -q`; a GPU that fell off the bus \
                 (XID 79 in `dmesg`) needs a reset or a reboot.",
            );
            findings.warn(
                Section::Dra,
                "not read: the GPUs could not be described",
                "the DRA driver would not start either",
            );
            return view;
        }
    };
    if facts.is_empty() {
        findings.fail(
            Section::Gpus,
            "NVML lists no GPU",
            "`nvidia-smi -L` should list them; check that the driver sees the GPUs \
             (`dmesg`, `lspci -d 10de:`) and, in a container, that it was given them.",
        );
    }
    // The DRA driver's split count: kube-scheduler counts capacity, and
    // the device plugin's split count is not part of what is shown.
    let mut inventory = inventory_gpus(facts.clone(), u32::MAX, MemoryScaling::ONE);
    let uuids: Vec<String> = inventory.iter().map(|gpu| gpu.uuid.clone()).collect();
    let node_facts = node_facts(&nvml, &uuids);
    let mut tracker = HealthTracker::new(DEFAULT_IGNORED_XIDS, None);
    for (gpu, described) in inventory.iter_mut().zip(&facts) {
        let signal = Signal::Probe {
            uuid: gpu.uuid.clone(),
            result: health::probe(&nvml, &gpu.uuid),
        };
        let reason = match tracker.apply(signal, Instant::now()) {
            Some(HealthEvent::Unhealthy { reason, .. }) => {
                gpu.healthy = false;
                Some(reason)
            }
            _ => None,
        };
        let report = GpuReport {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            name: gpu.model.clone(),
            memory_total_mib: mib(gpu.memory_bytes),
            memory_total_bytes: gpu.memory_bytes,
            sm_count: gpu.sm_count,
            numa_node: gpu.numa,
            nvlink_island: gpu.nvlink_island,
            nvlink_peers: described.nvlink_peers.clone(),
            pci_bus_id: nvml
                .device_by_index(gpu.index)
                .and_then(|device| device.pci_info())
                .ok()
                .map(|pci| pci.bus_id),
            compute_capability: node_facts.compute_capability.get(&gpu.uuid).cloned(),
            healthy: gpu.healthy,
            unhealthy_reason: reason,
        };
        gpu_finding(&report, described, findings);
        view.gpus.push(report);
    }
    let node = node_name(args.node_name.as_deref());
    // As the driver would publish it with no GPU cordoned (the cordon is
    // the Node's annotation, which the doctor does not read).
    let slice = resource_slice(&node, None, &inventory, &[], &node_facts, 0);
    match serde_json::to_value(&slice) {
        Ok(value) => {
            slice_findings(&node, &value, &inventory, findings);
            view.slice = Some(value);
        }
        Err(error) => {
            findings.fail(
                Section::Dra,
                format!("the slice does not serialize: {error}"),
                "a bug in vgpu: please report it with this output",
            );
        }
    }
    view
}

/// The driver's versions and the file NVML came from.
fn driver(nvml: &Nvml, asked: &Path, facts: &mut DriverFacts, findings: &mut Findings) {
    facts.nvml_loaded = true;
    let loaded = loaded_from(asked);
    facts.nvml_library_file = loaded
        .as_ref()
        .and_then(|path| std::fs::canonicalize(path).ok())
        .map(|path| path.display().to_string());
    facts.nvml_library_path = loaded.map(|path| path.display().to_string());
    facts.driver_version = nvml.sys_driver_version().ok();
    facts.nvml_version = nvml.sys_nvml_version().ok();
    let cuda = nvml.sys_cuda_driver_version();
    facts.cuda_driver_version_number = cuda.as_ref().ok().copied();
    facts.cuda_driver_version = cuda.as_ref().ok().map(|&number| cuda_version(number));

    let from = match (&facts.nvml_library_path, &facts.nvml_library_file) {
        (Some(path), Some(file)) if path != file => format!("{path} (the file {file})"),
        (Some(path), _) => path.clone(),
        _ => "a file the loader does not name".to_string(),
    };
    findings.ok(
        Section::Driver,
        format!("NVML {} loaded: {from}", facts.nvml_library),
    );
    match (&facts.driver_version, &cuda) {
        (Some(version), Ok(_)) => {
            findings.ok(
                Section::Driver,
                format!(
                    "driver {version}, CUDA {} (NVML {})",
                    facts.cuda_driver_version.as_deref().unwrap_or("?"),
                    facts.nvml_version.as_deref().unwrap_or("?")
                ),
            );
        }
        (version, cuda) => {
            let missing = match (version, cuda) {
                (None, Err(error)) => {
                    format!("neither the driver's version nor its CUDA version ({error})")
                }
                (None, Ok(_)) => "not the driver's version".to_string(),
                (Some(_), Err(error)) => format!("not the CUDA version ({error})"),
                (Some(_), Ok(_)) => String::new(),
            };
            findings.warn(
                Section::Driver,
                format!("NVML tells {missing}"),
                "An NVML older than the driver, or not NVIDIA's, answers so: check which \
                 file was loaded above against `nvidia-smi`'s driver version.",
            );
        }
    }
}

/// `12080` as `12.8`, as nvidia-smi shows it.
pub fn cuda_version(number: i32) -> String {
    format!("{}.{}", number / 1000, (number % 1000) / 10)
}

fn gpu_finding(gpu: &GpuReport, described: &GpuFacts, findings: &mut Findings) {
    let numa = gpu
        .numa_node
        .map_or_else(|| "unknown".to_string(), |node| node.to_string());
    let island = match gpu.nvlink_island {
        Some(island) => format!("{island} (peers {:?})", described.nvlink_peers),
        None => "none".to_string(),
    };
    let message = format!(
        "GPU {}  {}  {}  {} MiB  {} SMs  NUMA {numa}  NVLink island {island}  PCI {}  {}",
        gpu.index,
        gpu.uuid,
        gpu.name,
        gpu.memory_total_mib,
        gpu.sm_count,
        gpu.pci_bus_id.as_deref().unwrap_or("unknown"),
        if gpu.healthy { "healthy" } else { "unhealthy" }
    );
    match &gpu.unhealthy_reason {
        None => {
            findings.ok(Section::Gpus, message);
        }
        Some(reason) => {
            findings.fail(
                Section::Gpus,
                format!("{message}: {reason}"),
                format!(
                    "The device plugin marks it unhealthy (kubelet places nothing more on it) \
                     and the DRA driver leaves it out of the slice. Check `nvidia-smi -q -i {}` \
                     and `dmesg` for XID errors.",
                    gpu.index
                ),
            );
        }
    }
}

/// One finding per device of the slice, and one per GPU left out.
fn slice_findings(
    node: &str,
    slice: &serde_json::Value,
    gpus: &[InventoryGpu],
    findings: &mut Findings,
) {
    let spec = &slice["spec"];
    let devices = spec["devices"].as_array().map_or(&[][..], Vec::as_slice);
    findings.ok(
        Section::Dra,
        format!(
            "slice {} (driver {}, pool {node}): {} device(s)",
            slice_name(node),
            spec["driver"].as_str().unwrap_or("?"),
            devices.len()
        ),
    );
    for device in devices {
        let name = device["name"].as_str().unwrap_or("?");
        let attributes = entries(&device["attributes"])
            .map(|(key, value)| format!("{key}={}", attribute_value(value)))
            .collect::<Vec<_>>()
            .join(", ");
        let finding = findings.ok(Section::Dra, format!("{name}: {attributes}"));
        for (key, capacity) in entries(&device["capacity"]) {
            finding.details.push(capacity_line(key, capacity));
        }
        if device["allowMultipleAllocations"] == serde_json::Value::Bool(true) {
            finding
                .details
                .push("shared between claims (allowMultipleAllocations)".into());
        }
    }
    for gpu in gpus.iter().filter(|gpu| !gpu.healthy) {
        findings.warn(
            Section::Dra,
            format!("GPU {} ({}) is left out: unhealthy", gpu.index, gpu.uuid),
            "see the GPUs above; it returns to the slice when the driver restarts healthy",
        );
    }
    if devices.is_empty() {
        findings.warn(
            Section::Dra,
            "the slice would hold no device",
            "no claim could be placed on this node: see the GPUs above",
        );
    }
}

fn entries(map: &serde_json::Value) -> impl Iterator<Item = (&String, &serde_json::Value)> {
    map.as_object().into_iter().flatten()
}

/// An attribute's one value (`{"string": "x"}` → `x`).
fn attribute_value(value: &serde_json::Value) -> String {
    match entries(value).next() {
        Some((_, serde_json::Value::String(text))) => text.clone(),
        Some((_, other)) => other.to_string(),
        None => value.to_string(),
    }
}

/// `memory 17179869184 (16384 MiB); a request: default 17179869184, from 1048576 in steps of 1048576`.
fn capacity_line(name: &str, capacity: &serde_json::Value) -> String {
    let quantity = |value: &serde_json::Value| value.as_str().map(str::to_string);
    let value = quantity(&capacity["value"]).unwrap_or_else(|| "?".into());
    let in_mib = value
        .parse::<u64>()
        .ok()
        .filter(|_| name == vgpu_dra::slice::CAPACITY_MEMORY)
        .map(|bytes| format!(" ({} MiB)", mib(bytes)))
        .unwrap_or_default();
    let policy = &capacity["requestPolicy"];
    let mut parts = Vec::new();
    if let Some(default) = quantity(&policy["default"]) {
        parts.push(format!("default {default}"));
    }
    let range = &policy["validRange"];
    if let Some(min) = quantity(&range["min"]) {
        let max = quantity(&range["max"]).map_or_else(String::new, |max| format!(" to {max}"));
        parts.push(format!("from {min}{max}"));
    }
    if let Some(step) = quantity(&range["step"]) {
        parts.push(format!("in steps of {step}"));
    }
    let policy = if parts.is_empty() {
        String::new()
    } else {
        format!("; a request: {}", parts.join(", "))
    };
    format!("capacity {name} {value}{in_mib}{policy}")
}

/// The node's name: given, else the host name (a node's usual name).
fn node_name(given: Option<&str>) -> String {
    match given {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|name| name.trim().to_ascii_lowercase())
            .ok()
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "localhost".to_string()),
    }
}

/// The start of glibc's `struct link_map` (its public part, `<link.h>`):
/// the load address and the file's name.
#[repr(C)]
struct LinkMapHead {
    l_addr: usize,
    l_name: *const c_char,
}

/// The file the dynamic loader opened for the already loaded `library`.
fn loaded_from(library: &Path) -> Option<PathBuf> {
    let name = CString::new(library.as_os_str().as_bytes()).ok()?;
    // SAFETY: `name` is NUL-terminated. RTLD_NOLOAD loads nothing: it finds
    // the library NVML was loaded from (by the same name) and takes one
    // more reference on it, dropped by the dlclose below.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    let mut map: *const LinkMapHead = std::ptr::null();
    // SAFETY: `handle` is live; RTLD_DI_LINKMAP writes one pointer to the
    // library's `struct link_map` into `map`.
    let found = unsafe {
        libc::dlinfo(
            handle,
            libc::RTLD_DI_LINKMAP,
            (&raw mut map).cast::<libc::c_void>(),
        )
    } == 0;
    // SAFETY: on success `map` points to the loader's record of a library
    // that stays loaded while `handle` is held; `l_name` is NULL or a
    // NUL-terminated path. It is copied before the handle is closed.
    let path = unsafe {
        (found && !map.is_null() && !(*map).l_name.is_null())
            .then(|| PathBuf::from(CStr::from_ptr((*map).l_name).to_string_lossy().into_owned()))
    };
    // SAFETY: drops the reference the dlopen above took; NVML keeps its own.
    unsafe { libc::dlclose(handle) };
    path.filter(|path| !path.as_os_str().is_empty())
}

/// An error and its causes on one line.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let text = inner.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = inner.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_versions_read_as_nvidia_smi_shows_them() {
        assert_eq!(cuda_version(12080), "12.8");
        assert_eq!(cuda_version(13000), "13.0");
        assert_eq!(cuda_version(11040), "11.4");
    }

    #[test]
    fn capacities_are_one_line_each() {
        let memory = serde_json::json!({
            "value": "17179869184",
            "requestPolicy": {
                "default": "17179869184",
                "validRange": {"min": "1048576", "step": "1048576"}
            }
        });
        assert_eq!(
            capacity_line("memory", &memory),
            "capacity memory 17179869184 (16384 MiB); a request: default 17179869184, \
             from 1048576, in steps of 1048576"
        );
        let cores = serde_json::json!({"value": "100", "requestPolicy": {"default": "0",
            "validRange": {"min": "0", "max": "100", "step": "1"}}});
        assert_eq!(
            capacity_line("cores", &cores),
            "capacity cores 100; a request: default 0, from 0 to 100, in steps of 1"
        );
        assert_eq!(attribute_value(&serde_json::json!({"int": 3})), "3");
        assert_eq!(
            attribute_value(&serde_json::json!({"string": "9.0"})),
            "9.0"
        );
    }

    #[test]
    fn a_loaded_library_is_found_by_its_name() {
        // libc is loaded into every test; a library that is not loaded is
        // not opened by the look-up.
        let found = loaded_from(Path::new("libc.so.6")).expect("libc is loaded");
        assert!(found.to_string_lossy().contains("libc.so.6"), "{found:?}");
        assert_eq!(loaded_from(Path::new("libvgpu-not-loaded.so")), None);
    }
}
