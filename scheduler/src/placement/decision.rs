//! A placement written down: the decision the device plugin reads.

use crate::placement::fit::packing::Scratch;
use crate::placement::snapshot::Snapshot;
use vgpu_cluster::decision::{ContainerDecision, Decision, DeviceGrant, FORMAT_VERSION};
use vgpu_cluster::requests::PodRequest;
use vgpu_node_contract::region::limits::granted::device_order;

impl Snapshot<'_> {
    /// The decision the grants of the last placement in `scratch` (of
    /// `request` on `node`) come to; `None` when the node is gone.
    pub fn decision(
        &self,
        node: &str,
        request: &PodRequest,
        scratch: &Scratch,
    ) -> Option<Decision> {
        let gpus = &self.state.node(node)?.gpus;
        let containers = request
            .containers
            .iter()
            .enumerate()
            .map(|(index, container)| {
                let mut grants: Vec<_> = scratch
                    .grants
                    .iter()
                    .filter(|g| g.container == index)
                    .collect();
                device_order(&mut grants, |g| gpus.gpus.get(g.gpu).map(|info| info.index));
                ContainerDecision {
                    name: container.name.clone(),
                    init: container.kind.is_init(),
                    devices: grants
                        .into_iter()
                        .filter_map(|g| {
                            gpus.gpus.get(g.gpu).map(|info| DeviceGrant {
                                uuid: info.uuid.clone(),
                                memory_bytes: g.memory_bytes,
                                cores_percent: g.cores.min(100),
                                burst_percent: burst_above(g.cores, request.burst_percent),
                            })
                        })
                        .collect(),
                    priority: self.rules.granted_priority(request, container.priority),
                }
            })
            .collect();
        Some(Decision {
            version: FORMAT_VERSION,
            node: node.to_string(),
            decided_unix_ms: self.now_unix_ms,
            containers,
        })
    }
}

/// The burst share a vGPU of `cores` percent gets from the pod's burst
/// annotation: only a capped share (1-99 %) below the burst can burst.
fn burst_above(cores: u32, burst: Option<u32>) -> Option<u32> {
    burst.filter(|&burst| cores > 0 && cores < 100 && burst > cores)
}

#[cfg(test)]
mod tests {
    use super::burst_above;

    #[test]
    fn only_capped_shares_below_the_burst_burst() {
        assert_eq!(burst_above(30, Some(80)), Some(80));
        assert_eq!(burst_above(30, Some(100)), Some(100));
        assert_eq!(burst_above(30, Some(30)), None, "no higher than the share");
        assert_eq!(burst_above(50, Some(20)), None, "below the share");
        assert_eq!(burst_above(0, Some(80)), None, "uncapped");
        assert_eq!(burst_above(100, Some(100)), None, "exclusive");
        assert_eq!(burst_above(30, None), None);
    }
}
