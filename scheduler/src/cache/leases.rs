//! Which nodes' device plugins are alive: the node Leases they renew
//! ([`vgpu_cluster::node_lease`]), as the extender's watch sees them.
//!
//! A Lease is timed by the extender's own clock: from when it saw
//! `renewTime` change (or first saw the Lease), never by comparing
//! `renewTime` with the extender's clock, which may disagree with the
//! plugin's machine. An extender that starts, or relists, treats every
//! Lease it has not seen before as renewed then, so after a restart a node
//! whose plugin died is turned down one Lease duration (plus grace) later,
//! not at once.

use crate::cache::fast_map::FastMap;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use std::time::Duration;

/// What the extender knows of one node's Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SeenLease {
    /// The Lease object's name (for deletions and relists).
    name: String,
    renew_time: Option<MicroTime>,
    duration_ms: u64,
    /// When (this extender's clock, ms since the Unix epoch) the renewal
    /// was seen.
    seen_unix_ms: u64,
}

/// Whether a node's plugin may be given new pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// Renewed within its duration plus the grace.
    Live { silent_ms: u64 },
    /// Not renewed for longer.
    Expired { silent_ms: u64, duration_ms: u64 },
    /// No Lease names this node as its holder.
    Missing,
}

/// The plugins' Leases, by the node that holds them.
#[derive(Debug, Default)]
pub struct LeaseBook {
    by_node: FastMap<String, SeenLease>,
    relist: Option<Vec<String>>,
    synced: bool,
}

/// The node a Lease is for, its name, renewal and duration; `None` for a
/// Lease that names no holder or duration (not one a plugin wrote).
fn read(lease: &Lease) -> Option<(String, String, Option<MicroTime>, u64)> {
    let name = lease.metadata.name.clone()?;
    let spec = lease.spec.as_ref()?;
    let node = spec.holder_identity.clone().filter(|n| !n.is_empty())?;
    let seconds = u64::try_from(spec.lease_duration_seconds?).ok()?;
    Some((node, name, spec.renew_time.clone(), seconds * 1000))
}

impl LeaseBook {
    /// Whether the Leases have been listed completely once.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Starts a complete list.
    pub fn begin_relist(&mut self) {
        self.relist = Some(Vec::new());
    }

    /// Applies a Lease (from a list or the watch) seen at `now_unix_ms`.
    pub fn apply(&mut self, lease: &Lease, now_unix_ms: u64) {
        let Some((node, name, renew_time, duration_ms)) = read(lease) else {
            tracing::warn!(
                "node Lease {}: no holder or duration; ignored",
                lease.metadata.name.as_deref().unwrap_or("(unnamed)")
            );
            return;
        };
        if let Some(seen) = &mut self.relist {
            seen.push(node.clone());
        }
        let seen_unix_ms = match self.by_node.get(&node) {
            Some(known) if known.renew_time == renew_time => known.seen_unix_ms,
            _ => now_unix_ms,
        };
        self.by_node.insert(
            node,
            SeenLease {
                name,
                renew_time,
                duration_ms,
                seen_unix_ms,
            },
        );
    }

    /// A Lease was deleted.
    pub fn delete(&mut self, lease: &Lease) {
        if let Some(name) = &lease.metadata.name {
            self.by_node.retain(|_, seen| &seen.name != name);
        }
    }

    /// Ends a complete list: Leases it did not contain are gone.
    pub fn finish_relist(&mut self) {
        if let Some(listed) = self.relist.take() {
            let listed: std::collections::HashSet<String> = listed.into_iter().collect();
            self.by_node.retain(|node, _| listed.contains(node));
        }
        if !self.synced {
            tracing::info!(
                "Kubernetes API: {} device plugin Lease(s) listed",
                self.by_node.len()
            );
        }
        self.synced = true;
    }

    /// Whether `node`'s plugin counts as alive at `now_unix_ms`, allowing
    /// `grace` beyond the Lease's duration.
    pub fn liveness(&self, node: &str, now_unix_ms: u64, grace: Duration) -> Liveness {
        let Some(seen) = self.by_node.get(node) else {
            return Liveness::Missing;
        };
        let silent_ms = now_unix_ms.saturating_sub(seen.seen_unix_ms);
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        if silent_ms > seen.duration_ms.saturating_add(grace_ms) {
            Liveness::Expired {
                silent_ms,
                duration_ms: seen.duration_ms,
            }
        } else {
            Liveness::Live { silent_ms }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::fixtures::lease;

    const GRACE: Duration = Duration::from_secs(5);

    #[test]
    fn a_lease_expires_by_the_extenders_clock_after_its_duration_and_grace() {
        let mut book = LeaseBook::default();
        book.apply(&lease("a", 40, 0), 1_000_000);
        assert_eq!(
            book.liveness("a", 1_045_000, GRACE),
            Liveness::Live { silent_ms: 45_000 }
        );
        assert_eq!(
            book.liveness("a", 1_045_001, GRACE),
            Liveness::Expired {
                silent_ms: 45_001,
                duration_ms: 40_000
            }
        );
        // The same renewal seen again (a relist) is not a renewal.
        book.apply(&lease("a", 40, 0), 1_050_000);
        assert!(matches!(
            book.liveness("a", 1_050_000, GRACE),
            Liveness::Expired { .. }
        ));
        // A new renewTime is, whatever it says the time is.
        book.apply(&lease("a", 40, 1), 1_060_000);
        assert_eq!(
            book.liveness("a", 1_060_000, GRACE),
            Liveness::Live { silent_ms: 0 }
        );
        assert_eq!(book.liveness("b", 1_060_000, GRACE), Liveness::Missing);
    }

    #[test]
    fn deleted_and_unlisted_leases_are_forgotten_and_odd_ones_ignored() {
        let mut book = LeaseBook::default();
        assert!(!book.synced());
        book.begin_relist();
        book.apply(&lease("a", 40, 0), 0);
        book.apply(&lease("b", 40, 0), 0);
        book.finish_relist();
        assert!(book.synced());
        book.delete(&lease("a", 40, 0));
        assert_eq!(book.liveness("a", 0, GRACE), Liveness::Missing);
        book.begin_relist();
        book.finish_relist();
        assert_eq!(book.liveness("b", 0, GRACE), Liveness::Missing);

        let mut no_holder = lease("c", 40, 0);
        if let Some(spec) = no_holder.spec.as_mut() {
            spec.holder_identity = None;
        }
        book.apply(&no_holder, 0);
        let mut no_duration = lease("c", 40, 0);
        if let Some(spec) = no_duration.spec.as_mut() {
            spec.lease_duration_seconds = None;
        }
        book.apply(&no_duration, 0);
        assert_eq!(book.liveness("c", 0, GRACE), Liveness::Missing);
    }
}
