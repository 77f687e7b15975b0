//! What a pod asks for, once read: per container the vGPUs, their memory
//! and compute, and the pod's GPU restrictions and policies.

use crate::policy::{GpuPolicy, NodePolicy};

/// What a vGPU gets when the container does not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestDefaults {
    /// Memory per vGPU in MiB; 0 = the whole GPU's memory.
    pub memory_mib: u64,
    /// Compute share per vGPU in percent.
    pub cores: u32,
}

/// The flags giving [`RequestDefaults`], the same in every binary that
/// reads requests (the chart passes the same values to each).
#[derive(Clone, Debug, clap::Args)]
pub struct RequestDefaultFlags {
    /// Memory per vGPU, in MiB, for containers that ask for neither
    /// nvidia.com/gpumem nor nvidia.com/gpumem-percentage; 0 = the whole GPU.
    #[arg(long, default_value_t = 0, value_name = "MIB")]
    pub default_memory_mib: u64,

    /// Compute share per vGPU, in percent, for containers that do not ask
    /// for nvidia.com/gpucores; 0 = no limit.
    #[arg(long, default_value_t = 0, value_name = "PERCENT",
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub default_cores: u32,
}

impl RequestDefaultFlags {
    pub fn defaults(&self) -> RequestDefaults {
        RequestDefaults {
            memory_mib: self.default_memory_mib,
            cores: self.default_cores,
        }
    }
}

/// Where a container sits in kubelet's admission order and lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerKind {
    /// A regular init container: runs alone, before the others.
    Init,
    /// An init container with `restartPolicy: Always`: runs alongside.
    Sidecar,
    /// A regular container.
    App,
}

impl ContainerKind {
    pub fn is_init(self) -> bool {
        matches!(self, Self::Init | Self::Sidecar)
    }
}

/// Device memory wanted on each vGPU. On a node that scales device memory
/// (HAMi's `deviceMemoryScaling`) a GPU's memory here is what it offers,
/// its physical memory times the factor: a percentage is of that, and the
/// whole of it is that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryRequest {
    Bytes(u64),
    /// Percent of the GPU's memory (1..=100).
    Percent(u32),
    /// The GPU's whole memory.
    Whole,
}

impl MemoryRequest {
    /// Bytes wanted on a GPU with `total` bytes (percentages round down to
    /// whole MiB, as the limits are written in MiB, but to at least 1 MiB).
    pub fn bytes_on(self, total: u64) -> u64 {
        match self {
            Self::Bytes(bytes) => bytes,
            Self::Percent(percent) => {
                let bytes = (u128::from(total) * u128::from(percent) / 100) as u64;
                // Never a zero cap: the shim reads 0 as "uncapped".
                (bytes & !((1 << 20) - 1)).max(1 << 20)
            }
            Self::Whole => total,
        }
    }

    /// How a person reads the request.
    pub fn describe(self) -> String {
        match self {
            Self::Bytes(bytes) => format!("{} MiB", bytes >> 20),
            Self::Percent(percent) => format!("{percent} percent of the memory"),
            Self::Whole => "all the memory".to_string(),
        }
    }
}

/// One GPU-using container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRequest {
    pub name: String,
    pub kind: ContainerKind,
    /// Number of vGPUs, each on a different physical GPU.
    pub count: u32,
    pub memory: MemoryRequest,
    /// Compute share per vGPU, percent (100: exclusive).
    pub cores: u32,
    pub priority: Option<i32>,
}

impl ContainerRequest {
    pub fn exclusive(&self) -> bool {
        self.cores >= 100
    }
}

/// GPU restrictions from the pod's annotations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selectors {
    /// Lower-cased model substrings; empty = any model.
    pub use_types: Vec<String>,
    pub nouse_types: Vec<String>,
    /// UUIDs; empty = any GPU.
    pub use_uuids: Vec<String>,
    pub nouse_uuids: Vec<String>,
    /// The one model wanted ([`crate::resources::GPU_MODEL_ANNOTATION`]), in the form
    /// [`model_key`] gives.
    pub model: Option<String>,
}

/// A GPU model name as compared with a wanted model: lower case, with
/// spaces and `_` written as `-`.
pub fn model_key(model: &str) -> String {
    model
        .trim()
        .chars()
        .map(|c| match c {
            ' ' | '_' => '-',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

impl Selectors {
    /// Whether a GPU model (given in lower case) is wanted.
    pub fn model_allowed(&self, model_lowercase: &str) -> Result<(), TypeMismatch> {
        let model = model_lowercase;
        if let Some(index) = self
            .nouse_types
            .iter()
            .position(|p| model.contains(p.as_str()))
        {
            return Err(TypeMismatch::Excluded(index));
        }
        if !self.use_types.is_empty() && !self.use_types.iter().any(|p| model.contains(p.as_str()))
        {
            return Err(TypeMismatch::NotWanted);
        }
        if let Some(wanted) = &self.model {
            if model_key(model) != *wanted {
                return Err(TypeMismatch::NotTheModel);
            }
        }
        Ok(())
    }

    /// Whether any rule on GPU models is given.
    pub fn restrict_models(&self) -> bool {
        !self.use_types.is_empty() || !self.nouse_types.is_empty() || self.model.is_some()
    }

    /// Whether `uuid` is wanted.
    pub fn uuid_allowed(&self, uuid: &str) -> Result<(), UuidMismatch> {
        if self
            .nouse_uuids
            .iter()
            .any(|u| u.eq_ignore_ascii_case(uuid))
        {
            return Err(UuidMismatch::Excluded);
        }
        if !self.use_uuids.is_empty()
            && !self.use_uuids.iter().any(|u| u.eq_ignore_ascii_case(uuid))
        {
            return Err(UuidMismatch::NotWanted);
        }
        Ok(())
    }
}

/// Why a GPU model is not wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeMismatch {
    /// Not one of the `use` types.
    NotWanted,
    /// Not the model named by [`crate::resources::GPU_MODEL_ANNOTATION`].
    NotTheModel,
    /// Matches `nouse_types[i]`.
    Excluded(usize),
}

/// Why a GPU UUID is not wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UuidMismatch {
    NotWanted,
    Excluded,
}

/// Everything the extender needs from a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRequest {
    /// GPU-using containers in kubelet's admission order: init containers
    /// first, in spec order, then the others.
    pub containers: Vec<ContainerRequest>,
    pub selectors: Selectors,
    pub gpu_policy: Option<GpuPolicy>,
    pub node_policy: Option<NodePolicy>,
    /// Burst share in percent for every capped vGPU of the pod.
    pub burst_percent: Option<u32>,
    /// Drawn from the pod's identity: what the `random` GPU policy draws
    /// by, the same in every verb for the same pod.
    pub seed: u64,
    /// The pod's PriorityClass (`spec.priorityClassName`), which decides
    /// whether it may run above the default priority
    /// ([`super::priority`]).
    pub priority_class: Option<String>,
}

impl PodRequest {
    /// Whether the pod uses no GPU at all.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// A one-line summary for logs.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .containers
            .iter()
            .map(|c| {
                format!(
                    "{}: {} x ({}, {} percent compute)",
                    c.name,
                    c.count,
                    c.memory.describe(),
                    c.cores
                )
            })
            .collect();
        parts.join("; ")
    }
}
