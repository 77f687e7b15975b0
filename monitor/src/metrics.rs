//! The Prometheus exposition: what the monitor knows at its last pass,
//! rendered in the text format (0.0.4).
//!
//! Names follow Prometheus conventions under the `vgpu_` prefix; ratios are
//! 0..1. With `hami_names`, HAMi's current metric names are emitted too,
//! with HAMi's labels and scales (its `_ratio` metrics are 0..100), so
//! existing dashboards keep working.
//!
//! Per container and device (labels `namespace`, `pod`, `container`,
//! `device_uuid`, `device_index` = the container's ordinal for the device):
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `vgpu_container_memory_used_bytes` | gauge | device memory charged to the container |
//! | `vgpu_container_memory_limit_bytes` | gauge | its cap (0 = uncapped) |
//! | `vgpu_container_memory_peak_bytes` | gauge | highest use seen |
//! | `vgpu_container_memory_over_cap_bytes` | gauge | use above the cap its decision granted (taken while the region's limit was raised from inside) |
//! | `vgpu_container_memory_context_bytes`, `_module_bytes`, `_data_bytes` | gauge | use by kind, summed over the live process slots |
//! | `vgpu_container_swap_used_bytes`, `vgpu_container_swap_limit_bytes` | gauge | host memory used as swap, and its allowance |
//! | `vgpu_container_compute_share_ratio` | gauge | configured share (1 = uncapped) |
//! | `vgpu_container_compute_burst_ratio` | gauge | share it may borrow up to |
//! | `vgpu_container_compute_effective_ratio` | gauge | share granted now (0 = paused, 1 = unlimited) |
//! | `vgpu_container_utilization_ratio` | gauge | device time it got over the utilization window (see below) |
//! | `vgpu_container_throttled_seconds_total` | counter | time its launches waited for their share |
//! | `vgpu_container_kernel_launches_total` | counter | kernel and graph launches (metered ones) |
//! | `vgpu_container_oom_events_total` | counter | allocations refused by the cap |
//! | `vgpu_container_last_kernel_age_seconds` | gauge | seconds since it last launched work |
//! | `vgpu_container_priority` | gauge | priority in force (lower is more important) |
//! | `vgpu_container_processes` | gauge | process slots in use (per container, device labels absent) |
//! | `vgpu_container_limits_restored_total` | counter | times its region's limits were changed from inside and restored (per container) |
//! | `vgpu_container_unenforced_processes`, `_memory_bytes` | gauge | processes of the container on a GPU holding more than the shim charged them (without the shim, or past it), and their memory (per container) |
//! | `vgpu_container_gpu_memory_bytes` | gauge | device memory its processes hold as the driver counts it (NVML), shim or not (per container) |
//! | `vgpu_container_gpu_time_ratio` | gauge | device time its processes' kernels took over NVML's window per wall time, summed over its GPUs, shim or not (per container) |
//! | `vgpu_container_over_cap_kills_total` | counter | its processes the backstop killed for holding more than its cap (per container) |
//! | `vgpu_container_over_share_total` | counter | times it began taking more of a GPU's time than its share while another container used the GPU (its GPU processes paused in a duty cycle, or reported) (per container) |
//! | `vgpu_container_over_share_kills_total` | counter | its processes the backstop killed for taking more than its share when pausing was not enough (per container) |
//!
//! Achieved utilization is the device time the container's launches were
//! *granted* (the shim's token bucket charges each launch its measured
//! kernel time) per wall time, between the monitor's samples over the last
//! `utilization window`. A container whose launches are not metered (no
//! cap in force: uncapped, `disable`, or an effective share of 100 %) is
//! measured from NVML's per-process utilization of its processes instead
//! (absent when NVML cannot say).
//!
//! Per physical GPU (labels `device_index` (NVML), `device_uuid`, `model`):
//! `vgpu_gpu_memory_used_bytes`, `vgpu_gpu_memory_total_bytes`,
//! `vgpu_gpu_utilization_ratio`, `vgpu_gpu_temperature_celsius`,
//! `vgpu_gpu_power_watts`, `vgpu_gpu_healthy` (1/0), `vgpu_gpu_containers`
//! (regions with a device on it), `vgpu_gpu_unenforced_processes` and
//! `vgpu_gpu_unenforced_memory_bytes` (processes NVML lists on the GPU that
//! no live slot of any region accounts for: running without the shim).
//!
//! The monitor itself: `vgpu_monitor_regions`, `vgpu_monitor_regions_refused_total`,
//! `vgpu_monitor_regions_repaired_total`,
//! `vgpu_monitor_slots_reclaimed_total`, `vgpu_monitor_reclaims_held_total`,
//! `vgpu_monitor_cleanup_sweeps_total`,
//! `vgpu_monitor_kubernetes_api_up`,
//! `vgpu_monitor_loop_duration_seconds`.

use crate::discovery::DeviceFigures;
use crate::unenforced::Unenforced;
use std::collections::BTreeMap;
use vgpu_node_contract::region::{SHARE_FULL, SHARE_UNLIMITED};
use vgpu_nvml_host::GpuSample;

/// One container's figures for one device, ready to export.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerDevice {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub figures: DeviceFigures,
    pub priority: i32,
    pub utilization: Option<f64>,
    pub last_kernel_age_seconds: Option<f64>,
    /// Device memory held above the cap the decision granted.
    pub over_cap_bytes: u64,
}

/// One container (for the per-container figures).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerSummary {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub processes: usize,
    /// Processes of the container on a GPU without the shim.
    pub unenforced_processes: usize,
    /// Device memory they hold (as far as NVML says).
    pub unenforced_bytes: u64,
    /// Times the monitor restored the region's limits after they were
    /// changed from inside.
    pub limits_restored: u64,
    /// Device memory its processes hold, as the driver counts it (NVML),
    /// shim or not.
    pub gpu_memory_bytes: u64,
    /// Device time its processes' kernels took over NVML's window, per
    /// wall time, summed over its GPUs, shim or not.
    pub gpu_time_ratio: f64,
    /// Processes of the container the backstop killed for holding more
    /// than the container's cap.
    pub over_cap_kills: u64,
    /// Times the container began taking more than its compute share while
    /// another container used its GPU (its processes paused, or reported).
    pub compute_pauses: u64,
    /// Processes of the container the backstop killed for taking more than
    /// its share when pausing was not enough.
    pub over_share_kills: u64,
}

/// Everything one pass of the monitor learnt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub generation: u64,
    pub devices: Vec<ContainerDevice>,
    pub containers: Vec<ContainerSummary>,
    pub gpus: Vec<GpuSample>,
    /// GPU processes no live slot accounts for.
    pub unenforced: Vec<Unenforced>,
    pub regions: usize,
    pub refused_total: u64,
    /// Regions their containers damaged, repaired by the monitor.
    pub repaired_total: u64,
    pub reclaimed_total: u64,
    /// Reclaims given up because a region's mutex stayed held.
    pub reclaims_held_total: u64,
    /// Cleanup sweeps done (one at most every second).
    pub sweeps_total: u64,
    /// `None` when no API is configured.
    pub api_up: Option<bool>,
    pub loop_seconds: f64,
}

impl Snapshot {
    /// Containers with a device on each GPU UUID.
    pub fn containers_per_gpu(&self) -> BTreeMap<&str, usize> {
        let mut seen: BTreeMap<&str, std::collections::BTreeSet<(&str, &str, &str)>> =
            BTreeMap::new();
        for device in &self.devices {
            seen.entry(device.figures.uuid.as_str())
                .or_default()
                .insert((
                    device.namespace.as_str(),
                    device.pod.as_str(),
                    device.container.as_str(),
                ));
        }
        seen.into_iter()
            .map(|(uuid, set)| (uuid, set.len()))
            .collect()
    }
}

/// A share in basis points (or unlimited) as a 0..1 ratio.
pub fn share_ratio(basis_points: u32) -> f64 {
    if basis_points == SHARE_UNLIMITED {
        1.0
    } else {
        f64::from(basis_points.min(SHARE_FULL)) / f64::from(SHARE_FULL)
    }
}

/// A configured percent (0 or >= 100: uncapped) as a 0..1 ratio.
pub fn percent_ratio(percent: u32) -> f64 {
    if percent == 0 || percent >= 100 {
        1.0
    } else {
        f64::from(percent) / 100.0
    }
}

/// Reads one figure of a container device (`None`: no sample).
type DeviceValue = fn(&ContainerDevice) -> Option<f64>;
/// Reads one figure of a GPU (`None`: no sample).
type GpuValue = fn(&GpuSample) -> Option<f64>;

/// The kind of a metric family, as the `# TYPE` line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// `{name="value",...}` with label values escaped as the text format
/// wants (backslash, double quote, newline); empty for no labels.
fn label_text(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let mut text = String::with_capacity(
        16 + labels
            .iter()
            .map(|(n, v)| n.len() + v.len() + 4)
            .sum::<usize>(),
    );
    for (position, (name, value)) in labels.iter().enumerate() {
        text.push(if position == 0 { '{' } else { ',' });
        text.push_str(name);
        text.push_str("=\"");
        for c in value.chars() {
            match c {
                '\\' => text.push_str("\\\\"),
                '"' => text.push_str("\\\""),
                '\n' => text.push_str("\\n"),
                _ => text.push(c),
            }
        }
        text.push('"');
    }
    text.push('}');
    text
}

/// Label sets rendered once per labelled object and reused by every family
/// over those objects, so a render escapes labels once per object, not once
/// per series.
struct LabelSets(Vec<String>);

impl LabelSets {
    fn new(sets: impl Iterator<Item = String>) -> Self {
        Self(sets.collect())
    }
}

/// Writes families in the Prometheus text format (0.0.4) into a buffer.
struct Writer {
    buffer: Vec<u8>,
}

impl Writer {
    /// Writes the family `name` with a sample for every object of `labels`
    /// that `value` gives one for; a family without samples is left out.
    fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: Kind,
        labels: &LabelSets,
        value: impl Fn(usize) -> Option<f64>,
    ) {
        use std::io::Write;
        let mut header_written = false;
        for (index, set) in labels.0.iter().enumerate() {
            let Some(sample) = value(index) else { continue };
            if !header_written {
                self.header(name, help, kind);
                header_written = true;
            }
            self.buffer.extend_from_slice(name.as_bytes());
            self.buffer.extend_from_slice(set.as_bytes());
            self.buffer.push(b' ');
            // Writing into a Vec cannot fail. Display of f64 is what
            // Prometheus' parser reads (shortest round-trip form).
            let _ = write!(self.buffer, "{sample}");
            self.buffer.push(b'\n');
        }
    }

    fn header(&mut self, name: &str, help: &str, kind: Kind) {
        self.buffer.extend_from_slice(b"# HELP ");
        self.buffer.extend_from_slice(name.as_bytes());
        self.buffer.push(b' ');
        for c in help.chars() {
            match c {
                '\\' => self.buffer.extend_from_slice(b"\\\\"),
                '\n' => self.buffer.extend_from_slice(b"\\n"),
                _ => {
                    let mut utf8 = [0u8; 4];
                    self.buffer
                        .extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                }
            }
        }
        self.buffer.extend_from_slice(b"\n# TYPE ");
        self.buffer.extend_from_slice(name.as_bytes());
        self.buffer.push(b' ');
        self.buffer.extend_from_slice(kind.as_str().as_bytes());
        self.buffer.push(b'\n');
    }

    /// A family with a single unlabelled sample.
    fn single(&mut self, name: &str, help: &str, kind: Kind, value: f64) {
        let labels = LabelSets(vec![String::new()]);
        self.family(name, help, kind, &labels, |_| Some(value));
    }
}

/// Renders `snapshot` in the Prometheus text format.
pub fn render(snapshot: &Snapshot, hami_names: bool) -> Vec<u8> {
    use Kind::{Counter, Gauge};
    let mut w = Writer {
        buffer: Vec::with_capacity(256 * (snapshot.devices.len() * 24 + 64)),
    };
    let devices = &snapshot.devices;

    // Per container and device.
    let per_device: [(&str, &str, Kind, DeviceValue); 18] = [
        ("vgpu_container_memory_over_cap_bytes", "Device memory the container holds above the cap its decision granted (taken while its region's limit was raised).", Gauge, |d| Some(d.over_cap_bytes as f64)),
        ("vgpu_container_memory_used_bytes", "Device memory charged to the container.", Gauge, |d| Some(d.figures.memory_used as f64)),
        ("vgpu_container_memory_limit_bytes", "Device memory cap of the container (0 = uncapped).", Gauge, |d| Some(d.figures.memory_limit as f64)),
        ("vgpu_container_memory_peak_bytes", "Highest device memory use of the container.", Gauge, |d| Some(d.figures.peak_used as f64)),
        ("vgpu_container_memory_context_bytes", "Device memory charged for CUDA contexts, over the container's live process slots.", Gauge, |d| Some(d.figures.context as f64)),
        ("vgpu_container_memory_module_bytes", "Device memory charged for loaded modules, over the container's live process slots.", Gauge, |d| Some(d.figures.module as f64)),
        ("vgpu_container_memory_data_bytes", "Device memory charged for data allocations, over the container's live process slots.", Gauge, |d| Some(d.figures.data as f64)),
        ("vgpu_container_swap_used_bytes", "Host memory the container uses as swap for the device.", Gauge, |d| Some(d.figures.swap_used as f64)),
        ("vgpu_container_swap_limit_bytes", "Host memory the container may use as swap for the device.", Gauge, |d| Some(d.figures.swap_limit as f64)),
        ("vgpu_container_compute_share_ratio", "Configured compute share of the device (1 = uncapped).", Gauge, |d| Some(percent_ratio(d.figures.sm_limit))),
        ("vgpu_container_compute_burst_ratio", "Compute share the container may borrow up to when the device has idle capacity (1 = uncapped).", Gauge, |d| Some(if d.figures.sm_limit == 0 || d.figures.sm_limit >= 100 { 1.0 } else { percent_ratio(d.figures.sm_burst.max(d.figures.sm_limit)) })),
        ("vgpu_container_compute_effective_ratio", "Compute share granted now by the monitor (0 = paused, 1 = unlimited).", Gauge, |d| Some(share_ratio(d.figures.sm_effective))),
        ("vgpu_container_utilization_ratio", "Device time the container got per wall time over the utilization window.", Gauge, |d| d.utilization),
        ("vgpu_container_throttled_seconds_total", "Time the container's launches waited for their compute share.", Counter, |d| Some(d.figures.throttled_ns as f64 / 1e9)),
        ("vgpu_container_kernel_launches_total", "Kernel and graph launches of the container (metered launches).", Counter, |d| Some(d.figures.launches as f64)),
        ("vgpu_container_oom_events_total", "Allocations refused because of the container's memory cap.", Counter, |d| Some(d.figures.oom_events as f64)),
        ("vgpu_container_last_kernel_age_seconds", "Seconds since the container last launched work on the device.", Gauge, |d| d.last_kernel_age_seconds),
        ("vgpu_container_priority", "Priority in force for the container (lower is more important).", Gauge, |d| Some(f64::from(d.priority))),
    ];
    let pool = LabelSets::new(devices.iter().map(|d| {
        let index = d.figures.index.to_string();
        label_text(&[
            ("namespace", &d.namespace),
            ("pod", &d.pod),
            ("container", &d.container),
            ("device_uuid", &d.figures.uuid),
            ("device_index", &index),
        ])
    }));
    for (name, help, kind, value) in per_device {
        w.family(name, help, kind, &pool, |i| value(&devices[i]));
    }

    let container_pool = LabelSets::new(snapshot.containers.iter().map(|c| {
        label_text(&[
            ("namespace", &c.namespace),
            ("pod", &c.pod),
            ("container", &c.container),
        ])
    }));
    w.family(
        "vgpu_container_processes",
        "Process slots in use in the container's region.",
        Gauge,
        &container_pool,
        |i| Some(snapshot.containers[i].processes as f64),
    );
    w.family(
        "vgpu_container_limits_restored_total",
        "Times the container's region limits were found changed from inside and restored.",
        Counter,
        &container_pool,
        |i| Some(snapshot.containers[i].limits_restored as f64),
    );
    w.family(
        "vgpu_container_unenforced_processes",
        "Processes of the container using a GPU without the shim (no cap or share holds them).",
        Gauge,
        &container_pool,
        |i| Some(snapshot.containers[i].unenforced_processes as f64),
    );
    w.family(
        "vgpu_container_unenforced_memory_bytes",
        "Device memory held by the container's processes that run without the shim.",
        Gauge,
        &container_pool,
        |i| Some(snapshot.containers[i].unenforced_bytes as f64),
    );
    w.family(
        "vgpu_container_gpu_memory_bytes",
        "Device memory the container's processes hold as the driver counts it (NVML), shim or not.",
        Gauge,
        &container_pool,
        |i| Some(snapshot.containers[i].gpu_memory_bytes as f64),
    );
    w.family(
        "vgpu_container_gpu_time_ratio",
        "Device time the container's processes' kernels took over NVML's window per wall time, summed over its GPUs, shim or not.",
        Gauge,
        &container_pool,
        |i| Some(snapshot.containers[i].gpu_time_ratio),
    );
    w.family(
        "vgpu_container_over_cap_kills_total",
        "Processes of the container killed for holding more device memory than its cap.",
        Counter,
        &container_pool,
        |i| Some(snapshot.containers[i].over_cap_kills as f64),
    );
    w.family(
        "vgpu_container_over_share_total",
        "Times the container began taking more of a GPU's time than its share while another container used the GPU.",
        Counter,
        &container_pool,
        |i| Some(snapshot.containers[i].compute_pauses as f64),
    );
    w.family(
        "vgpu_container_over_share_kills_total",
        "Processes of the container killed for taking more of a GPU's time than its share when pausing was not enough.",
        Counter,
        &container_pool,
        |i| Some(snapshot.containers[i].over_share_kills as f64),
    );

    // Per physical GPU.
    let gpus = &snapshot.gpus;
    let per_gpu = snapshot.containers_per_gpu();
    let gpu_pool = LabelSets::new(gpus.iter().map(|g| {
        let index = g.index.to_string();
        label_text(&[
            ("device_index", &index),
            ("device_uuid", &g.uuid),
            ("model", &g.name),
        ])
    }));
    let per_gpu_metrics: [(&str, &str, GpuValue); 6] = [
        (
            "vgpu_gpu_memory_used_bytes",
            "Device memory in use on the GPU (NVML).",
            |g| g.memory_used.map(|v| v as f64),
        ),
        (
            "vgpu_gpu_memory_total_bytes",
            "Device memory of the GPU (NVML).",
            |g| g.memory_total.map(|v| v as f64),
        ),
        (
            "vgpu_gpu_utilization_ratio",
            "GPU utilization over NVML's last sample period.",
            |g| g.utilization,
        ),
        ("vgpu_gpu_temperature_celsius", "GPU temperature.", |g| {
            g.temperature_celsius.map(f64::from)
        }),
        ("vgpu_gpu_power_watts", "GPU power draw.", |g| g.power_watts),
        (
            "vgpu_gpu_healthy",
            "1 when the GPU answers NVML queries, else 0.",
            |g| Some(if g.healthy { 1.0 } else { 0.0 }),
        ),
    ];
    for (name, help, value) in per_gpu_metrics {
        w.family(name, help, Gauge, &gpu_pool, |i| value(&gpus[i]));
    }
    w.family(
        "vgpu_gpu_containers",
        "Containers with a region on the GPU.",
        Gauge,
        &gpu_pool,
        |i| Some(per_gpu.get(gpus[i].uuid.as_str()).copied().unwrap_or(0) as f64),
    );
    let unenforced_on = |gpu: &GpuSample| -> (f64, f64) {
        snapshot
            .unenforced
            .iter()
            .filter(|u| u.gpu_uuid == gpu.uuid)
            .fold((0.0, 0.0), |(count, bytes), u| {
                (count + 1.0, bytes + u.used_bytes as f64)
            })
    };
    w.family(
        "vgpu_gpu_unenforced_processes",
        "Processes using the GPU that no container's shim accounts for.",
        Gauge,
        &gpu_pool,
        |i| Some(unenforced_on(&gpus[i]).0),
    );
    w.family(
        "vgpu_gpu_unenforced_memory_bytes",
        "Device memory held by processes using the GPU without the shim.",
        Gauge,
        &gpu_pool,
        |i| Some(unenforced_on(&gpus[i]).1),
    );

    // The monitor itself.
    w.single(
        "vgpu_monitor_regions",
        "Container regions the monitor reads.",
        Gauge,
        snapshot.regions as f64,
    );
    w.single(
        "vgpu_monitor_regions_refused_total",
        "Region files refused (wrong size, magic, version or kind of file).",
        Counter,
        snapshot.refused_total as f64,
    );
    w.single(
        "vgpu_monitor_regions_repaired_total",
        "Region files their containers grew, shrank or overwrote, repaired by the monitor.",
        Counter,
        snapshot.repaired_total as f64,
    );
    w.single(
        "vgpu_monitor_slots_reclaimed_total",
        "Process slots of dead processes returned by the monitor.",
        Counter,
        snapshot.reclaimed_total as f64,
    );
    w.single(
        "vgpu_monitor_reclaims_held_total",
        "Dead-slot reclaims given up because the region's mutex stayed held (by its container, or by one that means harm).",
        Counter,
        snapshot.reclaims_held_total as f64,
    );
    w.single(
        "vgpu_monitor_cleanup_sweeps_total",
        "Cleanup sweeps done (dead slots reclaimed, regions of deleted pods removed).",
        Counter,
        snapshot.sweeps_total as f64,
    );
    if let Some(up) = snapshot.api_up {
        w.single(
            "vgpu_monitor_kubernetes_api_up",
            "1 when the pod list from the Kubernetes API is current, else 0.",
            Gauge,
            if up { 1.0 } else { 0.0 },
        );
    }
    w.single(
        "vgpu_monitor_loop_duration_seconds",
        "How long the monitor's last pass took.",
        Gauge,
        snapshot.loop_seconds,
    );

    if hami_names {
        hami(&mut w, snapshot);
    }
    w.buffer
}

/// HAMi's current names, labels and scales.
fn hami(w: &mut Writer, snapshot: &Snapshot) {
    use Kind::Gauge;
    let gpus = &snapshot.gpus;
    let host_pool = LabelSets::new(gpus.iter().map(|g| {
        let index = g.index.to_string();
        let device_type = format!("NVIDIA-{}", g.name);
        label_text(&[
            ("device_index", &index),
            ("device_type", &device_type),
            ("device_uuid", &g.uuid),
            ("zone", "vGPU"),
        ])
    }));
    w.family(
        "hami_host_gpu_memory_used_bytes",
        "GPU real-time device memory usage on host",
        Gauge,
        &host_pool,
        |i| gpus[i].memory_used.map(|v| v as f64),
    );
    w.family(
        "hami_host_gpu_utilization_ratio",
        "GPU core utilization ratio on host (0-100)",
        Gauge,
        &host_pool,
        |i| gpus[i].utilization.map(|u| u * 100.0),
    );

    let devices = &snapshot.devices;
    let pool = LabelSets::new(devices.iter().map(|d| {
        let index = d.figures.index.to_string();
        label_text(&[
            ("container", &d.container),
            ("device_uuid", &d.figures.uuid),
            ("namespace", &d.namespace),
            ("pod", &d.pod),
            ("vdevice_index", &index),
            ("zone", "vGPU"),
        ])
    }));
    let per_device: [(&str, &str, DeviceValue); 8] = [
        (
            "hami_container_device_utilization_ratio",
            "Container device SM utilization ratio (0-100)",
            |d| d.utilization.map(|u| u * 100.0),
        ),
        (
            "hami_container_device_memory_bytes",
            "Container device memory usage in bytes",
            |d| Some(d.figures.memory_used as f64),
        ),
        (
            "hami_container_last_kernel_elapsed_seconds",
            "Seconds since last kernel execution in container",
            |d| d.last_kernel_age_seconds,
        ),
        (
            "hami_vgpu_memory_used_bytes",
            "vGPU device memory usage in bytes",
            |d| Some(d.figures.memory_used as f64),
        ),
        (
            "hami_vgpu_memory_limit_bytes",
            "vGPU device memory limit in bytes",
            |d| Some(d.figures.memory_limit as f64),
        ),
        (
            "hami_vgpu_memory_buffer_bytes",
            "Container device memory buffer size in bytes",
            |d| Some(d.figures.data as f64),
        ),
        (
            "hami_vgpu_memory_context_bytes",
            "Container device memory context size in bytes",
            |d| Some(d.figures.context as f64),
        ),
        (
            "hami_vgpu_memory_module_bytes",
            "Container device memory module size in bytes",
            |d| Some(d.figures.module as f64),
        ),
    ];
    for (name, help, value) in per_device {
        w.family(name, help, Gauge, &pool, |i| value(&devices[i]));
    }
}

/// The content type of [`render`]'s output.
pub fn content_type() -> &'static str {
    "text/plain; version=0.0.4"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same family through the `prometheus` crate's text encoder.
    fn reference(
        name: &str,
        help: &str,
        counter: bool,
        series: &[(Vec<(&str, &str)>, f64)],
    ) -> String {
        use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
        use prometheus::Encoder;
        let mut family = MetricFamily::default();
        family.set_name(name.into());
        family.set_help(help.into());
        family.set_field_type(if counter {
            MetricType::COUNTER
        } else {
            MetricType::GAUGE
        });
        let metrics = series
            .iter()
            .map(|(labels, value)| {
                let pairs = labels
                    .iter()
                    .map(|(n, v)| {
                        let mut pair = LabelPair::default();
                        pair.set_name(n.to_string());
                        pair.set_value(v.to_string());
                        pair
                    })
                    .collect();
                let mut metric = Metric::from_label(pairs);
                if counter {
                    metric.counter.mut_or_insert_default().set_value(*value);
                } else {
                    metric.gauge.mut_or_insert_default().set_value(*value);
                }
                metric
            })
            .collect();
        family.set_metric(metrics);
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&[family], &mut out)
            .expect("encode");
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn exposition_matches_the_reference_encoder_byte_for_byte() {
        let series: Vec<(Vec<(&str, &str)>, f64)> = vec![
            (vec![("pod", "plain"), ("device_index", "0")], 0.3),
            (
                vec![
                    ("pod", "quote\"back\\slash\nnewline"),
                    ("device_index", "1"),
                ],
                1.0,
            ),
            (
                vec![("pod", "ünïcode ☃"), ("device_index", "12")],
                1234567890123.0,
            ),
            (vec![("pod", ""), ("device_index", "3")], -2.5e-7),
            (
                vec![("pod", "big"), ("device_index", "4")],
                1.8446744073709552e19,
            ),
        ];
        for counter in [false, true] {
            let labels = LabelSets::new(series.iter().map(|(l, _)| label_text(l)));
            let mut w = Writer { buffer: Vec::new() };
            let kind = if counter { Kind::Counter } else { Kind::Gauge };
            w.family(
                "vgpu_test_total",
                "Help with a \\ and a\nnewline.",
                kind,
                &labels,
                |i| Some(series[i].1),
            );
            assert_eq!(
                String::from_utf8(w.buffer).expect("utf8"),
                reference(
                    "vgpu_test_total",
                    "Help with a \\ and a\nnewline.",
                    counter,
                    &series
                )
            );
        }
        let mut w = Writer { buffer: Vec::new() };
        w.single("vgpu_one", "One.", Kind::Gauge, 7.0);
        assert_eq!(
            String::from_utf8(w.buffer).expect("utf8"),
            reference("vgpu_one", "One.", false, &[(vec![], 7.0)])
        );
    }

    #[test]
    fn a_family_without_samples_is_left_out() {
        let labels = LabelSets::new(std::iter::once(label_text(&[("a", "b")])));
        let mut w = Writer { buffer: Vec::new() };
        w.family("vgpu_none", "Nothing.", Kind::Gauge, &labels, |_| None);
        assert!(w.buffer.is_empty());
    }

    fn device(uuid: &str) -> ContainerDevice {
        ContainerDevice {
            namespace: "ns".into(),
            pod: "p".into(),
            container: "c".into(),
            figures: DeviceFigures {
                index: 0,
                uuid: uuid.into(),
                memory_used: 1234,
                memory_limit: 1 << 30,
                sm_limit: 30,
                sm_burst: 60,
                sm_effective: 4500,
                throttled_ns: 1_500_000_000,
                launches: 7,
                oom_events: 2,
                ..DeviceFigures::default()
            },
            over_cap_bytes: 77,
            priority: 1,
            utilization: Some(0.25),
            last_kernel_age_seconds: Some(0.5),
        }
    }

    #[test]
    fn renders_names_units_and_types() {
        let snapshot = Snapshot {
            devices: vec![device("GPU-a")],
            containers: vec![ContainerSummary {
                namespace: "ns".into(),
                pod: "p".into(),
                container: "c".into(),
                processes: 2,
                unenforced_processes: 1,
                unenforced_bytes: 512,
                limits_restored: 3,
                gpu_memory_bytes: 1536,
                gpu_time_ratio: 0.25,
                over_cap_kills: 2,
                compute_pauses: 3,
                over_share_kills: 1,
            }],
            gpus: vec![GpuSample {
                index: 0,
                uuid: "GPU-a".into(),
                name: "Sim".into(),
                memory_used: Some(10),
                memory_total: Some(100),
                utilization: Some(0.5),
                healthy: true,
                ..GpuSample::default()
            }],
            regions: 1,
            ..Snapshot::default()
        };
        let text = String::from_utf8(render(&snapshot, true)).expect("utf8");
        let labels =
            r#"{namespace="ns",pod="p",container="c",device_uuid="GPU-a",device_index="0"}"#;
        for line in [
            format!("vgpu_container_memory_used_bytes{labels} 1234"),
            format!("vgpu_container_compute_share_ratio{labels} 0.3"),
            format!("vgpu_container_compute_burst_ratio{labels} 0.6"),
            format!("vgpu_container_compute_effective_ratio{labels} 0.45"),
            format!("vgpu_container_throttled_seconds_total{labels} 1.5"),
            format!("vgpu_container_oom_events_total{labels} 2"),
            "# TYPE vgpu_container_kernel_launches_total counter".to_string(),
            r#"vgpu_gpu_containers{device_index="0",device_uuid="GPU-a",model="Sim"} 1"#.to_string(),
            r#"vgpu_container_unenforced_processes{namespace="ns",pod="p",container="c"} 1"#.to_string(),
            r#"vgpu_container_limits_restored_total{namespace="ns",pod="p",container="c"} 3"#.to_string(),
            r#"vgpu_container_gpu_memory_bytes{namespace="ns",pod="p",container="c"} 1536"#.to_string(),
            r#"vgpu_container_gpu_time_ratio{namespace="ns",pod="p",container="c"} 0.25"#.to_string(),
            r#"vgpu_container_over_cap_kills_total{namespace="ns",pod="p",container="c"} 2"#.to_string(),
            r#"vgpu_container_over_share_total{namespace="ns",pod="p",container="c"} 3"#.to_string(),
            r#"vgpu_container_over_share_kills_total{namespace="ns",pod="p",container="c"} 1"#.to_string(),
            format!("vgpu_container_memory_over_cap_bytes{labels} 77"),
            r#"vgpu_container_unenforced_memory_bytes{namespace="ns",pod="p",container="c"} 512"#.to_string(),
            r#"vgpu_gpu_unenforced_processes{device_index="0",device_uuid="GPU-a",model="Sim"} 0"#.to_string(),
            r#"hami_host_gpu_utilization_ratio{device_index="0",device_type="NVIDIA-Sim",device_uuid="GPU-a",zone="vGPU"} 50"#.to_string(),
            r#"hami_container_device_utilization_ratio{container="c",device_uuid="GPU-a",namespace="ns",pod="p",vdevice_index="0",zone="vGPU"} 25"#.to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        let plain = String::from_utf8(render(&snapshot, false)).expect("utf8");
        assert!(!plain.contains("hami_"));
    }

    #[test]
    fn empty_snapshot_renders_only_monitor_figures() {
        let text = String::from_utf8(render(&Snapshot::default(), false)).expect("utf8");
        assert!(text.contains("vgpu_monitor_regions 0"));
        assert!(!text.contains("vgpu_container_"));
    }

    #[test]
    fn ratios_clamp() {
        assert_eq!(share_ratio(SHARE_UNLIMITED), 1.0);
        assert_eq!(share_ratio(u32::MAX - 1), 1.0);
        assert_eq!(share_ratio(2500), 0.25);
        assert_eq!(percent_ratio(0), 1.0);
        assert_eq!(percent_ratio(250), 1.0);
    }
}
