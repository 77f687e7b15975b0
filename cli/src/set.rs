//! `vgpu set`: new limits for a local region while it runs. The shim reads
//! the cap at every allocation and the share at every throttling period
//! from the region, so running processes follow at once.

use crate::args::SetArgs;
use crate::places::{self, Origin, PlaceError};
use crate::run::describe;
use std::path::{Path, PathBuf};
use thiserror::Error;
use vgpu_node_contract::region::{BelowUse, Region, RegionError, MAX_DEVICES};
use vgpu_node_contract::size::human_bytes;

#[derive(Debug, Error)]
pub enum SetError {
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("{path}: a Kubernetes container's region (pod {pod_uid}, container {container}); its limits come from the pod's scheduling decision: change the pod's resources instead")]
    Kubernetes {
        path: PathBuf,
        pod_uid: String,
        container: String,
    },
    #[error("{0}: not a region made by `vgpu run`; refusing to change it")]
    NotLocal(PathBuf),
    #[error("nothing to change: give --memory, --cores or --burst")]
    Nothing,
    #[error("--burst {burst} is below the share of {cores} %")]
    BurstBelowShare { burst: u32, cores: u32 },
    #[error("refused: GPU {device} holds {used} now, more than a cap of {limit}")]
    BelowUse {
        device: usize,
        used: String,
        limit: String,
    },
}

impl SetError {
    /// 2 for what the command line asked wrongly, 1 for a refusal.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Nothing | Self::BurstBelowShare { .. } => 2,
            _ => 1,
        }
    }
}

impl From<BelowUse> for SetError {
    fn from(refused: BelowUse) -> Self {
        Self::BelowUse {
            device: refused.device,
            used: human_bytes(refused.used),
            limit: human_bytes(refused.limit),
        }
    }
}

/// Checks what the command line asks, before any region is looked up.
pub fn validate(args: &SetArgs) -> Result<(), SetError> {
    if args.memory.is_none() && args.cores.is_none() && args.burst.is_none() {
        return Err(SetError::Nothing);
    }
    if let (Some(cores), Some(burst)) = (args.cores, args.burst) {
        if burst < cores {
            return Err(SetError::BurstBelowShare { burst, cores });
        }
    }
    Ok(())
}

/// Applies `args` to the region at `path`; returns the new limits, described.
pub fn set(path: &Path, args: &SetArgs) -> Result<String, SetError> {
    validate(args)?;
    match Origin::of_dir(&places::dir_name_of(path)) {
        Origin::Local { .. } => {}
        Origin::Kubernetes { pod_uid, container } => {
            return Err(SetError::Kubernetes {
                path: path.to_path_buf(),
                pod_uid,
                container,
            })
        }
        Origin::Other => return Err(SetError::NotLocal(path.to_path_buf())),
    }
    let region = Region::open_existing(path)?;
    let mut limits = region.limits();
    for device in 0..MAX_DEVICES {
        if let Some(memory) = args.memory {
            limits.memory_limit[device] = memory;
        }
        limits
            .set_share(device, args.cores, args.burst)
            .map_err(|refused| SetError::BurstBelowShare {
                burst: refused.burst,
                cores: refused.cores,
            })?;
    }
    region.update_limits(&limits)??;
    Ok(describe(&region.limits()))
}
