//! A namespace's quotas of GPU memory and cores ([`crate::cache::quotas`])
//! where a pod is placed: what the namespace's pods hold now, plus what
//! this pod would take on the node's GPUs (its vGPUs times the amount
//! each gets, a memory percentage or a whole GPU resolved on the GPUs
//! chosen), within every quota's limit.

use crate::cache::gpus::Usage;
use crate::cache::quotas::Limit;
use crate::placement::pod_to_place::NamespaceHeld;
use crate::placement::rejection::{QuotaExceeded, Rejection};
use crate::placement::snapshot::Snapshot;

/// What a namespace with a quota on vGPU resources holds, and its limits
/// (what `/metrics` shows of quotas).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceQuotaUse {
    pub namespace: String,
    pub held: Usage,
    /// The smallest limit of its quotas on the vGPU memory resource, MiB.
    pub memory: Option<Limit>,
    /// The same on the cores resource, hundredths of a GPU.
    pub cores: Option<Limit>,
}

/// Every namespace whose quotas limit the vGPU memory or cores resource,
/// by name.
pub fn quota_use(snapshot: &Snapshot<'_>) -> Vec<NamespaceQuotaUse> {
    let quotas = snapshot.state.quotas();
    let mut used: Vec<NamespaceQuotaUse> = quotas
        .namespaces()
        .filter_map(|namespace| namespace_quota_use(snapshot, namespace))
        .collect();
    used.sort_by(|a, b| a.namespace.cmp(&b.namespace));
    used
}

/// What `namespace` holds and its limits, if its quotas limit the vGPU
/// memory or cores resource.
pub fn namespace_quota_use(snapshot: &Snapshot<'_>, namespace: &str) -> Option<NamespaceQuotaUse> {
    let quotas = snapshot.state.quotas();
    let names = &snapshot.rules.resources;
    let memory = quotas.limit(namespace, &names.memory);
    let cores = quotas.limit(namespace, &names.cores);
    if memory.is_none() && cores.is_none() {
        return None;
    }
    Some(NamespaceQuotaUse {
        namespace: namespace.to_string(),
        held: snapshot.state.held_in_namespace(namespace, &[]),
        memory,
        cores,
    })
}

/// What the pod takes on the node: its running containers' grants, the
/// node's usage after it (`after`) less before (`base`). An init container
/// running alone before them is not counted.
pub fn taken(base: &[Usage], after: &[Usage]) -> Usage {
    let mut taken = Usage::default();
    for (before, after) in base.iter().zip(after) {
        taken.memory_bytes = taken
            .memory_bytes
            .saturating_add(after.memory_bytes.saturating_sub(before.memory_bytes));
        taken.cores = taken
            .cores
            .saturating_add(after.cores.saturating_sub(before.cores));
    }
    taken
}

/// Where placement counts a pod's amount.
const ON_NODE: &str = "on this node's GPUs";

impl Snapshot<'_> {
    /// Whether the pod's namespace stays within its quotas with `taken`
    /// added, the pods `evicted` (a preemption's victims) taken as gone.
    pub fn within_quota(
        &self,
        held: &NamespaceHeld,
        evicted: &[String],
        taken: &Usage,
    ) -> Result<(), Rejection> {
        let mut now = held.held;
        for uid in evicted {
            let Some(victim) = self.state.pod(uid) else {
                continue;
            };
            if victim.namespace == held.namespace && victim.counted_node().is_some() {
                for (_, usage) in &victim.contribution {
                    now.memory_bytes = now.memory_bytes.saturating_sub(usage.memory_bytes);
                    now.cores = now.cores.saturating_sub(usage.cores);
                }
            }
        }
        let quotas = self.state.quotas();
        let names = &self.rules.resources;
        if let Some(limit) = quotas.limit(&held.namespace, &names.memory) {
            let held_mib = now.memory_bytes.div_ceil(1 << 20);
            let taken_mib = taken.memory_bytes.div_ceil(1 << 20);
            check(
                &held.namespace,
                ON_NODE,
                &names.memory,
                "MiB",
                limit,
                held_mib,
                taken_mib,
            )?;
        }
        if let Some(limit) = quotas.limit(&held.namespace, &names.cores) {
            let unit = "hundredths of a GPU";
            check(
                &held.namespace,
                ON_NODE,
                &names.cores,
                unit,
                limit,
                u64::from(now.cores),
                u64::from(taken.cores),
            )?;
        }
        Ok(())
    }
}

/// `held` plus `taken` within `limit` of `resource` in `namespace`, or the
/// rejection that says by how much not.
pub fn check(
    namespace: &str,
    at: &'static str,
    resource: &str,
    unit: &'static str,
    limit: Limit,
    held: u64,
    taken: u64,
) -> Result<(), Rejection> {
    // A pod taking none of the resource is never refused for it, even in a
    // namespace already past a limit that was lowered.
    if taken == 0 || held.saturating_add(taken) <= limit.value {
        return Ok(());
    }
    Err(Rejection::NamespaceQuota(Box::new(QuotaExceeded {
        namespace: namespace.to_string(),
        at,
        quota: limit.quota,
        resource: resource.to_string(),
        unit,
        limit: limit.value,
        held,
        taken,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::book::Book;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{asking, asking_vgpus, decided, node, quota};
    use crate::cache::state::{listed, ClusterState};
    use crate::placement::fit::packing::Scratch;
    use crate::placement::pod_to_place::PodToPlace;
    use crate::placement::rules::Rules;
    use k8s_openapi::api::core::v1::Pod;

    /// Evaluates `placing` (of `pod`) on node n1 of `state`.
    fn evaluate_placing(
        state: &ClusterState,
        pod: &Pod,
        placing: &PodToPlace<'_>,
    ) -> Result<f64, Rejection> {
        let rules = Rules::default();
        let request = rules.parse(pod).expect("request");
        let snapshot = Snapshot::new(state, &rules, now_unix_ms());
        snapshot.evaluate(
            "n1",
            placing,
            &request,
            rules.gpu_policy,
            &mut Scratch::default(),
        )
    }

    fn evaluate(state: &ClusterState, pod: &Pod) -> Result<f64, Rejection> {
        evaluate_placing(state, pod, &PodToPlace::of(state, pod))
    }

    /// Node n1 with two GPUs, pod `running` of namespace ns holding 4 GiB
    /// and 30 % of its GPU 0, and quota `hard` in ns.
    fn state_with(hard: &[(&str, &str)]) -> ClusterState {
        let running = decided("running", 5, "n1", "GPU-n1-0", true, true);
        let mut state = listed(vec![node("n1", 2)], vec![running]);
        state.relist(vec![quota("ns", "team", hard)]);
        state
    }

    #[test]
    fn a_pod_that_would_take_its_namespace_past_its_memory_quota_is_refused_with_the_numbers() {
        let state = state_with(&[("requests.nvidia.com/gpumem", "8192")]);
        // Two vGPUs of 2 GiB: 4 GiB more fits exactly.
        assert!(evaluate(&state, &asking_vgpus("fits", 2, 2048, 10)).is_ok());
        // Two of 3 GiB: 6 GiB more does not.
        let rejection = evaluate(&state, &asking_vgpus("over", 2, 3072, 10)).expect_err("over");
        assert_eq!(
            rejection.to_string(),
            "namespace ns's ResourceQuota team allows requests.nvidia.com/gpumem 8192 (MiB): its vGPU pods \
             hold 4096 and this pod would take 6144 on this node's GPUs"
        );
        assert!(
            !rejection.is_permanent(),
            "ending a pod of the namespace makes room"
        );
        // Another namespace is not limited by it.
        let mut elsewhere = asking_vgpus("other", 2, 3072, 10);
        elsewhere.metadata.namespace = Some("other".into());
        assert!(evaluate(&state, &elsewhere).is_ok());
    }

    #[test]
    fn cores_count_every_vgpu_and_a_preemptions_victims_are_gone() {
        let state = state_with(&[("requests.nvidia.com/gpucores", "100")]);
        // Two vGPUs of 40: 80 more beside the 30 held.
        let pod = asking_vgpus("p", 2, 1024, 40);
        let rejection = evaluate(&state, &pod).expect_err("over");
        assert!(
            rejection
                .to_string()
                .contains("hold 30 and this pod would take 80"),
            "{rejection}"
        );
        // With the running pod evicted, it fits.
        let mut placing = PodToPlace::of(&state, &pod);
        placing.evicted = vec!["running".into()];
        assert!(evaluate_placing(&state, &pod, &placing).is_ok());
    }

    #[test]
    fn a_memory_percentage_is_counted_as_the_memory_it_resolves_to() {
        let state = state_with(&[("requests.nvidia.com/gpumem", "10000")]);
        // Half of a 24 GiB GPU is 12288 MiB, beside the 4096 held.
        let half = asking(
            "half",
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem-percentage", "50"),
                ("nvidia.com/gpucores", "10"),
            ],
        );
        let rejection = evaluate(&state, &half).expect_err("over");
        assert!(
            rejection
                .to_string()
                .contains("hold 4096 and this pod would take 12288"),
            "{rejection}"
        );
    }

    #[test]
    fn the_pods_own_earlier_decision_is_not_counted_twice() {
        let state = state_with(&[("requests.nvidia.com/gpumem", "4096")]);
        // The running pod scheduled again (its decision counted) fits in
        // the quota its own decision fills.
        let mut again = asking_vgpus("running", 1, 4096, 30);
        again.metadata.uid = Some("running".into());
        assert!(evaluate(&state, &again).is_ok());
    }
}
