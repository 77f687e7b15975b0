//! The Prometheus exposition: what the monitor knows at its last pass,
//! rendered in the text format with the `prometheus` crate's encoder.
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
//! (regions with a device on it).
//!
//! The monitor itself: `vgpu_monitor_regions`, `vgpu_monitor_regions_refused_total`,
//! `vgpu_monitor_slots_reclaimed_total`, `vgpu_monitor_kubernetes_api_up`,
//! `vgpu_monitor_loop_duration_seconds`.

use crate::discovery::DeviceFigures;
use crate::gpu::GpuInfo;
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, TextEncoder};
use std::collections::BTreeMap;
use vgpu_common::region::{SHARE_FULL, SHARE_UNLIMITED};

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
}

/// One container (for the per-container figures).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerSummary {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub processes: usize,
}

/// Everything one pass of the monitor learnt.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub generation: u64,
    pub devices: Vec<ContainerDevice>,
    pub containers: Vec<ContainerSummary>,
    pub gpus: Vec<GpuInfo>,
    pub regions: usize,
    pub refused_total: u64,
    pub reclaimed_total: u64,
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
type GpuValue = fn(&GpuInfo) -> Option<f64>;

fn pairs(labels: &[(&str, &str)]) -> Vec<LabelPair> {
    labels
        .iter()
        .map(|(name, value)| {
            let mut pair = LabelPair::default();
            pair.set_name(name.to_string());
            pair.set_value(value.to_string());
            pair
        })
        .collect()
}

/// One metric per labelled object, reused by every family over those
/// objects: a family borrows the metrics (labels and all) while it is
/// encoded and hands them back, so a render allocates labels once per
/// object, not once per series.
struct Pool {
    metrics: Vec<Metric>,
}

impl Pool {
    fn new(labels: impl Iterator<Item = Vec<LabelPair>>) -> Self {
        Self {
            metrics: labels.map(Metric::from_label).collect(),
        }
    }
}

/// Encodes families one at a time into a buffer.
struct Writer {
    buffer: Vec<u8>,
    encoder: TextEncoder,
}

impl Writer {
    /// Encodes the family `name` with a sample for every object of `pool`
    /// that `value` gives one for.
    fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        pool: &mut Pool,
        value: impl Fn(usize) -> Option<f64>,
    ) {
        let mut metrics = Vec::with_capacity(pool.metrics.len());
        let mut owners = Vec::with_capacity(pool.metrics.len());
        for (index, metric) in pool.metrics.iter_mut().enumerate() {
            let Some(v) = value(index) else { continue };
            match kind {
                MetricType::COUNTER => metric.counter.mut_or_insert_default().set_value(v),
                _ => metric.gauge.mut_or_insert_default().set_value(v),
            }
            metrics.push(std::mem::take(metric));
            owners.push(index);
        }
        if metrics.is_empty() {
            return;
        }
        let mut family = MetricFamily::default();
        family.set_name(name.to_string());
        family.set_help(help.to_string());
        family.set_field_type(kind);
        family.set_metric(metrics);
        if let Err(error) = self
            .encoder
            .encode(std::slice::from_ref(&family), &mut self.buffer)
        {
            // Only an empty family or an I/O error can fail; neither can
            // happen here, and a scrape must never panic.
            tracing::error!("encoding {name}: {error}");
        }
        for (metric, index) in family.mut_metric().drain(..).zip(owners) {
            pool.metrics[index] = metric;
        }
    }

    /// A family with a single unlabelled sample.
    fn single(&mut self, name: &str, help: &str, kind: MetricType, value: f64) {
        let mut pool = Pool::new(std::iter::once(Vec::new()));
        self.family(name, help, kind, &mut pool, |_| Some(value));
    }
}

/// Renders `snapshot` in the Prometheus text format.
pub fn render(snapshot: &Snapshot, hami_names: bool) -> Vec<u8> {
    use MetricType::{COUNTER, GAUGE};
    let mut w = Writer {
        buffer: Vec::with_capacity(256 * (snapshot.devices.len() * 24 + 64)),
        encoder: TextEncoder::new(),
    };
    let devices = &snapshot.devices;

    // Per container and device.
    let per_device: [(&str, &str, MetricType, DeviceValue); 17] = [
        ("vgpu_container_memory_used_bytes", "Device memory charged to the container.", GAUGE, |d| Some(d.figures.memory_used as f64)),
        ("vgpu_container_memory_limit_bytes", "Device memory cap of the container (0 = uncapped).", GAUGE, |d| Some(d.figures.memory_limit as f64)),
        ("vgpu_container_memory_peak_bytes", "Highest device memory use of the container.", GAUGE, |d| Some(d.figures.peak_used as f64)),
        ("vgpu_container_memory_context_bytes", "Device memory charged for CUDA contexts, over the container's live process slots.", GAUGE, |d| Some(d.figures.context as f64)),
        ("vgpu_container_memory_module_bytes", "Device memory charged for loaded modules, over the container's live process slots.", GAUGE, |d| Some(d.figures.module as f64)),
        ("vgpu_container_memory_data_bytes", "Device memory charged for data allocations, over the container's live process slots.", GAUGE, |d| Some(d.figures.data as f64)),
        ("vgpu_container_swap_used_bytes", "Host memory the container uses as swap for the device.", GAUGE, |d| Some(d.figures.swap_used as f64)),
        ("vgpu_container_swap_limit_bytes", "Host memory the container may use as swap for the device.", GAUGE, |d| Some(d.figures.swap_limit as f64)),
        ("vgpu_container_compute_share_ratio", "Configured compute share of the device (1 = uncapped).", GAUGE, |d| Some(percent_ratio(d.figures.sm_limit))),
        ("vgpu_container_compute_burst_ratio", "Compute share the container may borrow up to when the device has idle capacity (1 = uncapped).", GAUGE, |d| Some(if d.figures.sm_limit == 0 || d.figures.sm_limit >= 100 { 1.0 } else { percent_ratio(d.figures.sm_burst.max(d.figures.sm_limit)) })),
        ("vgpu_container_compute_effective_ratio", "Compute share granted now by the monitor (0 = paused, 1 = unlimited).", GAUGE, |d| Some(share_ratio(d.figures.sm_effective))),
        ("vgpu_container_utilization_ratio", "Device time the container got per wall time over the utilization window.", GAUGE, |d| d.utilization),
        ("vgpu_container_throttled_seconds_total", "Time the container's launches waited for their compute share.", COUNTER, |d| Some(d.figures.throttled_ns as f64 / 1e9)),
        ("vgpu_container_kernel_launches_total", "Kernel and graph launches of the container (metered launches).", COUNTER, |d| Some(d.figures.launches as f64)),
        ("vgpu_container_oom_events_total", "Allocations refused because of the container's memory cap.", COUNTER, |d| Some(d.figures.oom_events as f64)),
        ("vgpu_container_last_kernel_age_seconds", "Seconds since the container last launched work on the device.", GAUGE, |d| d.last_kernel_age_seconds),
        ("vgpu_container_priority", "Priority in force for the container (lower is more important).", GAUGE, |d| Some(f64::from(d.priority))),
    ];
    let mut pool = Pool::new(devices.iter().map(|d| {
        let index = d.figures.index.to_string();
        pairs(&[
            ("namespace", &d.namespace),
            ("pod", &d.pod),
            ("container", &d.container),
            ("device_uuid", &d.figures.uuid),
            ("device_index", &index),
        ])
    }));
    for (name, help, kind, value) in per_device {
        w.family(name, help, kind, &mut pool, |i| value(&devices[i]));
    }

    let mut container_pool = Pool::new(snapshot.containers.iter().map(|c| {
        pairs(&[
            ("namespace", &c.namespace),
            ("pod", &c.pod),
            ("container", &c.container),
        ])
    }));
    w.family(
        "vgpu_container_processes",
        "Process slots in use in the container's region.",
        GAUGE,
        &mut container_pool,
        |i| Some(snapshot.containers[i].processes as f64),
    );

    // Per physical GPU.
    let gpus = &snapshot.gpus;
    let per_gpu = snapshot.containers_per_gpu();
    let mut gpu_pool = Pool::new(gpus.iter().map(|g| {
        let index = g.index.to_string();
        pairs(&[
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
        w.family(name, help, GAUGE, &mut gpu_pool, |i| value(&gpus[i]));
    }
    w.family(
        "vgpu_gpu_containers",
        "Containers with a region on the GPU.",
        GAUGE,
        &mut gpu_pool,
        |i| Some(per_gpu.get(gpus[i].uuid.as_str()).copied().unwrap_or(0) as f64),
    );

    // The monitor itself.
    w.single(
        "vgpu_monitor_regions",
        "Container regions the monitor reads.",
        GAUGE,
        snapshot.regions as f64,
    );
    w.single(
        "vgpu_monitor_regions_refused_total",
        "Region files refused (wrong size, magic, version or kind of file).",
        COUNTER,
        snapshot.refused_total as f64,
    );
    w.single(
        "vgpu_monitor_slots_reclaimed_total",
        "Process slots of dead processes returned by the monitor.",
        COUNTER,
        snapshot.reclaimed_total as f64,
    );
    if let Some(up) = snapshot.api_up {
        w.single(
            "vgpu_monitor_kubernetes_api_up",
            "1 when the pod list from the Kubernetes API is current, else 0.",
            GAUGE,
            if up { 1.0 } else { 0.0 },
        );
    }
    w.single(
        "vgpu_monitor_loop_duration_seconds",
        "How long the monitor's last pass took.",
        GAUGE,
        snapshot.loop_seconds,
    );

    if hami_names {
        hami(&mut w, snapshot);
    }
    w.buffer
}

/// HAMi's current names, labels and scales.
fn hami(w: &mut Writer, snapshot: &Snapshot) {
    use MetricType::GAUGE;
    let gpus = &snapshot.gpus;
    let mut host_pool = Pool::new(gpus.iter().map(|g| {
        let index = g.index.to_string();
        let device_type = format!("NVIDIA-{}", g.name);
        pairs(&[
            ("device_index", &index),
            ("device_type", &device_type),
            ("device_uuid", &g.uuid),
            ("zone", "vGPU"),
        ])
    }));
    w.family(
        "hami_host_gpu_memory_used_bytes",
        "GPU real-time device memory usage on host",
        GAUGE,
        &mut host_pool,
        |i| gpus[i].memory_used.map(|v| v as f64),
    );
    w.family(
        "hami_host_gpu_utilization_ratio",
        "GPU core utilization ratio on host (0-100)",
        GAUGE,
        &mut host_pool,
        |i| gpus[i].utilization.map(|u| u * 100.0),
    );

    let devices = &snapshot.devices;
    let mut pool = Pool::new(devices.iter().map(|d| {
        let index = d.figures.index.to_string();
        pairs(&[
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
        w.family(name, help, GAUGE, &mut pool, |i| value(&devices[i]));
    }
}

/// The content type of [`render`]'s output.
pub fn content_type() -> &'static str {
    prometheus::TEXT_FORMAT
}

#[cfg(test)]
mod tests {
    use super::*;

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
            }],
            gpus: vec![GpuInfo {
                index: 0,
                uuid: "GPU-a".into(),
                name: "Sim".into(),
                memory_used: Some(10),
                memory_total: Some(100),
                utilization: Some(0.5),
                healthy: true,
                ..GpuInfo::default()
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
