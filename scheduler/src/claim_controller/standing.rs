//! Where a claim stands, as its phase and `Ready` condition say, and the
//! write that says it.

use crate::api::{ApiError, ClaimPart, KubeApi};
use crate::vocabulary::claims::claim_key;
use crate::vocabulary::elastic::{ClaimCondition, ClaimStatus, ElasticGpuClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;

/// The condition vgpu keeps on a claim.
const READY: &str = "Ready";

/// Where a claim stands: each is a `Ready` condition's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It names no class, or one that does not exist.
    ClassNotFound,
    /// Its spec does not have the published shape.
    InvalidObject,
    /// Its request cannot be read as a share vgpu gives.
    InvalidRequest,
    /// No GPU of the cluster could hold its share.
    Unsatisfiable,
    /// Its class provisions when the first pod holding it is placed.
    WaitingForFirstConsumer,
    /// No node has room for its slice now.
    NoCapacity,
    /// Bound to its ElasticGPU.
    Provisioned,
}

const ALL: [Standing; 7] = [
    Standing::ClassNotFound,
    Standing::InvalidObject,
    Standing::InvalidRequest,
    Standing::Unsatisfiable,
    Standing::WaitingForFirstConsumer,
    Standing::NoCapacity,
    Standing::Provisioned,
];

impl Standing {
    /// The condition's reason.
    pub fn reason(self) -> &'static str {
        match self {
            Self::ClassNotFound => "ClassNotFound",
            Self::InvalidObject => "InvalidObject",
            Self::InvalidRequest => "InvalidRequest",
            Self::Unsatisfiable => "Unsatisfiable",
            Self::WaitingForFirstConsumer => "WaitingForFirstConsumer",
            Self::NoCapacity => "NoCapacity",
            Self::Provisioned => "Provisioned",
        }
    }

    fn ready(self) -> bool {
        self == Self::Provisioned
    }

    fn phase(self) -> &'static str {
        if self.ready() {
            "Bound"
        } else {
            "Pending"
        }
    }

    /// Where `claim` stands as vgpu last wrote it, if vgpu wrote it.
    pub fn of(claim: &ElasticGpuClaim) -> Option<Self> {
        let reason = claim.condition(READY)?.reason.as_deref()?;
        ALL.into_iter().find(|standing| standing.reason() == reason)
    }

    /// Whether a claim standing so waits for the cluster to change (room
    /// on a GPU, a pod placed), rather than for a change of its own.
    pub fn waits_for_the_cluster(self) -> bool {
        matches!(
            self,
            Self::Unsatisfiable | Self::WaitingForFirstConsumer | Self::NoCapacity
        )
    }
}

/// Writes the claim's phase and `Ready` condition, unless they are
/// already so. A merge patch of the status alone: nothing else of the
/// claim is written.
pub async fn set_standing(
    api: &KubeApi,
    claim: &ElasticGpuClaim,
    standing: Standing,
    message: &str,
) -> Result<(), ApiError> {
    let status = if standing.ready() { "True" } else { "False" };
    let same = claim.phase() == Some(standing.phase())
        && claim.condition(READY).is_some_and(|c| {
            c.status == status
                && c.reason.as_deref() == Some(standing.reason())
                && c.message.as_deref() == Some(message)
        });
    if same {
        return Ok(());
    }
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    if !standing.ready() {
        tracing::info!(claim = %claim_key(namespace, name), reason = standing.reason(), "{message}");
    }
    let written = ClaimStatus {
        phase: Some(standing.phase().into()),
        conditions: vec![ClaimCondition {
            type_: READY.into(),
            status: status.into(),
            reason: Some(standing.reason().into()),
            message: Some(message.into()),
            last_transition_time: Some(Time(k8s_openapi::jiff::Timestamp::now())),
        }],
    };
    api.patch_elastic_claim(
        namespace,
        name,
        ClaimPart::Status,
        &json!({ "status": written }),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim_standing(reason: &str) -> ElasticGpuClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns"},
            "status": {"phase": "Pending", "conditions": [
                {"type": "Other", "status": "True", "reason": "Provisioned"},
                {"type": "Ready", "status": "False", "reason": reason},
            ]},
        }))
        .expect("a claim")
    }

    #[test]
    fn a_standing_reads_back_from_the_ready_condition() {
        for standing in ALL {
            assert_eq!(
                Standing::of(&claim_standing(standing.reason())),
                Some(standing)
            );
        }
        assert_eq!(Standing::of(&claim_standing("SomeoneElses")), None);
        assert_eq!(Standing::of(&ElasticGpuClaim::default()), None);
        let waiting: Vec<Standing> = ALL
            .into_iter()
            .filter(|s| s.waits_for_the_cluster())
            .collect();
        assert_eq!(
            waiting,
            [
                Standing::Unsatisfiable,
                Standing::WaitingForFirstConsumer,
                Standing::NoCapacity
            ]
        );
        assert_eq!(Standing::Provisioned.phase(), "Bound");
        assert_eq!(Standing::NoCapacity.phase(), "Pending");
    }
}
