//! Coscheduling groups (KubeShare's `sharedgpu/group_name`,
//! `group_headcount`, `group_threshold`): the pods of each group the watch
//! has shown, and the room held for a group's first pods while they are
//! being placed.
//!
//! kube-scheduler asks the extender about one pod at a time. So the filter
//! keeps every pod of a group off all nodes until the group's *quorum*
//! (`ceil(headcount x threshold)`) can be placed at once. When it can, the
//! extender plans a place for each pod of the quorum and *holds* that room
//! ([`Hold`]): the held GPUs count as taken for every other pod until the
//! member is placed or the hold expires. Once a quorum is placed, the
//! group's other pods are placed as they come. A group that cannot reach
//! its quorum holds nothing.

use crate::cache::gpus::Usage;
use crate::vocabulary::kubeshare::{group_of, GroupLabels};
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, HashMap, HashSet};

/// How long room stays held for a group's pod that has not been placed:
/// long enough for kube-scheduler to retry it (its backoff is at most 10 s
/// by default), short enough that a group whose pods vanish frees it soon.
pub const HOLD_TTL_MS: u64 = 30_000;

/// A group's pod as the watch last showed it.
#[derive(Clone, Debug)]
pub struct Member {
    pub name: String,
    pub labels: GroupLabels,
    /// The pod itself, for planning its place while the quorum is sought.
    pub pod: Pod,
    /// Succeeded, failed or being deleted.
    pub finished: bool,
}

/// Room held on a node for one pod of a group.
#[derive(Clone, Debug)]
pub struct Hold {
    pub group: String,
    pub uid: String,
    pub node: String,
    /// What it takes per GPU UUID.
    pub contribution: Vec<(String, Usage)>,
    pub expires_unix_ms: u64,
}

/// Every group's pods, by `namespace/name` of the group, then pod UID; and
/// the holds.
#[derive(Debug, Default)]
pub struct GroupBook {
    groups: HashMap<String, BTreeMap<String, Member>>,
    holds: Vec<Hold>,
    relist: Option<HashSet<String>>,
}

impl GroupBook {
    /// Records `pod` (from the watch, a list, or the extender's own write).
    pub fn apply(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        // A pod whose labels no longer name a group (readably) leaves it.
        let Ok(Some((key, labels))) = group_of(pod) else {
            self.remove(&uid);
            return;
        };
        if let Some(seen) = &mut self.relist {
            seen.insert(uid.clone());
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let finished = matches!(phase, Some("Succeeded") | Some("Failed"))
            || pod.metadata.deletion_timestamp.is_some();
        let member = Member {
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels,
            pod: pod.clone(),
            finished,
        };
        self.groups.entry(key).or_default().insert(uid, member);
    }

    /// Forgets a deleted pod.
    pub fn delete(&mut self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            self.remove(uid);
        }
    }

    fn remove(&mut self, uid: &str) {
        // Every pod event of the cluster comes here; most clusters have no
        // groups.
        if self.groups.is_empty() && self.holds.is_empty() {
            return;
        }
        self.groups.retain(|_, members| {
            members.remove(uid);
            !members.is_empty()
        });
        self.holds.retain(|hold| hold.uid != uid);
    }

    /// Starts a complete list of pods.
    pub fn begin_relist(&mut self) {
        self.relist = Some(HashSet::new());
    }

    /// Ends it: pods the list did not show are gone.
    pub fn finish_relist(&mut self) {
        let Some(seen) = self.relist.take() else {
            return;
        };
        self.groups.retain(|_, members| {
            members.retain(|uid, _| seen.contains(uid));
            !members.is_empty()
        });
        self.holds.retain(|hold| seen.contains(&hold.uid));
    }

    /// The pods of group `key`, by UID.
    pub fn members(&self, key: &str) -> Option<&BTreeMap<String, Member>> {
        self.groups.get(key)
    }

    /// The unexpired holds of group `key`.
    pub fn holds_of<'a>(
        &'a self,
        key: &'a str,
        now_unix_ms: u64,
    ) -> impl Iterator<Item = &'a Hold> {
        self.holds
            .iter()
            .filter(move |hold| hold.group == key && hold.expires_unix_ms > now_unix_ms)
    }

    /// The unexpired holds on `node`.
    pub fn holds_on<'a>(
        &'a self,
        node: &'a str,
        now_unix_ms: u64,
    ) -> impl Iterator<Item = &'a Hold> {
        self.holds
            .iter()
            .filter(move |hold| hold.node == node && hold.expires_unix_ms > now_unix_ms)
    }

    /// Whether any hold is in force (so placements must add them).
    pub fn any_holds(&self) -> bool {
        !self.holds.is_empty()
    }

    /// Holds room for `hold`'s pod (instead of any earlier hold of it),
    /// dropping the expired holds.
    pub fn hold(&mut self, hold: Hold, now_unix_ms: u64) {
        self.holds
            .retain(|h| h.uid != hold.uid && h.expires_unix_ms > now_unix_ms);
        self.holds.push(hold);
    }

    /// Drops group `key`'s holds, and every expired one.
    pub fn release(&mut self, key: &str, now_unix_ms: u64) {
        self.holds
            .retain(|hold| hold.group != key && hold.expires_unix_ms > now_unix_ms);
    }
}
