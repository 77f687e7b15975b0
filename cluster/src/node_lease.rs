//! Node health: a `coordination.k8s.io/v1` Lease per node that the device
//! plugin renews and the scheduler extender watches.
//!
//! The plugin holds one Lease per node in [`NODE_LEASE_NAMESPACE`] (the
//! namespace where kubelet keeps its own node Leases), named
//! [`lease_name`], labelled [`NODE_LEASE_LABEL`]`=`[`NODE_LEASE_LABEL_VALUE`]
//! and with `spec.holderIdentity` the node's name: the holder is what the
//! extender reads, so the name only has to be unique. It renews it every
//! quarter of `leaseDurationSeconds` (as kubelet does its own), so three
//! renewals may fail before the Lease runs out.
//!
//! The extender places nothing new on a node whose Lease has not been
//! renewed for its duration plus a grace. It times the Lease by its own
//! clock, from when it saw `renewTime` change, not by comparing
//! `renewTime` with its clock: the two machines' clocks need not agree.

/// Where the plugins' node Leases live.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// Label marking a Lease as a vgpu device plugin's (kubelet's own Leases
/// share the namespace).
pub const NODE_LEASE_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`NODE_LEASE_LABEL`] on the plugins' Leases.
pub const NODE_LEASE_LABEL_VALUE: &str = "vgpu-device-plugin";
/// `leaseDurationSeconds` unless the plugin is told otherwise.
pub const DEFAULT_LEASE_DURATION_SECONDS: u32 = 40;

/// The label selector that picks the plugins' Leases.
pub fn lease_selector() -> String {
    format!("{NODE_LEASE_LABEL}={NODE_LEASE_LABEL_VALUE}")
}

/// Longest object name the API server takes (a DNS subdomain).
const MAX_NAME: usize = 253;
const PREFIX: &str = "vgpu-";

/// The name of `node`'s Lease: `vgpu-<node>`, or, for a node name too long
/// for that, `vgpu-` and a hash of it (the extender goes by the holder).
pub fn lease_name(node: &str) -> String {
    if PREFIX.len() + node.len() <= MAX_NAME {
        return format!("{PREFIX}{node}");
    }
    // FNV-1a: stable across builds and machines, unlike std's hasher.
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{PREFIX}{hash:016x}")
}

/// How often a Lease of `duration_seconds` is renewed.
pub fn renew_interval(duration_seconds: u32) -> std::time::Duration {
    std::time::Duration::from_millis(u64::from(duration_seconds) * 250)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_api_and_differ_per_node() {
        assert_eq!(lease_name("gpu-node-1"), "vgpu-gpu-node-1");
        let long_a = "a".repeat(250);
        let long_b = format!("{}b", "a".repeat(249));
        let (a, b) = (lease_name(&long_a), lease_name(&long_b));
        assert!(a.len() <= MAX_NAME && b.len() <= MAX_NAME);
        assert_ne!(a, b);
        assert_eq!(
            a,
            lease_name(&long_a),
            "the same node always gets the same name"
        );
        assert_eq!(lease_name(&"c".repeat(248)).len(), MAX_NAME);
    }

    #[test]
    fn renewal_is_a_quarter_of_the_duration() {
        assert_eq!(renew_interval(40), std::time::Duration::from_secs(10));
        assert_eq!(renew_interval(2), std::time::Duration::from_millis(500));
    }
}
