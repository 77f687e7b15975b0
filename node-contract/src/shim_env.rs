//! The container environment that configures the shim.
//!
//! Names and meanings are HAMi-core's, so containers set up for HAMi run
//! unchanged; vgpu's own additions start with `VGPU_`. The device plugin
//! builds a [`ShimConfig`] from the scheduler's decision and writes it with
//! [`ShimConfig::to_env`]; the shim reads it back once, at load, with
//! [`ShimConfig::from_lookup`]. Both sides hold the limits in the region's
//! own encoding ([`RegionLimits`], where [`UNCAPPED`] means no cap), so the
//! region the plugin creates and the one the shim opens can never disagree.

use crate::region::{RegionLimits, MAX_DEVICES, UNCAPPED, UNCAPPED_SHARE};
use crate::size::{format_size, parse_percent, parse_size, SizeError};
use thiserror::Error;

/// Memory cap for every device; `CUDA_DEVICE_MEMORY_LIMIT_<i>` overrides device `i`.
pub const ENV_MEMORY_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
/// Compute share in percent for every device; `_<i>` overrides device `i`.
pub const ENV_SM_LIMIT: &str = "CUDA_DEVICE_SM_LIMIT";
/// Path of the container's region file.
pub const ENV_REGION_PATH: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// `default`, `force` or `disable`.
pub const ENV_UTILIZATION_POLICY: &str = "GPU_CORE_UTILIZATION_POLICY";
/// Integer; lower is more important.
pub const ENV_TASK_PRIORITY: &str = "CUDA_TASK_PRIORITY";
/// `true` lets allocations beyond the cap spill to host memory.
pub const ENV_OVERSUBSCRIBE: &str = "CUDA_OVERSUBSCRIBE";
/// 0 (errors) .. 4 (trace).
pub const ENV_LOG_LEVEL: &str = "LIBCUDA_LOG_LEVEL";
/// Device memory charged for each CUDA context (vgpu addition).
pub const ENV_CONTEXT_RESERVE: &str = "VGPU_CONTEXT_RESERVE";
/// Host memory a device may borrow as swap when `CUDA_OVERSUBSCRIBE` is
/// true; `_<i>` overrides device `i` (vgpu addition). Unset: no swap.
pub const ENV_SWAP_LIMIT: &str = "VGPU_SWAP_LIMIT";
/// Compute share in percent the container may use when the device has idle
/// capacity; `_<i>` overrides device `i` (vgpu addition, like KubeShare's
/// `gpu_limit`). Only a node monitor lends it; alone the share is the cap.
pub const ENV_SM_BURST_LIMIT: &str = "VGPU_SM_BURST_LIMIT";

/// CUDA's device numbering. The device plugin and `vgpu run --devices` set
/// it to `PCI_BUS_ID`, so that device `i` is numbered as NVML and
/// nvidia-smi number it (the driver's default puts the fastest first).
/// Not read by the shim.
pub const ENV_DEVICE_ORDER: &str = "CUDA_DEVICE_ORDER";

/// Region path used when `CUDA_DEVICE_MEMORY_SHARED_CACHE` is unset.
pub const DEFAULT_REGION_PATH: &str = "/tmp/cudevshr.cache";
/// Per-context charge when `VGPU_CONTEXT_RESERVE` is unset, and the floor
/// under what the shim measures a context to hold. A CUDA context holds a
/// few hundred MiB of its own (an H100 with CUDA 13: 518 MiB), more on
/// devices with more multiprocessors; what it holds is measured where the
/// driver's NVML can say, and this is charged until then.
pub const DEFAULT_CONTEXT_RESERVE: u64 = 256 << 20;
/// Priority when `CUDA_TASK_PRIORITY` is unset.
pub const DEFAULT_PRIORITY: i32 = 1;
/// Log level when `LIBCUDA_LOG_LEVEL` is unset (warnings).
pub const DEFAULT_LOG_LEVEL: u8 = 1;

/// The stored form of a compute share of `percent`: a whole device (or
/// more) is no cap at all, and so is 0.
pub fn share_cap(percent: u32) -> u32 {
    if percent >= 100 {
        UNCAPPED_SHARE
    } else {
        percent
    }
}

/// How the compute share is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u32)]
pub enum UtilizationPolicy {
    /// The share the node monitor grants (the configured share without one).
    #[default]
    Default = 0,
    /// The configured share is a hard cap.
    Force = 1,
    /// No compute cap.
    Disable = 2,
}

impl UtilizationPolicy {
    /// Decodes the value stored in a region.
    pub fn from_u32(value: u32) -> Option<Self> {
        match value {
            0 => Some(Self::Default),
            1 => Some(Self::Force),
            2 => Some(Self::Disable),
            _ => None,
        }
    }

    /// The value of `GPU_CORE_UTILIZATION_POLICY` that selects this policy.
    pub fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Force => "force",
            Self::Disable => "disable",
        }
    }

    /// Reads a policy name (any case; empty means the default).
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        if text.is_empty() {
            return Some(Self::Default);
        }
        [Self::Default, Self::Force, Self::Disable]
            .into_iter()
            .find(|policy| text.eq_ignore_ascii_case(policy.name()))
    }
}

/// A variable that could not be used. The shim fails closed on any of these.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{var}")]
    Size {
        var: String,
        #[source]
        source: SizeError,
    },
    #[error("{var}={value:?}: expected one of default, force, disable")]
    Policy { var: String, value: String },
    #[error("{var}={value:?}: expected an integer")]
    Integer { var: String, value: String },
    #[error("{var}={value:?}: expected true or false")]
    Bool { var: String, value: String },
    #[error("{var}={value:?}: expected a level from 0 (errors only) to 4 (trace)")]
    LogLevel { var: String, value: String },
    #[error("{var} is empty: expected a file path")]
    EmptyPath { var: String },
}

/// Everything the shim needs from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShimConfig {
    /// Caps, shares, policy and priority, exactly as the region stores them.
    /// Swap allowances are zero unless `oversubscribe` is set.
    pub limits: RegionLimits,
    /// Region file path.
    pub region_path: String,
    /// Whether the region path came from the environment.
    pub region_path_set: bool,
    pub oversubscribe: bool,
    pub log_level: u8,
    /// Bytes charged per CUDA context: exactly this when `VGPU_CONTEXT_RESERVE`
    /// is set, else the floor under what the shim measures a context to hold.
    pub context_reserve: u64,
    /// Whether the shim measures what a context holds (no reserve was set).
    pub measure_contexts: bool,
}

impl Default for ShimConfig {
    /// What an empty environment means: no limit, the default region path.
    fn default() -> Self {
        Self {
            limits: RegionLimits {
                priority: DEFAULT_PRIORITY,
                ..RegionLimits::default()
            },
            region_path: DEFAULT_REGION_PATH.to_string(),
            region_path_set: false,
            oversubscribe: false,
            log_level: DEFAULT_LOG_LEVEL,
            context_reserve: DEFAULT_CONTEXT_RESERVE,
            measure_contexts: true,
        }
    }
}

impl ShimConfig {
    /// True when any limit or a region is configured; otherwise the shim only
    /// forwards calls.
    pub fn enforces_anything(&self) -> bool {
        self.region_path_set
            || self.limits.memory_limit.iter().any(|cap| *cap != UNCAPPED)
            || self
                .limits
                .sm_limit
                .iter()
                .any(|share| *share != UNCAPPED_SHARE)
    }

    /// The compute policy (valid by construction).
    pub fn policy(&self) -> UtilizationPolicy {
        UtilizationPolicy::from_u32(self.limits.policy).unwrap_or_default()
    }

    /// Reads the configuration through `get` (the process environment in the
    /// shim, a map in the device plugin and tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let memory_all = read_size(&get, ENV_MEMORY_LIMIT)?;
        let sm_all = read_percent(&get, ENV_SM_LIMIT)?;
        let burst_all = read_percent(&get, ENV_SM_BURST_LIMIT)?;
        let swap_all = read_size(&get, ENV_SWAP_LIMIT)?;
        let mut config = Self::default();
        let limits = &mut config.limits;
        for index in 0..MAX_DEVICES {
            let memory = read_size(&get, &format!("{ENV_MEMORY_LIMIT}_{index}"))?.or(memory_all);
            // Zero means "no cap", as in HAMi-core: the region's encoding.
            limits.memory_limit[index] = memory.unwrap_or(UNCAPPED);
            let sm = read_percent(&get, &format!("{ENV_SM_LIMIT}_{index}"))?.or(sm_all);
            limits.sm_limit[index] = sm.map_or(UNCAPPED_SHARE, share_cap);
            let burst = read_percent(&get, &format!("{ENV_SM_BURST_LIMIT}_{index}"))?.or(burst_all);
            limits.sm_burst[index] = burst.unwrap_or(0);
            limits.swap_limit[index] = read_size(&get, &format!("{ENV_SWAP_LIMIT}_{index}"))?
                .or(swap_all)
                .unwrap_or(0);
        }

        match get(ENV_REGION_PATH) {
            Some(path) if path.trim().is_empty() => {
                return Err(ConfigError::EmptyPath {
                    var: ENV_REGION_PATH.to_string(),
                })
            }
            Some(path) => {
                config.region_path = path;
                config.region_path_set = true;
            }
            None => {}
        }

        if let Some(value) = get(ENV_UTILIZATION_POLICY) {
            let policy = UtilizationPolicy::parse(&value).ok_or_else(|| ConfigError::Policy {
                var: ENV_UTILIZATION_POLICY.to_string(),
                value: value.trim().to_string(),
            })?;
            config.limits.policy = policy as u32;
        }

        if let Some(value) = get(ENV_TASK_PRIORITY) {
            config.limits.priority = value.trim().parse().map_err(|_| ConfigError::Integer {
                var: ENV_TASK_PRIORITY.to_string(),
                value: value.clone(),
            })?;
        }

        config.oversubscribe = match get(ENV_OVERSUBSCRIBE).as_deref().map(str::trim) {
            None | Some("") => false,
            Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => true,
            Some(v) if v.eq_ignore_ascii_case("false") || v == "0" => false,
            Some(other) => {
                return Err(ConfigError::Bool {
                    var: ENV_OVERSUBSCRIBE.to_string(),
                    value: other.to_string(),
                })
            }
        };

        if let Some(value) = get(ENV_LOG_LEVEL) {
            config.log_level = match value.trim().parse::<u8>() {
                Ok(level) if level <= 4 => level,
                _ => {
                    return Err(ConfigError::LogLevel {
                        var: ENV_LOG_LEVEL.to_string(),
                        value,
                    })
                }
            };
        }

        if let Some(reserve) = read_size(&get, ENV_CONTEXT_RESERVE)? {
            config.context_reserve = reserve;
            config.measure_contexts = false;
        }

        if !config.oversubscribe {
            config.limits.swap_limit = [0; MAX_DEVICES];
        }
        Ok(config)
    }

    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The variables that make [`ShimConfig::from_lookup`] return this
    /// configuration for its first `devices` devices (the rest uncapped):
    /// what the device plugin hands a container. Per-device variables only,
    /// so a container sees exactly what was decided for each of its GPUs.
    pub fn to_env(&self, devices: usize) -> Vec<(String, String)> {
        let limits = &self.limits;
        let mut env = Vec::new();
        for index in 0..devices.min(MAX_DEVICES) {
            env.push((
                format!("{ENV_MEMORY_LIMIT}_{index}"),
                format_size(limits.memory_limit[index]),
            ));
            env.push((
                format!("{ENV_SM_LIMIT}_{index}"),
                limits.sm_limit[index].to_string(),
            ));
            if limits.sm_burst[index] != 0 {
                env.push((
                    format!("{ENV_SM_BURST_LIMIT}_{index}"),
                    limits.sm_burst[index].to_string(),
                ));
            }
            if self.oversubscribe && limits.swap_limit[index] != 0 {
                env.push((
                    format!("{ENV_SWAP_LIMIT}_{index}"),
                    format_size(limits.swap_limit[index]),
                ));
            }
        }
        if self.region_path_set {
            env.push((ENV_REGION_PATH.to_string(), self.region_path.clone()));
        }
        env.push((
            ENV_UTILIZATION_POLICY.to_string(),
            self.policy().name().to_string(),
        ));
        if limits.priority != DEFAULT_PRIORITY {
            env.push((ENV_TASK_PRIORITY.to_string(), limits.priority.to_string()));
        }
        if self.oversubscribe {
            env.push((ENV_OVERSUBSCRIBE.to_string(), "true".to_string()));
        }
        if self.log_level != DEFAULT_LOG_LEVEL {
            env.push((ENV_LOG_LEVEL.to_string(), self.log_level.to_string()));
        }
        if !self.measure_contexts {
            env.push((
                ENV_CONTEXT_RESERVE.to_string(),
                format_size(self.context_reserve),
            ));
        }
        env
    }
}

fn read_size(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<Option<u64>, ConfigError> {
    get(var)
        .map(|value| {
            parse_size(&value).map_err(|source| ConfigError::Size {
                var: var.to_string(),
                source,
            })
        })
        .transpose()
}

fn read_percent(
    get: &impl Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Option<u32>, ConfigError> {
    get(var)
        .map(|value| {
            parse_percent(&value).map_err(|source| ConfigError::Size {
                var: var.to_string(),
                source,
            })
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<ShimConfig, ConfigError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ShimConfig::from_lookup(|name| map.get(name).cloned())
    }

    fn error_chain(error: &dyn std::error::Error) -> String {
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }

    #[test]
    fn empty_environment_enforces_nothing() {
        let cfg = config(&[]).expect("valid");
        assert!(!cfg.enforces_anything());
        assert_eq!(cfg, ShimConfig::default());
        assert_eq!(cfg.region_path, DEFAULT_REGION_PATH);
        assert_eq!(cfg.policy(), UtilizationPolicy::Default);
        assert_eq!(cfg.limits.priority, DEFAULT_PRIORITY);
        assert_eq!(cfg.context_reserve, DEFAULT_CONTEXT_RESERVE);
        assert!(
            cfg.measure_contexts,
            "no reserve set: contexts are measured"
        );
    }

    #[test]
    fn per_device_values_override_the_global_one() {
        let cfg = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "3000m"),
            ("CUDA_DEVICE_SM_LIMIT_2", "30"),
        ])
        .expect("valid");
        assert_eq!(cfg.limits.memory_limit[0], 4 << 30);
        assert_eq!(cfg.limits.memory_limit[1], 3000 << 20);
        assert_eq!(cfg.limits.memory_limit[15], 4 << 30);
        assert_eq!(cfg.limits.sm_limit[0], 0);
        assert_eq!(cfg.limits.sm_limit[2], 30);
        assert!(cfg.enforces_anything());
    }

    #[test]
    fn zero_and_full_mean_uncapped() {
        let cfg = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
            ("CUDA_DEVICE_SM_LIMIT", "100"),
        ])
        .expect("valid");
        assert!(cfg.limits.memory_limit.iter().all(|cap| *cap == UNCAPPED));
        assert!(cfg
            .limits
            .sm_limit
            .iter()
            .all(|share| *share == UNCAPPED_SHARE));
        assert!(!cfg.enforces_anything());
    }

    #[test]
    fn every_malformed_value_names_its_variable_and_why() {
        let cases: &[(&str, &str, &str)] = &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1.5g", "fractions"),
            ("CUDA_DEVICE_MEMORY_LIMIT_3", "lots", "digit"),
            ("CUDA_DEVICE_SM_LIMIT", "150", "0 to 100"),
            ("GPU_CORE_UTILIZATION_POLICY", "sometimes", "force"),
            ("CUDA_TASK_PRIORITY", "high", "integer"),
            ("CUDA_OVERSUBSCRIBE", "maybe", "true or false"),
            ("LIBCUDA_LOG_LEVEL", "9", "trace"),
            ("VGPU_CONTEXT_RESERVE", "-1", "digit"),
            ("VGPU_SM_BURST_LIMIT", "120", "0 to 100"),
            ("VGPU_SWAP_LIMIT", "lots", "digit"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", " ", "file path"),
        ];
        for (var, value, why) in cases {
            let err = config(&[(var, value)]).expect_err(var);
            let text = error_chain(&err);
            assert!(text.contains(var), "{text} should name {var}");
            assert!(text.contains(why), "{text} should say {why}");
        }
    }

    #[test]
    fn swap_needs_oversubscription() {
        let off = config(&[("VGPU_SWAP_LIMIT", "8Gi")]).expect("valid");
        assert_eq!(
            off.limits.swap_limit[0], 0,
            "no swap without CUDA_OVERSUBSCRIBE"
        );
        let on = config(&[
            ("VGPU_SWAP_LIMIT", "8Gi"),
            ("VGPU_SWAP_LIMIT_1", "1Gi"),
            ("CUDA_OVERSUBSCRIBE", "true"),
        ])
        .expect("valid");
        assert_eq!(on.limits.swap_limit[0], 8 << 30);
        assert_eq!(on.limits.swap_limit[1], 1 << 30);
    }

    #[test]
    fn policies_and_flags() {
        let cfg = config(&[
            ("GPU_CORE_UTILIZATION_POLICY", "FORCE"),
            ("CUDA_OVERSUBSCRIBE", "true"),
            ("CUDA_TASK_PRIORITY", "-3"),
            ("LIBCUDA_LOG_LEVEL", "4"),
        ])
        .expect("valid");
        assert_eq!(cfg.policy(), UtilizationPolicy::Force);
        assert!(cfg.oversubscribe);
        assert_eq!(cfg.limits.priority, -3);
        assert_eq!(cfg.log_level, 4);
    }

    #[test]
    fn what_the_plugin_writes_the_shim_reads_back_unchanged() {
        let mut written = ShimConfig {
            region_path: "/vgpu/region".into(),
            region_path_set: true,
            oversubscribe: true,
            log_level: 3,
            context_reserve: 300 << 20,
            measure_contexts: false,
            ..ShimConfig::default()
        };
        written.limits.policy = UtilizationPolicy::Force as u32;
        written.limits.priority = 0;
        written.limits.memory_limit[..3].copy_from_slice(&[(1 << 30) + 1, 3000 << 20, UNCAPPED]);
        written.limits.sm_limit[..3].copy_from_slice(&[30, 0, 99]);
        written.limits.sm_burst[..3].copy_from_slice(&[80, 0, 0]);
        written.limits.swap_limit[..3].copy_from_slice(&[8 << 30, 0, 1]);
        let env: HashMap<String, String> = written.to_env(3).into_iter().collect();
        let read = ShimConfig::from_lookup(|name| env.get(name).cloned()).expect("valid");
        assert_eq!(read, written);

        let uncapped = ShimConfig::default();
        let env: HashMap<String, String> = uncapped.to_env(2).into_iter().collect();
        let read = ShimConfig::from_lookup(|name| env.get(name).cloned()).expect("valid");
        assert_eq!(read, uncapped);
    }
}
