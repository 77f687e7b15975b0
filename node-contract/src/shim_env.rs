//! The container environment that configures the shim.
//!
//! Names and meanings are HAMi-core's, so containers set up for HAMi run
//! unchanged; vgpu's own additions start with `VGPU_`. The device plugin
//! builds a [`ShimConfig`] from the scheduler's decision and writes it with
//! [`ShimConfig::to_env`]; the shim reads it back once, at load, with
//! [`ShimConfig::from_lookup`]. Both sides hold the limits in the region's
//! own encoding ([`RegionLimits`], where [`UNCAPPED`] means no cap), so the
//! region the plugin creates and the one the shim opens can never disagree.
//!
//! Where a node set the container up, the environment is not what binds
//! it: the node's grant is ([`crate::region::grant_file`]), and
//! [`ShimConfig::in_node`] reads the environment only for what may lower
//! the grant's caps and shares for one process, never raise, move or lift
//! them. Where no node did (a workstation: `vgpu run`, or HAMi-core's
//! variables alone), the environment is the configuration, as here.

use crate::region::grant_file::GrantSettings;
use crate::region::limits::granted::share_cap;
use crate::region::{
    lower_cap, RegionLimits, UtilizationPolicy, DEFAULT_PRIORITY, MAX_DEVICES, UNCAPPED,
    UNCAPPED_SHARE,
};
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
/// Log level when `LIBCUDA_LOG_LEVEL` is unset (warnings).
pub const DEFAULT_LOG_LEVEL: u8 = 1;

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
    /// Caps this process's own environment sets below its node's grant,
    /// which apply to it on top of the grant's ([`UNCAPPED`]: none).
    /// Always none where no node set the container up: the environment's
    /// caps are then the limits themselves.
    pub memory_ceiling: [u64; MAX_DEVICES],
    /// Compute shares in percent the environment sets below the grant's,
    /// likewise ([`UNCAPPED_SHARE`]: none).
    pub share_ceiling: [u32; MAX_DEVICES],
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
            memory_ceiling: [UNCAPPED; MAX_DEVICES],
            share_ceiling: [UNCAPPED_SHARE; MAX_DEVICES],
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
        self.limits.utilization_policy()
    }

    /// The configuration of a process in a container a node set up: the
    /// grant's limits (`granted`) and settings, with the environment read
    /// through `get` only where it lowers a cap or a share for this
    /// process, and for the log level. Returns the configuration and one
    /// line for each variable that asked for more than the grant, or for
    /// what only the node chooses, and was therefore not followed.
    ///
    /// A malformed variable is still an error (the shim fails closed), so
    /// that a mistake is seen rather than silently ignored.
    pub fn in_node(
        settings: &GrantSettings,
        granted: &RegionLimits,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<String>), ConfigError> {
        let asked = Self::from_lookup(&get)?;
        let mut ignored = Vec::new();
        let mut config = Self {
            limits: granted.as_stored(),
            region_path: settings.region_path.clone(),
            region_path_set: true,
            oversubscribe: settings.oversubscribe,
            log_level: asked.log_level,
            context_reserve: settings.context_reserve,
            measure_contexts: settings.measure_contexts,
            ..Self::default()
        };
        for device in 0..MAX_DEVICES {
            let (want, grant) = (
                asked.limits.memory_limit[device],
                granted.memory_limit[device],
            );
            if want != UNCAPPED {
                if lower_cap(grant, want) == want && want != grant {
                    config.memory_ceiling[device] = want;
                } else if want != grant {
                    ignored.push(format!(
                        "a memory cap of {want} bytes on device {device} is above the node's grant of {grant} bytes"
                    ));
                }
            }
            let (want, grant) = (asked.limits.sm_limit[device], granted.sm_limit[device]);
            if want != UNCAPPED_SHARE {
                if grant == UNCAPPED_SHARE || want < grant {
                    config.share_ceiling[device] = want;
                } else if want != grant {
                    ignored.push(format!(
                        "a compute share of {want} % on device {device} is above the node's grant of {grant} %"
                    ));
                }
            }
        }
        let set = |name: &str| get(name).is_some();
        if set(ENV_REGION_PATH) && asked.region_path != settings.region_path {
            ignored.push(format!(
                "{ENV_REGION_PATH}={}: the region is the one the node made, {}",
                asked.region_path, settings.region_path
            ));
        }
        if set(ENV_UTILIZATION_POLICY) && asked.policy() != config.policy() {
            ignored.push(format!(
                "{ENV_UTILIZATION_POLICY}={}: the node's policy is {}",
                asked.policy().name(),
                config.policy().name()
            ));
        }
        if set(ENV_TASK_PRIORITY) && asked.limits.priority != granted.priority {
            ignored.push(format!(
                "{ENV_TASK_PRIORITY}={}: the node's priority is {}",
                asked.limits.priority, granted.priority
            ));
        }
        if !asked.measure_contexts && asked.context_reserve != settings.context_reserve {
            ignored.push(format!(
                "{ENV_CONTEXT_RESERVE}: what a context is charged is the node's to say"
            ));
        }
        match get(ENV_OVERSUBSCRIBE) {
            Some(_) if !asked.oversubscribe => config.oversubscribe = false,
            Some(_) if !settings.oversubscribe => ignored.push(format!(
                "{ENV_OVERSUBSCRIBE}: the node lends this container no host memory"
            )),
            _ => {}
        }
        let family_set =
            |var: &str| set(var) || (0..MAX_DEVICES).any(|device| set(&format!("{var}_{device}")));
        let differs = [
            (
                ENV_SWAP_LIMIT,
                asked.limits.swap_limit != granted.swap_limit,
            ),
            (
                ENV_SM_BURST_LIMIT,
                asked.limits.as_stored().sm_burst != granted.as_stored().sm_burst,
            ),
        ];
        for (var, differs) in differs {
            if differs && family_set(var) {
                ignored.push(format!("{var}: the node's grant sets it"));
            }
        }
        Ok((config, ignored))
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

    fn node_settings() -> GrantSettings {
        GrantSettings {
            region_path: "/usr/local/vgpu/container/region.cache".into(),
            context_reserve: 256 << 20,
            measure_contexts: true,
            oversubscribe: false,
            device_uuids: Vec::new(),
        }
    }

    fn in_node(vars: &[(&str, &str)], granted: &RegionLimits) -> (ShimConfig, Vec<String>) {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ShimConfig::in_node(&node_settings(), granted, |name| map.get(name).cloned())
            .expect("valid")
    }

    fn granted() -> RegionLimits {
        let mut limits = RegionLimits {
            priority: DEFAULT_PRIORITY,
            ..RegionLimits::default()
        };
        limits.memory_limit[0] = 1 << 30;
        limits.sm_limit[0] = 30;
        limits
    }

    #[test]
    fn in_a_node_container_nothing_in_the_environment_raises_moves_or_lifts_a_limit() {
        let (config, ignored) = in_node(
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "6g"),
                ("CUDA_DEVICE_SM_LIMIT", "90"),
                ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/mine"),
                ("GPU_CORE_UTILIZATION_POLICY", "disable"),
                ("VGPU_CONTEXT_RESERVE", "0"),
                ("CUDA_TASK_PRIORITY", "0"),
                ("CUDA_OVERSUBSCRIBE", "true"),
                ("VGPU_SWAP_LIMIT", "64g"),
            ],
            &granted(),
        );
        assert_eq!(config.limits, granted().as_stored());
        assert_eq!(config.region_path, node_settings().region_path);
        assert_eq!(config.policy(), UtilizationPolicy::Default);
        assert_eq!(config.context_reserve, 256 << 20);
        assert!(config.measure_contexts);
        assert!(!config.oversubscribe);
        assert_eq!(config.memory_ceiling[0], UNCAPPED, "6g is above the grant");
        assert_eq!(config.share_ceiling[0], UNCAPPED_SHARE);
        // Device 1 is uncapped by the grant: the environment's cap lowers it.
        assert_eq!(config.memory_ceiling[1], 6 << 30);
        assert_eq!(config.share_ceiling[1], 90);
        let said = ignored.join("\n");
        for what in [
            "above the node's grant of 1073741824 bytes",
            "above the node's grant of 30 %",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/mine",
            "GPU_CORE_UTILIZATION_POLICY=disable",
            "VGPU_CONTEXT_RESERVE",
            "CUDA_TASK_PRIORITY=0",
            "CUDA_OVERSUBSCRIBE",
        ] {
            assert!(said.contains(what), "{said:?} should say {what}");
        }
    }

    #[test]
    fn in_a_node_container_the_environment_may_lower_a_cap_and_a_share() {
        let (config, ignored) = in_node(
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "512m"),
                ("CUDA_DEVICE_SM_LIMIT_0", "10"),
                ("LIBCUDA_LOG_LEVEL", "3"),
            ],
            &granted(),
        );
        assert!(ignored.is_empty(), "{ignored:?}");
        assert_eq!(config.memory_ceiling[0], 512 << 20);
        assert_eq!(config.share_ceiling[0], 10);
        assert_eq!(config.log_level, 3);
        assert_eq!(config.limits.memory_limit[0], 1 << 30, "the grant is kept");
        // What the plugin writes is the grant itself: no ceiling, nothing said.
        let (config, ignored) = in_node(
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"),
                ("CUDA_DEVICE_SM_LIMIT_0", "30"),
                (
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                    "/usr/local/vgpu/container/region.cache",
                ),
                ("GPU_CORE_UTILIZATION_POLICY", "default"),
            ],
            &granted(),
        );
        assert!(ignored.is_empty(), "{ignored:?}");
        assert_eq!(config.memory_ceiling[0], UNCAPPED);
        assert_eq!(config.share_ceiling[0], UNCAPPED_SHARE);
        // A malformed value is still an error: the shim fails closed.
        let map = HashMap::from([("CUDA_DEVICE_MEMORY_LIMIT".to_string(), "lots".to_string())]);
        assert!(
            ShimConfig::in_node(&node_settings(), &granted(), |name| map.get(name).cloned())
                .is_err()
        );
    }
}
