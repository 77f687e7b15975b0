//! `POST /preempt`: of kube-scheduler's proposed evictions, those that make
//! room for the pod on the GPUs ([`crate::placement::preemption`]).

use crate::cache::clock::now_unix_ms;
use crate::extender::reply::{ErrorBody, Reply};
use crate::extender::scheduler::{NotServing, Scheduler};
use crate::extender::wire::{
    ExtenderPreemptionArgs, ExtenderPreemptionResult, MetaPod, MetaVictims,
};
use crate::placement::preemption::{fewest_victims, Evictions};
use crate::placement::rules::PodRequestError;
use crate::placement::snapshot::Snapshot;
use k8s_openapi::api::core::v1::Pod;
use thiserror::Error;
use vgpu_cluster::report::with_causes;

/// Why a preemption call gets no answer (503, kube-scheduler retries).
#[derive(Debug, Error)]
pub enum PreemptError {
    #[error(transparent)]
    NotServing(#[from] NotServing),
    #[error("ExtenderPreemptionArgs has no Pod")]
    NoPod,
    #[error(transparent)]
    Request(#[from] PodRequestError),
    #[error(
        "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
    )]
    NotListed,
}

/// One node's evictions as kube-scheduler reads them.
fn meta_victims(evictions: &Evictions<'_>) -> (String, MetaVictims) {
    (
        evictions.node.to_string(),
        MetaVictims {
            pods: Some(
                evictions
                    .victims
                    .iter()
                    .map(|uid| MetaPod {
                        uid: uid.to_string(),
                    })
                    .collect(),
            ),
            num_pdb_violations: evictions.violations,
        },
    )
}

impl Scheduler {
    /// `POST /preempt`: kube-scheduler found no node for a pod and proposes,
    /// per node, the lower-priority pods its own dry run would evict.
    pub fn preempt(&self, body: &[u8]) -> Reply {
        let (args, pod) = match ExtenderPreemptionArgs::read(body) {
            Ok(read) => read,
            Err(error) => {
                return Reply::json(
                    error.status(),
                    &ErrorBody {
                        error: error.to_string(),
                    },
                )
            }
        };
        match self.preemption(&args, pod.as_ref()) {
            Ok(result) => Reply::json(200, &result),
            Err(error) => {
                let error = with_causes(&error);
                tracing::info!(error = %error, "preempt");
                Reply::json(503, &ErrorBody { error })
            }
        }
    }

    fn preemption(
        &self,
        args: &ExtenderPreemptionArgs,
        pod: Option<&Pod>,
    ) -> Result<ExtenderPreemptionResult, PreemptError> {
        self.check_leading()?;
        let pod = pod.ok_or(PreemptError::NoPod)?;
        let proposed: Vec<Evictions<'_>> = args
            .proposed()
            .into_iter()
            .map(|(node, victims, violations)| Evictions {
                node,
                victims,
                violations,
            })
            .collect();
        let request = self.rules.parse(pod)?;
        if request.is_empty() {
            // Not a vGPU pod: nothing of ours to weigh.
            return Ok(ExtenderPreemptionResult {
                node_name_to_meta_victims: proposed
                    .iter()
                    .filter(|evictions| !evictions.victims.is_empty())
                    .map(meta_victims)
                    .collect(),
            });
        }
        let state = self.state.read();
        if !state.synced() {
            return Err(PreemptError::NotListed);
        }
        let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
        Ok(ExtenderPreemptionResult {
            node_name_to_meta_victims: fewest_victims(&snapshot, pod, &request, &proposed)
                .iter()
                .map(meta_victims)
                .collect(),
        })
    }
}
