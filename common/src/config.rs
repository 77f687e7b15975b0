//! The container environment that configures the shim.
//!
//! Names and meanings are HAMi-core's, so containers set up for HAMi run
//! unchanged; vgpu's own additions start with `VGPU_`. The device plugin
//! writes these variables and the shim reads them once, at load.

use crate::quantity::{parse_percent, parse_size, QuantityError};
use crate::region::MAX_DEVICES;
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

/// Region path used when `CUDA_DEVICE_MEMORY_SHARED_CACHE` is unset.
pub const DEFAULT_REGION_PATH: &str = "/tmp/cudevshr.cache";
/// Default per-context reservation. A CUDA 12 context with lazy module loading
/// holds a few hundred MiB on current data-centre GPUs; charging it keeps
/// `nvidia-smi` and the cap in agreement.
pub const DEFAULT_CONTEXT_RESERVE: u64 = 256 << 20;
/// Priority when `CUDA_TASK_PRIORITY` is unset.
pub const DEFAULT_PRIORITY: i32 = 1;

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
}

/// A variable that could not be used. The shim fails closed on any of these.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{var}: {source}")]
    Quantity {
        var: String,
        #[source]
        source: QuantityError,
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
    /// Memory cap per device ordinal in bytes; `None` means uncapped.
    pub memory_limit: [Option<u64>; MAX_DEVICES],
    /// Host-memory swap per device in bytes (0 = none); only used when
    /// `oversubscribe` is set.
    pub swap_limit: [u64; MAX_DEVICES],
    /// Compute share per device ordinal in percent; `None` means uncapped.
    pub sm_limit: [Option<u32>; MAX_DEVICES],
    /// Burst share per device in percent; `None` means no burst above the share.
    pub sm_burst: [Option<u32>; MAX_DEVICES],
    /// Region file path.
    pub region_path: String,
    /// Whether the region path came from the environment.
    pub region_path_set: bool,
    pub policy: UtilizationPolicy,
    pub priority: i32,
    pub oversubscribe: bool,
    pub log_level: u8,
    /// Bytes charged per CUDA context.
    pub context_reserve: u64,
}

impl ShimConfig {
    /// True when any limit or a region is configured; otherwise the shim only
    /// forwards calls.
    pub fn enforces_anything(&self) -> bool {
        self.region_path_set
            || self.memory_limit.iter().any(Option::is_some)
            || self.sm_limit.iter().any(Option::is_some)
    }

    /// Reads the configuration through `get` (the process environment in the
    /// shim, a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let memory_all = read_size(&get, ENV_MEMORY_LIMIT)?;
        let sm_all = read_percent(&get, ENV_SM_LIMIT)?;
        let burst_all = read_percent(&get, ENV_SM_BURST_LIMIT)?;
        let swap_all = read_size(&get, ENV_SWAP_LIMIT)?;
        let mut memory_limit = [None; MAX_DEVICES];
        let mut swap_limit = [0; MAX_DEVICES];
        let mut sm_limit = [None; MAX_DEVICES];
        let mut sm_burst = [None; MAX_DEVICES];
        for index in 0..MAX_DEVICES {
            let memory = read_size(&get, &format!("{ENV_MEMORY_LIMIT}_{index}"))?.or(memory_all);
            // Zero means "no cap", as in HAMi-core.
            memory_limit[index] = memory.filter(|bytes| *bytes > 0);
            let sm = read_percent(&get, &format!("{ENV_SM_LIMIT}_{index}"))?.or(sm_all);
            sm_limit[index] = sm.filter(|percent| *percent > 0 && *percent < 100);
            let burst = read_percent(&get, &format!("{ENV_SM_BURST_LIMIT}_{index}"))?.or(burst_all);
            sm_burst[index] = burst.filter(|percent| *percent > 0);
            swap_limit[index] = read_size(&get, &format!("{ENV_SWAP_LIMIT}_{index}"))?
                .or(swap_all)
                .unwrap_or(0);
        }

        let (region_path, region_path_set) = match get(ENV_REGION_PATH) {
            Some(path) if path.trim().is_empty() => {
                return Err(ConfigError::EmptyPath {
                    var: ENV_REGION_PATH.to_string(),
                })
            }
            Some(path) => (path, true),
            None => (DEFAULT_REGION_PATH.to_string(), false),
        };

        let policy = match get(ENV_UTILIZATION_POLICY).as_deref().map(str::trim) {
            None | Some("") => UtilizationPolicy::Default,
            Some(v) if v.eq_ignore_ascii_case("default") => UtilizationPolicy::Default,
            Some(v) if v.eq_ignore_ascii_case("force") => UtilizationPolicy::Force,
            Some(v) if v.eq_ignore_ascii_case("disable") => UtilizationPolicy::Disable,
            Some(other) => {
                return Err(ConfigError::Policy {
                    var: ENV_UTILIZATION_POLICY.to_string(),
                    value: other.to_string(),
                })
            }
        };

        let priority = match get(ENV_TASK_PRIORITY) {
            None => DEFAULT_PRIORITY,
            Some(value) => value.trim().parse().map_err(|_| ConfigError::Integer {
                var: ENV_TASK_PRIORITY.to_string(),
                value: value.clone(),
            })?,
        };

        let oversubscribe = match get(ENV_OVERSUBSCRIBE).as_deref().map(str::trim) {
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

        let log_level = match get(ENV_LOG_LEVEL) {
            None => 1,
            Some(value) => match value.trim().parse::<u8>() {
                Ok(level) if level <= 4 => level,
                _ => {
                    return Err(ConfigError::LogLevel {
                        var: ENV_LOG_LEVEL.to_string(),
                        value,
                    })
                }
            },
        };

        let context_reserve =
            read_size(&get, ENV_CONTEXT_RESERVE)?.unwrap_or(DEFAULT_CONTEXT_RESERVE);

        if !oversubscribe {
            swap_limit = [0; MAX_DEVICES];
        }
        Ok(Self {
            memory_limit,
            swap_limit,
            sm_limit,
            sm_burst,
            region_path,
            region_path_set,
            policy,
            priority,
            oversubscribe,
            log_level,
            context_reserve,
        })
    }

    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }
}

fn read_size(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<Option<u64>, ConfigError> {
    get(var)
        .map(|value| {
            parse_size(&value).map_err(|source| ConfigError::Quantity {
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
            parse_percent(&value).map_err(|source| ConfigError::Quantity {
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

    #[test]
    fn empty_environment_enforces_nothing() {
        let cfg = config(&[]).expect("valid");
        assert!(!cfg.enforces_anything());
        assert_eq!(cfg.region_path, DEFAULT_REGION_PATH);
        assert_eq!(cfg.policy, UtilizationPolicy::Default);
        assert_eq!(cfg.priority, DEFAULT_PRIORITY);
        assert_eq!(cfg.context_reserve, DEFAULT_CONTEXT_RESERVE);
    }

    #[test]
    fn per_device_values_override_the_global_one() {
        let cfg = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "3000m"),
            ("CUDA_DEVICE_SM_LIMIT_2", "30"),
        ])
        .expect("valid");
        assert_eq!(cfg.memory_limit[0], Some(4 << 30));
        assert_eq!(cfg.memory_limit[1], Some(3000 << 20));
        assert_eq!(cfg.memory_limit[15], Some(4 << 30));
        assert_eq!(cfg.sm_limit[0], None);
        assert_eq!(cfg.sm_limit[2], Some(30));
        assert!(cfg.enforces_anything());
    }

    #[test]
    fn zero_and_full_mean_uncapped() {
        let cfg = config(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "0"),
            ("CUDA_DEVICE_SM_LIMIT", "100"),
        ])
        .expect("valid");
        assert!(cfg.memory_limit.iter().all(Option::is_none));
        assert!(cfg.sm_limit.iter().all(Option::is_none));
    }

    #[test]
    fn every_malformed_value_names_its_variable() {
        let cases: &[(&str, &str)] = &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1.5g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_3", "lots"),
            ("CUDA_DEVICE_SM_LIMIT", "150"),
            ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
            ("CUDA_TASK_PRIORITY", "high"),
            ("CUDA_OVERSUBSCRIBE", "maybe"),
            ("LIBCUDA_LOG_LEVEL", "9"),
            ("VGPU_CONTEXT_RESERVE", "-1"),
            ("VGPU_SM_BURST_LIMIT", "120"),
            ("VGPU_SWAP_LIMIT", "lots"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", " "),
        ];
        for (var, value) in cases {
            let err = config(&[(var, value)]).expect_err(var);
            assert!(err.to_string().contains(var), "{err} should name {var}");
        }
    }

    #[test]
    fn swap_needs_oversubscription() {
        let off = config(&[("VGPU_SWAP_LIMIT", "8Gi")]).expect("valid");
        assert_eq!(off.swap_limit[0], 0, "no swap without CUDA_OVERSUBSCRIBE");
        let on = config(&[
            ("VGPU_SWAP_LIMIT", "8Gi"),
            ("VGPU_SWAP_LIMIT_1", "1Gi"),
            ("CUDA_OVERSUBSCRIBE", "true"),
        ])
        .expect("valid");
        assert_eq!(on.swap_limit[0], 8 << 30);
        assert_eq!(on.swap_limit[1], 1 << 30);
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
        assert_eq!(cfg.policy, UtilizationPolicy::Force);
        assert!(cfg.oversubscribe);
        assert_eq!(cfg.priority, -3);
        assert_eq!(cfg.log_level, 4);
    }
}
