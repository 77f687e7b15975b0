//! The devices kubelet sees: each physical GPU as `split_count` virtual
//! devices named `<GPU UUID>::<k>`.
//!
//! Kubelet only counts these: which physical GPU a container gets, with what
//! memory and compute share, is the scheduler extender's decision (see
//! [`vgpu_cluster::decision`]); the virtual IDs kubelet picks are checked for
//! their number only.

use crate::api::v1beta1 as api;
use vgpu_cluster::decision::InventoryGpu;

/// Separates the GPU UUID from the replica number in a device ID.
pub const ID_SEPARATOR: &str = "::";
/// Kubelet's health strings.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
/// Longest device ID kubelet accepts.
pub const MAX_ID_LEN: usize = 63;

/// The ID of replica `replica` of the GPU `uuid`.
pub fn device_id(uuid: &str, replica: u32) -> String {
    format!("{uuid}{ID_SEPARATOR}{replica}")
}

/// The GPU UUID and replica of a device ID, if it is one of ours.
pub fn parse_device_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, replica) = id.rsplit_once(ID_SEPARATOR)?;
    if uuid.is_empty() {
        return None;
    }
    Some((uuid, replica.parse().ok()?))
}

/// The device list for `ListAndWatch`: every replica of every GPU, with the
/// GPU's health and NUMA node.
pub fn kubelet_devices(gpus: &[InventoryGpu]) -> Vec<api::Device> {
    gpus.iter()
        .flat_map(|gpu| {
            let health = if gpu.healthy { HEALTHY } else { UNHEALTHY };
            let topology = gpu.numa.map(|node| api::TopologyInfo {
                nodes: vec![api::NumaNode {
                    id: i64::from(node),
                }],
            });
            (0..gpu.split_count).map(move |replica| api::Device {
                id: device_id(&gpu.uuid, replica),
                health: health.to_string(),
                topology: topology.clone(),
            })
        })
        .collect()
}

/// Picks `size` devices out of `available` for a container, as
/// `GetPreferredAllocation` answers: every one of `must_include` first, then
/// one replica on each GPU of `preferred_gpus` (the GPUs the scheduler
/// decided on, in order), then replicas of GPUs not used yet, from one
/// NVLink island or else one NUMA node of `gpus` when one can supply all
/// the GPUs still wanted (see [`one_domain`]), then any.
/// Returns fewer than `size` only when `available` has fewer.
pub fn preferred(
    available: &[String],
    must_include: &[String],
    size: usize,
    preferred_gpus: &[String],
    gpus: &[InventoryGpu],
) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    let mut used_gpus: Vec<String> = Vec::new();
    let mut take = |id: &String, chosen: &mut Vec<String>| {
        if chosen.len() < size && !chosen.contains(id) {
            if let Some((uuid, _)) = parse_device_id(id) {
                used_gpus.push(uuid.to_string());
            }
            chosen.push(id.clone());
        }
    };
    for id in must_include {
        take(id, &mut chosen);
    }
    for gpu in preferred_gpus {
        if chosen
            .iter()
            .any(|id| parse_device_id(id).is_some_and(|(uuid, _)| uuid == gpu))
        {
            continue;
        }
        if let Some(id) = available
            .iter()
            .find(|id| parse_device_id(id).is_some_and(|(uuid, _)| uuid == gpu))
        {
            take(id, &mut chosen);
        }
    }
    // Spread the rest over distinct GPUs, as a container's vGPUs must each
    // be on a different physical GPU: first within one island or node.
    let chosen_gpus: Vec<&str> = chosen
        .iter()
        .filter_map(|id| parse_device_id(id).map(|(uuid, _)| uuid))
        .collect();
    let need = size.saturating_sub(chosen.len());
    let together = one_domain(available, &chosen_gpus, need, gpus);
    let together: Vec<String> = together
        .iter()
        .filter_map(|gpu| {
            available
                .iter()
                .find(|id| parse_device_id(id).is_some_and(|(uuid, _)| uuid == *gpu))
                .cloned()
        })
        .collect();
    for id in &together {
        take(id, &mut chosen);
    }
    for id in available {
        let on_new_gpu = parse_device_id(id).is_some_and(|(uuid, _)| {
            !chosen
                .iter()
                .any(|c| parse_device_id(c).is_some_and(|(u, _)| u == uuid))
        });
        if on_new_gpu {
            take(id, &mut chosen);
        }
    }
    for id in available {
        take(id, &mut chosen);
    }
    chosen
}

/// The topology levels a container's GPUs are kept within, closest first.
const DOMAINS: [fn(&InventoryGpu) -> Option<u32>; 2] = [|gpu| gpu.nvlink_island, |gpu| gpu.numa];

/// `need` GPUs with a replica in `available` (UUIDs, in `available`'s
/// order, none of `chosen`) that share one NVLink island, else one NUMA
/// node, with every GPU of `chosen`: the first such domain `available`'s
/// order completes. Empty when there is none, and when there is nothing to
/// keep together (one GPU wanted and none chosen yet).
pub fn one_domain<'a>(
    available: &'a [String],
    chosen: &[&str],
    need: usize,
    gpus: &[InventoryGpu],
) -> Vec<&'a str> {
    if need == 0 || (need == 1 && chosen.is_empty()) {
        return Vec::new();
    }
    let mut free: Vec<&str> = Vec::new();
    for (uuid, _) in available.iter().filter_map(|id| parse_device_id(id)) {
        if !chosen.contains(&uuid) && !free.contains(&uuid) {
            free.push(uuid);
        }
    }
    let domain = |uuid: &str, level: fn(&InventoryGpu) -> Option<u32>| {
        gpus.iter().find(|gpu| gpu.uuid == uuid).and_then(level)
    };
    for level in DOMAINS {
        let wanted = match chosen.split_first() {
            // Where the chosen GPUs are, if they are all in one domain.
            Some((first, rest)) => match domain(first, level) {
                Some(d) if rest.iter().all(|uuid| domain(uuid, level) == Some(d)) => Some(d),
                _ => continue,
            },
            // The first domain to reach `need` GPUs.
            None => free.iter().enumerate().find_map(|(k, uuid)| {
                let d = domain(uuid, level)?;
                let before = free[..k]
                    .iter()
                    .filter(|other| domain(other, level) == Some(d))
                    .count();
                (before + 1 >= need).then_some(d)
            }),
        };
        let Some(wanted) = wanted else { continue };
        let members: Vec<&str> = free
            .iter()
            .copied()
            .filter(|uuid| domain(uuid, level) == Some(wanted))
            .take(need)
            .collect();
        if members.len() == need {
            return members;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: &str, healthy: bool, numa: Option<u32>) -> InventoryGpu {
        InventoryGpu {
            offered_memory_bytes: None,
            utilization_percent: None,
            uuid: uuid.into(),
            index: 0,
            model: "m".into(),
            memory_bytes: 1 << 30,
            sm_count: 1,
            split_count: 3,
            numa,
            nvlink_island: None,
            healthy,
        }
    }

    #[test]
    fn ids_round_trip_and_fit_kubelets_limit() {
        let uuid = "GPU-fef8089b-4820-abfc-e83e-94318197576e";
        let id = device_id(uuid, 9);
        assert_eq!(parse_device_id(&id), Some((uuid, 9)));
        assert!(device_id(uuid, 999).len() <= MAX_ID_LEN);
        assert_eq!(parse_device_id("GPU-a"), None);
        assert_eq!(parse_device_id("::1"), None);
        assert_eq!(parse_device_id("GPU-a::x"), None);
    }

    #[test]
    fn every_replica_carries_its_gpus_health_and_numa_node() {
        let devices = kubelet_devices(&[gpu("GPU-a", true, Some(1)), gpu("GPU-b", false, None)]);
        assert_eq!(devices.len(), 6);
        assert_eq!(devices[0].id, "GPU-a::0");
        assert_eq!(devices[0].health, HEALTHY);
        assert_eq!(devices[2].topology.as_ref().map(|t| t.nodes[0].id), Some(1));
        assert_eq!(devices[3].id, "GPU-b::0");
        assert_eq!(devices[5].health, UNHEALTHY);
        assert!(devices[5].topology.is_none());
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn preference_follows_the_decision_then_spreads() {
        let available = ids(&["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-c::2", "GPU-c::3"]);
        assert_eq!(
            preferred(&available, &[], 2, &ids(&["GPU-c", "GPU-b"]), &[]),
            ids(&["GPU-c::2", "GPU-b::0"])
        );
        assert_eq!(
            preferred(&available, &ids(&["GPU-a::1"]), 2, &ids(&["GPU-c"]), &[]),
            ids(&["GPU-a::1", "GPU-c::2"])
        );
        // No decision: one per GPU first.
        assert_eq!(
            preferred(&available, &[], 3, &[], &[]),
            ids(&["GPU-a::0", "GPU-b::0", "GPU-c::2"])
        );
        // More than the GPUs: replicas of the same GPU fill up.
        assert_eq!(preferred(&available, &[], 5, &[], &[]).len(), 5);
        assert_eq!(preferred(&available, &[], 9, &[], &[]).len(), 5);
        // A decided GPU with no free replica is skipped.
        assert_eq!(
            preferred(&available, &[], 1, &ids(&["GPU-z", "GPU-b"]), &[]),
            ids(&["GPU-b::0"])
        );
    }

    /// GPUs a..d: NVLink islands {a,c} and {b,d}; NUMA nodes {a,b}, {c,d}.
    fn islands() -> Vec<InventoryGpu> {
        ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
            .iter()
            .enumerate()
            .map(|(i, uuid)| InventoryGpu {
                nvlink_island: Some(i as u32 % 2),
                ..gpu(uuid, true, Some(i as u32 / 2))
            })
            .collect()
    }

    #[test]
    fn without_a_decision_one_nvlink_island_then_one_numa_node() {
        let gpus = islands();
        let available = ids(&["GPU-a::0", "GPU-b::0", "GPU-c::0", "GPU-d::0"]);
        // Plain spreading would take a and b.
        assert_eq!(
            preferred(&available, &[], 2, &[], &[]),
            ids(&["GPU-a::0", "GPU-b::0"])
        );
        assert_eq!(
            preferred(&available, &[], 2, &[], &gpus),
            ids(&["GPU-a::0", "GPU-c::0"])
        );
        // A replica kubelet must include anchors the island.
        assert_eq!(
            preferred(&available, &ids(&["GPU-d::0"]), 2, &[], &gpus),
            ids(&["GPU-d::0", "GPU-b::0"])
        );
        // Island {a,c} has no free c: island {b,d} is whole.
        let no_c = ids(&["GPU-a::0", "GPU-b::0", "GPU-d::0"]);
        assert_eq!(
            preferred(&no_c, &[], 2, &[], &gpus),
            ids(&["GPU-b::0", "GPU-d::0"])
        );
        // No island has two free GPUs: NUMA node {c,d}.
        let no_a_b = ids(&["GPU-c::0", "GPU-b::0", "GPU-d::0"]);
        let mut no_islands = gpus.clone();
        no_islands[3].nvlink_island = None;
        assert_eq!(
            preferred(&no_a_b, &[], 2, &[], &no_islands),
            ids(&["GPU-c::0", "GPU-d::0"])
        );
        // Three GPUs: no island or node has three; one per GPU as before.
        assert_eq!(
            preferred(&available, &[], 3, &[], &gpus),
            ids(&["GPU-a::0", "GPU-b::0", "GPU-c::0"])
        );
        // One GPU: nothing to keep together.
        assert_eq!(
            preferred(&available, &[], 1, &[], &gpus),
            ids(&["GPU-a::0"])
        );
    }

    #[test]
    fn the_decision_comes_before_topology() {
        let gpus = islands();
        let available = ids(&["GPU-a::0", "GPU-b::0", "GPU-c::0", "GPU-d::0"]);
        assert_eq!(
            preferred(&available, &[], 2, &ids(&["GPU-a", "GPU-b"]), &gpus),
            ids(&["GPU-a::0", "GPU-b::0"])
        );
    }
}
