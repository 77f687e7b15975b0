//! `vgpu ls` and `vgpu inspect`: regions as a table, as text or as JSON,
//! read with the node monitor's own region reader
//! ([`vgpu_node_contract::figures`]).

use crate::places::{self, Origin, PlaceError};
use serde::Serialize;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_node_contract::figures::{read_figures, read_slots};
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::{Region, RegionError, RegionLimits, SHARE_FULL, SHARE_UNLIMITED};
use vgpu_node_contract::size::human_bytes;

#[derive(Debug, Error)]
pub enum ShowError {
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("{0} is not a regular file (symlinks are refused)")]
    NotRegular(PathBuf),
    #[error("writing the output: {0}")]
    Output(#[source] std::io::Error),
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// A region's configured limits on one device.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct LimitsView {
    /// Bytes; `None`: uncapped.
    pub memory: Option<u64>,
    /// Percent; `None`: the whole GPU.
    pub cores: Option<u32>,
    /// Percent; `None`: the share is the cap.
    pub burst: Option<u32>,
    /// Bytes of host memory; `None`: no swap.
    pub swap: Option<u64>,
}

impl LimitsView {
    pub fn of(limits: &RegionLimits, device: usize) -> Self {
        let nonzero_u64 = |value: u64| (value != 0).then_some(value);
        let share = limits.sm_limit[device];
        let burst = limits.sm_burst[device];
        Self {
            memory: nonzero_u64(limits.memory_limit[device]),
            cores: (share != 0).then_some(share),
            burst: (burst != 0 && burst != share).then_some(burst),
            swap: nonzero_u64(limits.swap_limit[device]),
        }
    }
}

impl fmt::Display for LimitsView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.memory {
            Some(bytes) => write!(f, "memory {}", human_bytes(bytes))?,
            None => write!(f, "memory uncapped")?,
        }
        match self.cores {
            Some(percent) => write!(f, ", cores {percent} %")?,
            None => write!(f, ", cores 100 %")?,
        }
        if let Some(burst) = self.burst {
            write!(f, ", burst {burst} %")?;
        }
        if let Some(swap) = self.swap {
            write!(f, ", swap {}", human_bytes(swap))?;
        }
        Ok(())
    }
}

/// One GPU of a region.
#[derive(Debug, Serialize)]
pub struct DeviceView {
    pub index: usize,
    /// Recorded by the shim once a process used the GPU.
    pub uuid: Option<String>,
    pub limits: LimitsView,
    pub memory_used: u64,
    pub memory_peak: u64,
    pub swap_used: u64,
    /// Allocations the cap refused.
    pub oom_events: u64,
    /// The share applied now (a node monitor may lend or take back), in
    /// percent; `None`: uncapped.
    pub effective_cores: Option<f64>,
}

/// One process of a region.
#[derive(Debug, Serialize)]
pub struct ProcessView {
    pub pid: u32,
    /// 0 when not known.
    pub host_pid: u32,
    /// `None` when its liveness could not be probed.
    pub live: Option<bool>,
    /// Device memory per GPU index.
    pub memory: Vec<DeviceBytes>,
}

#[derive(Debug, Serialize)]
pub struct DeviceBytes {
    pub device: usize,
    pub bytes: u64,
}

/// A region as `ls` and `inspect` show it.
#[derive(Debug, Serialize)]
pub struct RegionView {
    /// The run's name for local regions, else the directory's name.
    pub name: String,
    /// `local`, `kubernetes` or `other`.
    pub origin: &'static str,
    pub pod_uid: Option<String>,
    pub container: Option<String>,
    pub path: PathBuf,
    pub created_unix_ms: u64,
    pub policy: &'static str,
    pub priority: i32,
    pub devices: Vec<DeviceView>,
    pub processes: Vec<ProcessView>,
}

/// A region that could not be read, for `ls`.
#[derive(Debug, Serialize)]
pub struct Unreadable {
    pub path: PathBuf,
    pub error: String,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Entry {
    Region(RegionView),
    Unreadable(Unreadable),
}

/// Opens a region for reading, refusing symlinks as the monitor does (a
/// container could once write its own directory), with the node's grant
/// beside it where there is one (the limits enforced, and the effective
/// shares the monitor writes, are the grant's).
pub(crate) fn open(path: &Path) -> Result<Region, ShowError> {
    let meta = std::fs::symlink_metadata(path).map_err(|source| {
        ShowError::Region(RegionError::Io {
            path: path.to_path_buf(),
            op: "stat",
            source,
        })
    })?;
    if !meta.is_file() {
        return Err(ShowError::NotRegular(path.to_path_buf()));
    }
    let mut region = Region::open_existing(path)?;
    if let Some(dir) = path.parent() {
        region
            .attach_grant_beside(dir, false)
            .map_err(RegionError::from)?;
    }
    Ok(region)
}

/// Reads the region at `path`.
pub fn view(path: &Path) -> Result<RegionView, ShowError> {
    let region = open(path)?;
    Ok(view_of(&region, path))
}

fn view_of(region: &Region, path: &Path) -> RegionView {
    let figures = read_figures(region);
    let limits = region.limits();
    let layout = region.layout();
    let dir_name = places::dir_name_of(path);
    let origin = Origin::of_dir(&dir_name);
    let (name, pod_uid, container) = match &origin {
        Origin::Local { name } => (name.clone(), None, None),
        Origin::Kubernetes { pod_uid, container } => (
            dir_name.clone(),
            Some(pod_uid.clone()),
            Some(container.clone()),
        ),
        Origin::Other => (dir_name.clone(), None, None),
    };
    // The GPUs a process has used (the shim records their UUIDs), else
    // GPU 0 alone: a local region has the same limits on every GPU.
    let mut indices: Vec<usize> = figures.devices.iter().map(|d| d.index).collect();
    if indices.is_empty() {
        indices.push(0);
    }
    let devices = indices
        .into_iter()
        .map(|index| {
            let used = figures.devices.iter().find(|d| d.index == index);
            let effective = region.enforced_limits().devices[index]
                .sm_effective
                .load(std::sync::atomic::Ordering::Relaxed);
            DeviceView {
                index,
                uuid: used.map(|d| d.uuid.clone()),
                limits: LimitsView::of(&limits, index),
                memory_used: region.device_used(index),
                memory_peak: used.map_or(0, |d| d.peak_used),
                swap_used: region.device_swap_used(index),
                oom_events: used.map_or(0, |d| d.oom_events),
                effective_cores: (effective != SHARE_UNLIMITED && effective < SHARE_FULL)
                    .then(|| f64::from(effective) * 100.0 / f64::from(SHARE_FULL)),
            }
        })
        .collect();
    let processes = read_slots(region)
        .into_iter()
        .map(|slot| ProcessView {
            pid: slot.pid,
            host_pid: slot.host_pid,
            live: slot.live,
            memory: slot
                .memory
                .into_iter()
                .map(|(device, bytes)| DeviceBytes { device, bytes })
                .collect(),
        })
        .collect();
    RegionView {
        name,
        origin: origin.kind(),
        pod_uid,
        container,
        path: path.to_path_buf(),
        created_unix_ms: layout
            .header
            .created_unix_ms
            .load(std::sync::atomic::Ordering::Relaxed),
        policy: UtilizationPolicy::from_u32(figures.policy).map_or("unknown", |p| p.name()),
        priority: figures.priority,
        devices,
        processes,
    }
}

/// `vgpu ls`.
pub fn ls(roots: &[PathBuf], json: bool, out: &mut impl Write) -> Result<(), ShowError> {
    let mut entries = Vec::new();
    for root in roots {
        for path in places::list_regions(root) {
            entries.push(match view(&path) {
                Ok(view) => Entry::Region(view),
                Err(error) => Entry::Unreadable(Unreadable {
                    path,
                    error: error.to_string(),
                }),
            });
        }
    }
    if json {
        serde_json::to_writer_pretty(&mut *out, &entries)?;
        writeln!(out).map_err(ShowError::Output)?;
        return Ok(());
    }
    write_table(&entries, out).map_err(ShowError::Output)
}

fn write_table(entries: &[Entry], out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<24} {:<10} {:>5} {:>3} {:>23} {:>6} {:>6}  PATH",
        "NAME", "ORIGIN", "PROCS", "GPU", "MEMORY USED / CAP", "CORES", "BURST"
    )?;
    for entry in entries {
        match entry {
            Entry::Region(region) => {
                for device in &region.devices {
                    let cap = device
                        .limits
                        .memory
                        .map_or_else(|| "-".to_string(), human_bytes);
                    let percent = |value: Option<u32>| {
                        value.map_or_else(|| "-".to_string(), |p| format!("{p}%"))
                    };
                    writeln!(
                        out,
                        "{:<24} {:<10} {:>5} {:>3} {:>23} {:>6} {:>6}  {}",
                        region.name,
                        region.origin,
                        region.processes.len(),
                        device.index,
                        format!("{} / {cap}", human_bytes(device.memory_used)),
                        percent(device.limits.cores),
                        percent(device.limits.burst),
                        region.path.display()
                    )?;
                }
            }
            Entry::Unreadable(bad) => {
                writeln!(
                    out,
                    "{:<24} unreadable: {}",
                    places::dir_name_of(&bad.path),
                    bad.error
                )?;
            }
        }
    }
    Ok(())
}

/// `vgpu inspect`.
pub fn inspect(path: &Path, json: bool, out: &mut impl Write) -> Result<(), ShowError> {
    let region = view(path)?;
    if json {
        serde_json::to_writer_pretty(&mut *out, &region)?;
        writeln!(out).map_err(ShowError::Output)?;
        return Ok(());
    }
    write_details(&region, out).map_err(ShowError::Output)
}

fn write_details(region: &RegionView, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "name:     {}", region.name)?;
    writeln!(out, "origin:   {}", region.origin)?;
    if let (Some(uid), Some(container)) = (&region.pod_uid, &region.container) {
        writeln!(out, "pod uid:  {uid}")?;
        writeln!(out, "container: {container}")?;
    }
    writeln!(out, "path:     {}", region.path.display())?;
    writeln!(
        out,
        "policy:   {} (priority {})",
        region.policy, region.priority
    )?;
    for device in &region.devices {
        writeln!(
            out,
            "gpu {}:    {}{}",
            device.index,
            device.limits,
            device
                .uuid
                .as_deref()
                .map_or_else(String::new, |uuid| format!(" ({uuid})"))
        )?;
        writeln!(
            out,
            "          used {}, peak {}, swap used {}, refused allocations {}, share now {}",
            human_bytes(device.memory_used),
            human_bytes(device.memory_peak),
            human_bytes(device.swap_used),
            device.oom_events,
            device
                .effective_cores
                .map_or_else(|| "100 %".to_string(), |share| format!("{share:.0} %"))
        )?;
    }
    writeln!(out, "processes: {}", region.processes.len())?;
    if !region.processes.is_empty() {
        writeln!(
            out,
            "  {:>8} {:>8} {:>5}  MEMORY",
            "PID", "HOST PID", "LIVE"
        )?;
    }
    for process in &region.processes {
        let memory: Vec<String> = process
            .memory
            .iter()
            .map(|held| format!("gpu {}: {}", held.device, human_bytes(held.bytes)))
            .collect();
        let live = match process.live {
            Some(true) => "yes",
            Some(false) => "no",
            None => "?",
        };
        writeln!(
            out,
            "  {:>8} {:>8} {:>5}  {}",
            process.pid,
            process.host_pid,
            live,
            memory.join(", ")
        )?;
    }
    Ok(())
}
