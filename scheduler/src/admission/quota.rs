//! A pod being created whose namespace's quota on vGPU memory or cores
//! cannot take even the amounts the pod names in numbers is refused at
//! once, with the numbers. What it names as a percentage of a GPU, or as a
//! whole GPU, is known only once GPUs are chosen: placement counts it then
//! ([`crate::placement::quota`]), and holds the quota for every pod.

use crate::placement::quota::{check, NamespaceQuotaUse};
use k8s_openapi::api::core::v1::Pod;
use vgpu_cluster::requests::{
    parse_pod, ContainerKind, MemoryRequest, RequestDefaults, ResourceNames,
};

/// Where admission counts a pod's amount.
const BY_NUMBERS: &str =
    "by the amounts it names (a percentage of a GPU or a whole GPU is counted when it is placed)";

/// The namespace's quota use, and the defaults requests are read with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionQuota {
    pub usage: NamespaceQuotaUse,
    pub defaults: RequestDefaults,
}

/// Why `pod` is refused for its namespace's quota, if it is. A pod whose
/// request cannot be read is left to placement, which says why.
pub fn quota_refusal(pod: &Pod, names: &ResourceNames, quota: &AdmissionQuota) -> Option<String> {
    let request = parse_pod(pod, names, &quota.defaults).ok()?;
    let (mut memory_bytes, mut cores) = (0u64, 0u64);
    // Init containers run alone, before the others: the others are what
    // the pod holds while it runs.
    for container in request
        .containers
        .iter()
        .filter(|c| c.kind != ContainerKind::Init)
    {
        let count = u64::from(container.count);
        if let MemoryRequest::Bytes(bytes) = &container.memory {
            memory_bytes = memory_bytes.saturating_add(count.saturating_mul(*bytes));
        }
        cores = cores.saturating_add(count.saturating_mul(u64::from(container.cores)));
    }
    let usage = &quota.usage;
    let refusal = |resource: &str,
                   unit: &'static str,
                   limit: &crate::cache::quotas::Limit,
                   held: u64,
                   taken: u64| {
        check(
            &usage.namespace,
            BY_NUMBERS,
            resource,
            unit,
            limit.clone(),
            held,
            taken,
        )
        .err()
        .map(|rejection| rejection.to_string())
    };
    let memory = usage.memory.as_ref().and_then(|limit| {
        refusal(
            &names.memory,
            "MiB",
            limit,
            usage.held.memory_bytes.div_ceil(1 << 20),
            memory_bytes.div_ceil(1 << 20),
        )
    });
    memory.or_else(|| {
        usage.cores.as_ref().and_then(|limit| {
            refusal(
                &names.cores,
                "hundredths of a GPU",
                limit,
                u64::from(usage.held.cores),
                cores,
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::fixtures::{asking, asking_vgpus, GIB};
    use crate::cache::gpus::Usage;
    use crate::cache::quotas::Limit;

    /// Namespace ns holding 4 GiB and 30 cores, its quota `memory_mib`.
    fn quota(memory_mib: u64) -> AdmissionQuota {
        AdmissionQuota {
            usage: NamespaceQuotaUse {
                namespace: "ns".into(),
                held: Usage {
                    memory_bytes: 4 * GIB,
                    cores: 30,
                    ..Usage::default()
                },
                memory: Some(Limit {
                    value: memory_mib,
                    quota: "team".into(),
                }),
                cores: Some(Limit {
                    value: 100,
                    quota: "team".into(),
                }),
            },
            defaults: RequestDefaults::default(),
        }
    }

    #[test]
    fn a_pod_naming_more_than_its_namespace_has_left_is_refused_with_the_numbers() {
        let names = ResourceNames::default();
        assert_eq!(
            quota_refusal(&asking_vgpus("fits", 2, 2048, 30), &names, &quota(8192)),
            None
        );
        assert_eq!(
            quota_refusal(&asking_vgpus("over", 2, 3072, 30), &names, &quota(8192)).as_deref(),
            Some(
                "namespace ns's ResourceQuota team allows requests.nvidia.com/gpumem 8192 (MiB): its vGPU pods \
                 hold 4096 and this pod would take 6144 by the amounts it names (a percentage of a GPU or a \
                 whole GPU is counted when it is placed)"
            )
        );
        // Cores: three vGPUs of 30 beside the 30 held pass 100.
        let refusal = quota_refusal(&asking_vgpus("cores", 3, 1024, 30), &names, &quota(65536))
            .expect("over the cores");
        assert!(
            refusal.contains("requests.nvidia.com/gpucores 100 (hundredths of a GPU)"),
            "{refusal}"
        );
    }

    #[test]
    fn a_percentage_or_a_whole_gpu_is_left_to_placement() {
        let names = ResourceNames::default();
        let half = asking(
            "half",
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem-percentage", "90"),
                ("nvidia.com/gpucores", "10"),
            ],
        );
        assert_eq!(quota_refusal(&half, &names, &quota(4097)), None);
        let whole = asking("whole", &[("nvidia.com/gpu", "1")]);
        assert_eq!(quota_refusal(&whole, &names, &quota(4097)), None);
    }
}
