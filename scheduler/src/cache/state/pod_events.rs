//! Pods from the watch, and from the extender's own writes.

use super::{recompute_node, ClusterState, PodRelist, LOCAL_RECORD_TRUST};
use crate::cache::book::Book;
use crate::cache::clock::now_unix_ms;
use crate::cache::nodes::NodeEntry;
use crate::cache::pods::{not_newer, version_of, PodRecord};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;
use std::time::Instant;
use vgpu_cluster::decision::FormatError;

impl Book<Pod> for ClusterState {
    const KIND: &'static str = "pod";

    fn apply_event(&mut self, event: Event<Pod>) {
        match event {
            Event::Init => self.begin_pod_relist(),
            Event::InitApply(pod) => self.relist_pod(&pod),
            Event::InitDone => self.finish_pod_relist(),
            Event::Apply(pod) => self.apply_pod(&pod, false),
            Event::Delete(pod) => self.delete_pod(&pod),
        }
    }
}

impl ClusterState {
    fn saw_pod(&mut self, pod: &Pod) {
        if let Some(version) = version_of(pod) {
            self.seen_pod_version = self.seen_pod_version.max(version);
        }
    }

    /// Starts a complete list of pods.
    fn begin_pod_relist(&mut self) {
        self.pod_relist = Some(PodRelist::default());
        self.groups.begin_relist();
    }

    /// One pod of a complete list.
    fn relist_pod(&mut self, pod: &Pod) {
        self.saw_pod(pod);
        self.groups.apply(pod);
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => {
                self.pod_relist.get_or_insert_with(PodRelist::default);
                return;
            }
        };
        let record = self.record_of(&uid, pod);
        let relist = self.pod_relist.get_or_insert_with(PodRelist::default);
        relist.seen.insert(uid.clone(), version_of(pod));
        if let Some(record) = record {
            relist.records.insert(uid, record);
        }
    }

    /// The record of `pod` (UID `uid`), if it has a readable decision,
    /// aged by the unbound grace.
    fn record_of(&mut self, uid: &str, pod: &Pod) -> Option<PodRecord> {
        let mut record = match PodRecord::from_pod(pod) {
            Ok(record) => record?,
            Err(error) => {
                warn_unreadable(pod, &error);
                return None;
            }
        };
        self.age_unbound(uid, &mut record, now_unix_ms());
        Some(record)
    }

    /// Ends a complete list of pods: the list replaces what was known,
    /// except the extender's own recent writes that the list predates.
    fn finish_pod_relist(&mut self) {
        let relist = self.pod_relist.take().unwrap_or_default();
        self.groups.finish_relist();
        let mut pods = relist.records;
        for (uid, old) in self.pods.drain() {
            let trusted = old
                .local_since
                .is_some_and(|since| since.elapsed() < LOCAL_RECORD_TRUST);
            if !trusted {
                continue;
            }
            // A decision being bound stands for the version after the
            // one it was read at.
            let keep = match relist.seen.get(&uid) {
                None => true,
                Some(listed) => {
                    !not_newer(old.resource_version, *listed)
                        || (old.being_bound && old.resource_version == *listed)
                }
            };
            if keep {
                pods.insert(uid, old);
            }
        }
        self.pods = pods;
        self.rebuild_all();
        if !self.pods_synced {
            tracing::info!(
                "Kubernetes API: {} pod(s) with vGPU decisions listed",
                self.pods.len()
            );
        }
        self.pods_synced = true;
        self.prune();
    }

    /// Applies a pod from the watch (`local: false`) or from the answer to
    /// the extender's own write (`local: true`).
    fn apply_pod(&mut self, pod: &Pod, local: bool) {
        if !local {
            self.saw_pod(pod);
        }
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => return,
        };
        let version = version_of(pod);
        if let Some((floor, _)) = self.floors.get(&uid) {
            if not_newer(version, *floor) {
                return;
            }
        }
        if let Some(existing) = self.pods.get_mut(&uid) {
            match (version, existing.resource_version) {
                (Some(new), Some(old)) if new < old => return,
                (Some(new), Some(old)) if new == old => {
                    // The watch confirms an own write; the version a
                    // decision being bound was read at confirms nothing.
                    if !local && !existing.being_bound {
                        existing.local_since = None;
                    }
                    return;
                }
                _ => {}
            }
        }
        self.groups.apply(pod);
        let record = self.record_of(&uid, pod);
        let old_node = self
            .pods
            .get(&uid)
            .and_then(|r| r.counted_node().map(str::to_string));
        let new_node = record
            .as_ref()
            .and_then(|r| r.counted_node().map(str::to_string));
        match record {
            Some(mut record) => {
                if local {
                    record.local_since = Some(Instant::now());
                }
                self.pods.insert(uid.clone(), record);
                self.floors.remove(&uid);
            }
            None => {
                if self.pods.remove(&uid).is_some() {
                    self.floors.insert(uid.clone(), (version, Instant::now()));
                }
            }
        }
        self.move_pod(&uid, old_node, new_node);
        self.updates += 1;
        if self.updates.is_multiple_of(1024) {
            self.prune();
        }
    }

    /// A pod was deleted.
    fn delete_pod(&mut self, pod: &Pod) {
        self.saw_pod(pod);
        self.groups.delete(pod);
        let uid = match &pod.metadata.uid {
            Some(uid) => uid.clone(),
            None => return,
        };
        self.floors
            .insert(uid.clone(), (version_of(pod), Instant::now()));
        if let Some(record) = self.pods.remove(&uid) {
            self.forget_unbound_deadline(&uid, &record);
            let old_node = record.counted_node().map(str::to_string);
            self.move_pod(&uid, old_node, None);
        }
        self.updates += 1;
    }

    /// Applies a pod the extender's own API write answered with: counted at
    /// once, and trusted until the watch shows that version (or a newer).
    pub fn apply_written_pod(&mut self, pod: &Pod) {
        self.apply_pod(pod, true);
    }

    /// Counts the decision `pod` carries while the binding that writes it
    /// runs: `pod` is the pod as read, with the decision annotation and
    /// `spec.nodeName` set as the binding will set them. The record stands
    /// for the pod's next version: the watch or a list showing the version
    /// read keeps it, a newer one replaces it (the binding's own, or a
    /// change that makes the binding fail on its precondition). Not
    /// counted when the watch has already shown a newer version: the
    /// binding will fail.
    pub fn count_binding(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let version = version_of(pod);
        let newer_known =
            |known: Option<u64>| matches!((version, known), (Some(v), Some(k)) if v < k);
        if self
            .floors
            .get(&uid)
            .is_some_and(|(floor, _)| newer_known(*floor))
            || self
                .pods
                .get(&uid)
                .is_some_and(|r| newer_known(r.resource_version))
        {
            return;
        }
        let Some(mut record) = self.record_of(&uid, pod) else {
            return;
        };
        record.local_since = Some(Instant::now());
        record.being_bound = true;
        let old_node = self
            .pods
            .get(&uid)
            .and_then(|r| r.counted_node().map(str::to_string));
        let new_node = record.counted_node().map(str::to_string);
        self.pods.insert(uid.clone(), record);
        self.floors.remove(&uid);
        self.move_pod(&uid, old_node, new_node);
        self.updates += 1;
    }

    /// The binding [`ClusterState::count_binding`] counted for pod `uid`,
    /// read at `version`, did not happen: its decision is no longer
    /// counted (unless the watch has replaced the record meanwhile).
    pub fn forget_binding(&mut self, uid: &str, version: Option<u64>) {
        let counted = self
            .pods
            .get(uid)
            .is_some_and(|r| r.being_bound && r.resource_version == version);
        if !counted {
            return;
        }
        if let Some(record) = self.pods.remove(uid) {
            let old_node = record.counted_node().map(str::to_string);
            self.move_pod(uid, old_node, None);
            self.updates += 1;
        }
    }

    fn rebuild_all(&mut self) {
        for entry in self.nodes.values_mut() {
            entry.pods.clear();
        }
        let mut placed: Vec<(String, String)> = Vec::new();
        for (uid, record) in &self.pods {
            if let Some(node) = record.counted_node() {
                placed.push((node.to_string(), uid.clone()));
            }
        }
        for (node, uid) in placed {
            self.nodes
                .entry(node)
                .or_insert_with(NodeEntry::new)
                .pods
                .push(uid);
        }
        self.nodes
            .retain(|_, e| e.in_api || !e.pods.is_empty() || !e.reservations.is_empty());
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, &name);
        }
        self.updates += 1;
    }
}

fn warn_unreadable(pod: &Pod, error: &FormatError) {
    tracing::warn!(
        error = error as &dyn std::error::Error,
        "pod {}/{}: unreadable annotation; its GPUs are not counted",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    );
}
