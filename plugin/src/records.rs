//! Allocation records: which containers this plugin has served, kept on the
//! node first and published to the pods' [`ALLOCATED_ANNOTATION`] after
//! kubelet has its answer.
//!
//! Kubelet admits one pod at a time, and `Allocate` is part of the
//! admission, so anything `Allocate` waits for is waited for by every pod
//! behind it on the node. The record that matters for the protocol is on
//! the node already: `Allocate` prepares each served container's region on
//! the host (`<containers dir>/<pod UID>_<container>/<region file>`) before
//! it answers, and that region outlives the plugin process. So a plugin
//! that restarts reads its records back from the regions ([`Records::load`])
//! and counts those containers as allocated, whether or not the annotation
//! was written before it stopped: no container is served twice, and no
//! later container is matched to an earlier one's grant. The annotation,
//! which the extender reads, follows from a background task
//! ([`Records::publish`]) that retries until the API server takes it, the
//! pod is gone, or kubelet's status shows the pod admitted: kubelet writes
//! that only after every `Allocate` of the pod, and it ends the pod's
//! wait as the annotation would, so from then on the region alone is the
//! record (the start-up check against kubelet reads both). Where the
//! plugin tells pending pods apart by kubelet's PodResources API, the
//! extender waits for no record, and none is written ([`Keeping::NodeOnly`]).
//!
//! While a record is unpublished, every pod the plugin reads (from its
//! watch or afresh) has it merged in ([`Unpublished::merge`]); records are
//! taken as a snapshot before the pods are read, and dropped only after
//! the published pod is in the pod cache, so a read never misses one.

use crate::cluster::{Cluster, ClusterError};
use crate::pod_cache::PodCache;
use crate::protocol::admitted_by_kubelet;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Notify};
use vgpu_cluster::decision::{parse_allocated, ALLOCATED_ANNOTATION};
use vgpu_cluster::report::with_causes;

/// A pod by namespace and name, as the API addresses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for PodName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Containers of one pod served but not yet in its annotation.
#[derive(Clone, Debug, Default)]
struct Entry {
    /// `None` for records read back from the regions, until the pod is
    /// found among the node's pods.
    pod: Option<PodName>,
    containers: Vec<String>,
}

/// Where a served container's record is kept besides its region on the
/// node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Keeping {
    /// Also in the pod's [`ALLOCATED_ANNOTATION`], until kubelet's status
    /// shows the pod admitted: the extender binds no other vGPU pod to
    /// the node while one is pending, and the annotation ends the wait.
    #[default]
    PodAnnotation,
    /// Only on the node, where this plugin tells pending pods apart by
    /// kubelet's PodResources API (the node's inventory says
    /// `severalPending`): the extender binds to the node without waiting,
    /// so nobody waits for the annotation, and each one spared is a pod
    /// write every pod watcher of the cluster receives. The plugin holds
    /// the record in memory (merged into every pod it reads) until the
    /// pod's status shows it admitted or the pod is gone.
    NodeOnly,
}

/// The records not yet published, by pod UID.
#[derive(Default)]
pub struct Records {
    unpublished: Mutex<HashMap<String, Entry>>,
    wake: Notify,
    keeping: Keeping,
}

/// A copy of the unpublished records, by pod UID.
#[derive(Clone, Debug, Default)]
pub struct Unpublished(HashMap<String, Vec<String>>);

/// How long the publisher waits before asking again after the API server
/// did not take a record; doubled up to [`MAX_RETRY_DELAY`].
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(100);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

fn allocated_of(pod: &Pod) -> Option<Vec<String>> {
    match pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ALLOCATED_ANNOTATION))
    {
        None => Some(Vec::new()),
        Some(text) => parse_allocated(text).ok(),
    }
}

/// `recorded` followed by those of `served` it lacks, in their order.
fn union(recorded: &[String], served: &[String]) -> Vec<String> {
    let mut all = recorded.to_vec();
    all.extend(served.iter().filter(|c| !recorded.contains(c)).cloned());
    all
}

/// Splits a region directory's name, `<pod UID>_<container>`, where
/// neither part holds an underscore.
fn container_of_dir(name: &str) -> Option<(&str, &str)> {
    let (uid, container) = name.split_once('_')?;
    (!uid.is_empty() && !container.is_empty() && !container.contains('_'))
        .then_some((uid, container))
}

/// The containers whose regions are under `containers_dir`, as (pod UID,
/// container): the ones this node's plugin served. A directory that cannot
/// be read holds none.
pub fn served_on_node(containers_dir: &Path, region_file: &str) -> BTreeSet<(String, String)> {
    let entries = match std::fs::read_dir(containers_dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return BTreeSet::new(),
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "reading the served containers' regions in {}; none taken as served",
                containers_dir.display()
            );
            return BTreeSet::new();
        }
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let (uid, container) = name.to_str().and_then(container_of_dir)?;
            // Without its region file, stopped while making it: that
            // container was never answered.
            entry
                .path()
                .join(region_file)
                .is_file()
                .then(|| (uid.to_string(), container.to_string()))
        })
        .collect()
}

impl Unpublished {
    /// `pods` with each unpublished record added to its pod's annotation.
    /// A pod whose annotation cannot be read is left as it is: the protocol
    /// refuses it with the reason.
    /// Only the pods given a record are copied.
    pub fn merge(&self, mut pods: Vec<Arc<Pod>>) -> Vec<Arc<Pod>> {
        if self.0.is_empty() {
            return pods;
        }
        for pod in &mut pods {
            let Some(served) = pod.metadata.uid.as_ref().and_then(|uid| self.0.get(uid)) else {
                continue;
            };
            let Some(recorded) = allocated_of(pod) else {
                continue;
            };
            let all = union(&recorded, served);
            if all.len() != recorded.len() {
                let text = serde_json::to_string(&all).unwrap_or_default();
                Arc::make_mut(pod)
                    .metadata
                    .annotations
                    .get_or_insert_with(Default::default)
                    .insert(ALLOCATED_ANNOTATION.to_string(), text);
            }
        }
        pods
    }
}

impl Records {
    /// The records held by the regions under `containers_dir` (a
    /// directory per served container, holding `region_file`): those of
    /// pods whose annotation already has them, or whose status shows them
    /// admitted, are dropped on the first publishing pass; the others are
    /// kept as `keeping` says.
    pub fn load(containers_dir: &Path, region_file: &str, keeping: Keeping) -> Self {
        let records = Self {
            keeping,
            ..Self::default()
        };
        let served = served_on_node(containers_dir, region_file);
        {
            let mut unpublished = records.lock();
            for (uid, container) in &served {
                unpublished
                    .entry(uid.clone())
                    .or_default()
                    .containers
                    .push(container.clone());
            }
        }
        tracing::info!(
            "{} served container(s) read back from the regions in {}",
            served.len(),
            containers_dir.display()
        );
        records
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.unpublished
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Notes `containers` of the pod `uid` as served, to be published.
    pub fn served(&self, uid: &str, pod: PodName, containers: &[String]) {
        {
            let mut unpublished = self.lock();
            let held = unpublished.entry(uid.to_string()).or_default();
            held.pod = Some(pod);
            held.containers = union(&held.containers, containers);
        }
        self.wake.notify_one();
    }

    /// The unpublished records now; take it before reading the pods it is
    /// merged into.
    pub fn unpublished(&self) -> Unpublished {
        Unpublished(
            self.lock()
                .iter()
                .map(|(uid, entry)| (uid.clone(), entry.containers.clone()))
                .collect(),
        )
    }

    /// How many containers' records are unpublished.
    #[cfg(test)]
    fn unpublished_count(&self) -> usize {
        self.lock().values().map(|e| e.containers.len()).sum()
    }

    /// Drops `containers` of `uid`, published (or of a pod that is gone).
    fn forget(&self, uid: &str, containers: &[String]) {
        let mut unpublished = self.lock();
        if let Some(held) = unpublished.get_mut(uid) {
            held.containers.retain(|c| !containers.contains(c));
            if held.containers.is_empty() {
                unpublished.remove(uid);
            }
        }
    }

    /// Names the pods of records read back from the regions, from a list
    /// of the node's pods; drops those of pods not on the node any more.
    async fn find_pods(&self, cluster: &Cluster) -> Result<(), ClusterError> {
        if self.lock().values().all(|e| e.pod.is_some()) {
            return Ok(());
        }
        let pods = cluster.pods_on_node().await?;
        let mut unpublished = self.lock();
        unpublished.retain(|uid, entry| {
            if entry.pod.is_some() {
                return true;
            }
            let Some(found) = pods
                .iter()
                .find(|p| p.metadata.uid.as_deref() == Some(uid.as_str()))
            else {
                // Gone: the monitor removes its regions.
                return false;
            };
            // Most records read back were published before the restart.
            if allocated_of(found)
                .is_some_and(|recorded| entry.containers.iter().all(|c| recorded.contains(c)))
            {
                return false;
            }
            entry.pod = Some(PodName {
                namespace: found.metadata.namespace.clone().unwrap_or_default(),
                name: found.metadata.name.clone().unwrap_or_default(),
            });
            true
        });
        Ok(())
    }

    /// Publishes one pod's record; `Ok` when there is nothing left to do
    /// for it now (written, already there, kept on the node only, or the
    /// pod gone).
    async fn publish_one(
        &self,
        cluster: &Cluster,
        cache: &PodCache,
        uid: &str,
        pod: &PodName,
        served: &[String],
    ) -> Result<(), ClusterError> {
        let current = match cache.get(uid) {
            Some(pod) => Some(pod),
            None => cluster.pod(&pod.namespace, &pod.name).await?.map(Arc::new),
        };
        let Some(current) = current.filter(|p| p.metadata.uid.as_deref() == Some(uid)) else {
            tracing::debug!(%pod, "pod gone before its allocation record was published");
            self.forget(uid, served);
            return Ok(());
        };
        // The annotation tells those who wait for the pod's admission (the
        // extender, this plugin's next Allocate) that its containers were
        // served. Once kubelet's status shows the pod admitted (written
        // only after every Allocate of the pod), that tells them itself,
        // so the annotation is no longer written: in a burst most records
        // come after it, and each is a pod write every pod watcher of the
        // cluster receives. The region stays the plugin's own record.
        if admitted_by_kubelet(&current) {
            tracing::debug!(%pod, "kubelet's status shows the pod admitted: its allocation record stays on the node");
            self.forget(uid, served);
            return Ok(());
        }
        if self.keeping == Keeping::NodeOnly {
            // Held until the pod's status shows it admitted (a later pass,
            // woken by the watch) or the pod is gone.
            return Ok(());
        }
        // An annotation that cannot be read is replaced: this plugin is its
        // only writer, and what it served is what the record must say.
        let recorded = allocated_of(&current).unwrap_or_default();
        let all = union(&recorded, served);
        if all.len() == recorded.len() {
            self.forget(uid, served);
            return Ok(());
        }
        match cluster
            .record_allocated((&pod.namespace, &pod.name), uid, &all)
            .await
        {
            Ok(written) => {
                // In the cache before the record is dropped here: a read
                // of the pods never sees neither.
                cache.remember(written);
                self.forget(uid, served);
                tracing::debug!(%pod, containers = ?served, "allocation record published");
                Ok(())
            }
            Err(error) if error.is_gone() => {
                tracing::debug!(%pod, "pod gone before its allocation record was published");
                self.forget(uid, served);
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// One pass over the unpublished records; whether all were published.
    async fn publish_all(&self, cluster: &Cluster, cache: &PodCache) -> bool {
        let mut done = true;
        if let Err(error) = self.find_pods(cluster).await {
            tracing::warn!(
                "finding the pods of the containers served before this start: {}; asking again",
                with_causes(&error)
            );
            done = false;
        }
        let work: Vec<(String, PodName, Vec<String>)> = self
            .lock()
            .iter()
            .filter_map(|(uid, e)| Some((uid.clone(), e.pod.clone()?, e.containers.clone())))
            .collect();
        for (uid, pod, served) in work {
            if let Err(error) = self.publish_one(cluster, cache, &uid, &pod, &served).await {
                tracing::warn!(
                    %pod,
                    "publishing the allocation record of {served:?}: {}; asking again",
                    with_causes(&error)
                );
                done = false;
            }
        }
        done
    }

    /// Publishes the records as they come until `shutdown`; `settled` turns
    /// true once those held at start are published (or their pods found
    /// gone, or kept on the node only). What is unpublished at shutdown
    /// stays in the regions for the next start. Records held on the node
    /// only are looked at again whenever `cache` changes.
    pub async fn publish(
        &self,
        cluster: Cluster,
        cache: PodCache,
        settled: watch::Sender<bool>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut delay = FIRST_RETRY_DELAY;
        let mut pods_changed = cache.subscribe();
        loop {
            // Registered before the pass, so a record noted during it wakes
            // the next one, and a change of the pods read during it too.
            let woken = self.wake.notified();
            pods_changed.mark_unchanged();
            // A pass may wait long on a write (the client's own retries of
            // an overloaded server): shutdown does not wait for it, and what
            // it leaves unpublished is in the regions for the next start.
            let done = tokio::select! {
                done = self.publish_all(&cluster, &cache) => done,
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            if done {
                settled.send_if_modified(|settled| !std::mem::replace(settled, true));
                delay = FIRST_RETRY_DELAY;
                let held = !self.lock().is_empty();
                tokio::select! {
                    () = woken => {}
                    // Records held on the node only: the pod's status
                    // showing it admitted, or its deletion, ends them.
                    Ok(()) = pods_changed.changed(), if held => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            } else {
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
                delay = (delay * 2).min(MAX_RETRY_DELAY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(uid: &str, allocated: Option<&str>) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                annotations: allocated
                    .map(|a| [(ALLOCATED_ANNOTATION.to_string(), a.to_string())].into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        })
    }

    fn recorded(pod: &Pod) -> Option<&str> {
        pod.metadata
            .annotations
            .as_ref()?
            .get(ALLOCATED_ANNOTATION)
            .map(String::as_str)
    }

    fn name(name: &str) -> PodName {
        PodName {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    /// A cluster whose API server is unreachable (a port nobody listens
    /// on): any write fails.
    fn unreachable_cluster() -> Cluster {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let url = format!("http://127.0.0.1:{port}").parse().expect("URL");
        let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
        Cluster::new(client, "n1".into())
    }

    /// The pod with UID `uid` as the watch holds it, in `phase`.
    fn watched(uid: &str, phase: &str) -> PodCache {
        let mut held = Arc::unwrap_or_clone(pod(uid, None));
        held.metadata.name = Some(uid.into());
        held.metadata.namespace = Some("ns".into());
        held.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        });
        let cache = PodCache::default();
        cache.remember(held);
        cache
    }

    /// Serves container `main` of pod `uid`, then publishes its record
    /// with the pod watched in `phase`.
    async fn serve_and_publish(
        records: &Records,
        uid: &str,
        phase: &str,
    ) -> Result<(), ClusterError> {
        records.served(uid, name(uid), &["main".into()]);
        records
            .publish_one(
                &unreachable_cluster(),
                &watched(uid, phase),
                uid,
                &name(uid),
                &["main".into()],
            )
            .await
    }

    #[tokio::test]
    async fn no_record_is_written_for_a_pod_kubelet_has_admitted() {
        let records = Records::default();
        // Admitted: nothing to write, so nothing asked of the API server.
        let published = serve_and_publish(&records, "a", "Running").await;
        assert!(published.is_ok(), "{published:?}");
        assert_eq!(records.unpublished_count(), 0);
        // Still being admitted: the record is written (and here refused).
        let published = serve_and_publish(&records, "b", "Pending").await;
        assert!(published.is_err(), "the write was tried");
        assert_eq!(records.unpublished_count(), 1);
    }

    #[tokio::test]
    async fn a_record_kept_on_the_node_only_is_held_until_kubelet_has_admitted_its_pod() {
        let records = Records {
            keeping: Keeping::NodeOnly,
            ..Records::default()
        };
        // Still being admitted: held, and nothing is written (the API
        // server is unreachable, and the pass succeeds).
        let published = serve_and_publish(&records, "a", "Pending").await;
        assert!(published.is_ok(), "{published:?}");
        assert_eq!(records.unpublished_count(), 1);
        let pods = records.unpublished().merge(vec![pod("a", None)]);
        assert_eq!(recorded(&pods[0]), Some(r#"["main"]"#), "merged while held");
        // Admitted: dropped.
        let published = records
            .publish_one(
                &unreachable_cluster(),
                &watched("a", "Running"),
                "a",
                &name("a"),
                &["main".into()],
            )
            .await;
        assert!(published.is_ok(), "{published:?}");
        assert_eq!(records.unpublished_count(), 0);
    }

    #[tokio::test]
    async fn the_publisher_drops_a_held_record_once_the_watch_shows_its_pod_admitted() {
        let records = Arc::new(Records {
            keeping: Keeping::NodeOnly,
            ..Records::default()
        });
        records.served("a", name("a"), &["main".into()]);
        let cache = watched("a", "Pending");
        let (settled_tx, mut settled) = watch::channel(false);
        let (stop, shutdown) = watch::channel(false);
        let publisher = tokio::spawn({
            let (records, cache) = (Arc::clone(&records), cache.clone());
            async move {
                records
                    .publish(unreachable_cluster(), cache, settled_tx, shutdown)
                    .await
            }
        });
        settled.wait_for(|s| *s).await.expect("publisher running");
        assert_eq!(records.unpublished_count(), 1, "held while being admitted");
        // The watch shows the pod admitted: the next pass drops its record.
        let mut admitted = Arc::unwrap_or_clone(watched("a", "Running").get("a").expect("held"));
        admitted.metadata.resource_version = Some("2".into());
        cache.remember(admitted);
        tokio::time::timeout(Duration::from_secs(10), async {
            while records.unpublished_count() != 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the record dropped after the watch showed the pod admitted");
        stop.send_replace(true);
        publisher.await.expect("publisher stopped");
    }

    #[test]
    fn unpublished_records_are_merged_into_the_pods_read() {
        let records = Records::default();
        records.served("a", name("a"), &["init".into()]);
        records.served("a", name("a"), &["main".into()]);
        records.served("b", name("b"), &["main".into()]);
        let pods = records.unpublished().merge(vec![
            pod("a", Some(r#"["init"]"#)),
            pod("b", None),
            pod("c", Some(r#"["x"]"#)),
            pod("d", Some("not json")),
        ]);
        assert_eq!(recorded(&pods[0]), Some(r#"["init","main"]"#));
        assert_eq!(recorded(&pods[1]), Some(r#"["main"]"#));
        assert_eq!(recorded(&pods[2]), Some(r#"["x"]"#));
        assert_eq!(recorded(&pods[3]), Some("not json"), "left to the protocol");
        assert_eq!(records.unpublished_count(), 3);
    }

    #[test]
    fn only_the_pods_given_a_record_are_copied() {
        let records = Records::default();
        records.served("a", name("a"), &["main".into()]);
        let (a, b) = (pod("a", None), pod("b", None));
        let pods = records.unpublished().merge(vec![a.clone(), b.clone()]);
        assert!(!Arc::ptr_eq(&pods[0], &a));
        assert_eq!(recorded(&a), None, "the pod as held is left as it was");
        assert!(Arc::ptr_eq(&pods[1], &b));
    }

    #[test]
    fn a_snapshot_keeps_what_is_forgotten_after_it() {
        let records = Records::default();
        records.served("a", name("a"), &["main".into()]);
        let snapshot = records.unpublished();
        records.forget("a", &["main".into()]);
        assert_eq!(records.unpublished_count(), 0);
        let pods = snapshot.merge(vec![pod("a", None)]);
        assert_eq!(recorded(&pods[0]), Some(r#"["main"]"#));
    }

    #[test]
    fn forgetting_what_was_published_keeps_what_was_served_since() {
        let records = Records::default();
        records.served("a", name("a"), &["first".into()]);
        records.served("a", name("a"), &["second".into()]);
        records.forget("a", &["first".into()]);
        let pods = records
            .unpublished()
            .merge(vec![pod("a", Some(r#"["first"]"#))]);
        assert_eq!(recorded(&pods[0]), Some(r#"["first","second"]"#));
    }

    #[test]
    fn the_regions_on_the_host_are_read_back_as_served_containers() {
        let dir = std::env::temp_dir().join(format!("vgpu-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let make = |name: &str, with_region: bool| {
            let sub = dir.join(name);
            std::fs::create_dir_all(&sub).expect("dir");
            if with_region {
                std::fs::write(sub.join("region.cache"), b"r").expect("region");
            }
        };
        make("uid-1_main", true);
        make("uid-1_sidecar", true);
        // Stopped between the directory and its region: never answered.
        make("uid-2_main", false);
        // A DRA claim's region and a stray name.
        make("claim-uid-3", true);
        make("uid_4_x", true);
        let records = Records::load(&dir, "region.cache", Keeping::PodAnnotation);
        let pods = records
            .unpublished()
            .merge(vec![pod("uid-1", None), pod("uid-2", None)]);
        let mut first: Vec<String> =
            parse_allocated(recorded(&pods[0]).expect("merged")).expect("list");
        first.sort();
        assert_eq!(first, ["main", "sidecar"]);
        assert_eq!(recorded(&pods[1]), None);
        assert_eq!(records.unpublished_count(), 2);
        std::fs::remove_dir_all(&dir).expect("clean");
        assert_eq!(
            Records::load(&dir, "region.cache", Keeping::PodAnnotation).unpublished_count(),
            0,
            "no directory, no records"
        );
    }
}
