//! Host GPU figures from NVML (`nvml-wrapper`, loaded at run time from a
//! path the operator gives, so the monitor starts on a node without NVIDIA's
//! library and tests can point it at the simulated GPU).

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::HashMap;
use std::path::Path;
use thiserror::Error;

/// Most devices read from NVML (a guard against a broken library).
const MAX_GPUS: u32 = 64;
/// Most per-process samples kept per device.
const MAX_PROCESS_SAMPLES: usize = 4096;

#[derive(Debug, Error)]
pub enum GpuError {
    #[error("cannot load NVML from {path}: {source}")]
    Load {
        path: String,
        #[source]
        source: NvmlError,
    },
    #[error("NVML device count: {0}")]
    Count(#[source] NvmlError),
}

/// One physical GPU's figures at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuInfo {
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
}

/// NVML, once loaded.
pub struct Gpus {
    nvml: Nvml,
    failures_logged: HashMap<(u32, &'static str), ()>,
}

impl Gpus {
    /// Loads NVML from `library` (the system's default name when `None`).
    pub fn open(library: Option<&Path>) -> Result<Self, GpuError> {
        let mut builder = Nvml::builder();
        if let Some(path) = library {
            builder.lib_path(path.as_os_str());
        }
        let nvml = builder.init().map_err(|source| GpuError::Load {
            path: library
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "libnvidia-ml.so".into()),
            source,
        })?;
        let gpus = Self {
            nvml,
            failures_logged: HashMap::new(),
        };
        let count = gpus.nvml.device_count().map_err(GpuError::Count)?;
        tracing::info!("NVML loaded: {count} GPU(s)");
        Ok(gpus)
    }

    /// Reads every GPU. `since_unix_us` bounds the per-process samples
    /// (wall-clock microseconds, as NVML takes them).
    pub fn sample(&mut self, since_unix_us: u64) -> Vec<GpuInfo> {
        let count = match self.nvml.device_count() {
            Ok(count) => count.min(MAX_GPUS),
            Err(error) => {
                self.log_once(u32::MAX, "count", &error);
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let mut info = GpuInfo {
                index,
                ..GpuInfo::default()
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
            match device.process_utilization_stats(since_unix_us) {
                Ok(samples) => {
                    for sample in samples.into_iter().take(MAX_PROCESS_SAMPLES) {
                        let entry = info.process_sm_percent.entry(sample.pid).or_insert(0);
                        *entry = (*entry).max(sample.sm_util.min(100));
                    }
                }
                Err(NvmlError::NotFound) | Err(NvmlError::NotSupported) => {}
                Err(error) => self.log_once(index, "process utilization", &error),
            }
            out.push(info);
        }
        out
    }

    fn log_once(&mut self, index: u32, what: &'static str, error: &NvmlError) {
        if self.failures_logged.insert((index, what), ()).is_none() {
            tracing::warn!("NVML {what} (GPU {index}): {error}");
        }
    }
}
