//! Placement policies by name: which GPU on a node, which node in the
//! cluster (what they do: the scheduler extender's placement).
//!
//! Both are set cluster-wide by flags and per pod by annotation:
//! [`GPU_POLICY_ANNOTATION`] / [`NODE_POLICY_ANNOTATION`], or HAMi's
//! `hami.io/gpu-scheduler-policy` / `hami.io/node-scheduler-policy`
//! (the `vgpu.io` one wins when both are set).

use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// Pod annotation choosing the GPU policy.
pub const GPU_POLICY_ANNOTATION: &str = "vgpu.io/gpu-scheduler-policy";
/// Pod annotation choosing the node policy.
pub const NODE_POLICY_ANNOTATION: &str = "vgpu.io/node-scheduler-policy";
/// HAMi's spelling of [`GPU_POLICY_ANNOTATION`].
pub const HAMI_GPU_POLICY_ANNOTATION: &str = "hami.io/gpu-scheduler-policy";
/// HAMi's spelling of [`NODE_POLICY_ANNOTATION`].
pub const HAMI_NODE_POLICY_ANNOTATION: &str = "hami.io/node-scheduler-policy";

/// How a container's GPUs are chosen among those on a node that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuPolicy {
    /// The GPUs running the fewest containers (ties: least memory in use).
    #[default]
    FewestTasks,
    /// The most used GPUs (memory and compute), keeping others empty.
    Binpack,
    /// The least used GPUs (memory and compute).
    Spread,
    /// Any GPUs that fit, at random (drawn per pod, so every verb agrees).
    Random,
    /// The GPUs the node agent measures as least busy (smoothed SM
    /// utilization; a GPU not measured counts at its granted compute),
    /// ties to the least granted.
    LoadAware,
}

/// How nodes are scored among those that fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NodePolicy {
    /// Prefer the most used nodes, keeping others free for large pods.
    #[default]
    Binpack,
    /// Prefer the least used nodes.
    Spread,
    /// Any node that fits, at random.
    Random,
    /// Prefer the nodes whose GPUs the node agents measure as least busy.
    LoadAware,
}

/// A policy name that is not known.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("unknown {kind} policy {value:?} (known: {known})")]
pub struct UnknownPolicy {
    pub kind: &'static str,
    pub value: String,
    pub known: &'static str,
}

impl GpuPolicy {
    pub const NAMES: &'static str = "fewest-tasks, binpack, spread, random, load-aware";

    pub fn name(self) -> &'static str {
        match self {
            Self::FewestTasks => "fewest-tasks",
            Self::Binpack => "binpack",
            Self::Spread => "spread",
            Self::Random => "random",
            Self::LoadAware => "load-aware",
        }
    }
}

impl NodePolicy {
    pub const NAMES: &'static str = "binpack, spread, random, load-aware";

    pub fn name(self) -> &'static str {
        match self {
            Self::Binpack => "binpack",
            Self::Spread => "spread",
            Self::Random => "random",
            Self::LoadAware => "load-aware",
        }
    }
}

impl FromStr for GpuPolicy {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "fewest-tasks" | "fewesttasks" | "least-tasks" => Ok(Self::FewestTasks),
            "binpack" => Ok(Self::Binpack),
            "spread" => Ok(Self::Spread),
            "random" => Ok(Self::Random),
            "load-aware" | "loadaware" => Ok(Self::LoadAware),
            _ => Err(UnknownPolicy {
                kind: "GPU",
                value: text.to_string(),
                known: Self::NAMES,
            }),
        }
    }
}

impl FromStr for NodePolicy {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "binpack" => Ok(Self::Binpack),
            "spread" => Ok(Self::Spread),
            "random" => Ok(Self::Random),
            "load-aware" | "loadaware" => Ok(Self::LoadAware),
            _ => Err(UnknownPolicy {
                kind: "node",
                value: text.to_string(),
                known: Self::NAMES,
            }),
        }
    }
}

impl fmt::Display for GpuPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for NodePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print() {
        for policy in [
            GpuPolicy::FewestTasks,
            GpuPolicy::Binpack,
            GpuPolicy::Spread,
            GpuPolicy::Random,
            GpuPolicy::LoadAware,
        ] {
            assert_eq!(policy.name().parse::<GpuPolicy>(), Ok(policy));
        }
        for policy in [
            NodePolicy::Binpack,
            NodePolicy::Spread,
            NodePolicy::Random,
            NodePolicy::LoadAware,
        ] {
            assert_eq!(policy.name().parse::<NodePolicy>(), Ok(policy));
        }
        assert_eq!(" Binpack ".parse::<NodePolicy>(), Ok(NodePolicy::Binpack));
        let error = "pack".parse::<GpuPolicy>().expect_err("unknown");
        assert!(
            error.to_string().contains("fewest-tasks, binpack, spread"),
            "{error}"
        );
        assert_eq!("LoadAware".parse::<GpuPolicy>(), Ok(GpuPolicy::LoadAware));
    }
}
