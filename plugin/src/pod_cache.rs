//! The pods bound to this node as a watch of the API server shows them,
//! plus the plugin's own writes, so that an `Allocate` (and the
//! `GetPreferredAllocation` before it) need not list them afresh.
//!
//! What is read here may be behind the API server; it is used only where
//! that is caught or does not matter. An `Allocate` finds no pod or the
//! wrong one only where the pod kubelet admits is missing here, which it
//! checks against kubelet's own list, and then reads the pods afresh
//! ([`crate::service`]). The allocation records are the plugin's own
//! ([`crate::records`]), merged in until the watch shows them. A decision
//! is fixed once its pod is bound, except by a resize, which reaches a
//! container's region through the node monitor whichever decision
//! `Allocate` read.

use crate::protocol::{kubelet_key, KubeletPods};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::watch;

/// The pods of one node, by UID. Each is shared, not copied, with every
/// `Allocate` that reads it (kubelet admits a node's pods one after
/// another, and each admission reads all of the node's pods twice).
#[derive(Default)]
struct Pods {
    /// Whether the watch's first list is in.
    synced: bool,
    by_uid: HashMap<String, Arc<Pod>>,
    /// The next list while a (re)list is being read.
    relisting: Option<HashMap<String, Arc<Pod>>>,
}

/// Why [`PodCache::showing`] gave up.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum NotShown {
    #[error("the watch of the node's pods has not listed them yet")]
    NotListedYet,
    #[error("kubelet lists pod {namespace}/{name}, which the watch has not shown")]
    Pod { namespace: String, name: String },
}

/// The node's pods, kept by [`PodCache::follow`].
#[derive(Clone, Default)]
pub struct PodCache {
    pods: Arc<RwLock<Pods>>,
    /// Marked changed after every change to the pods held, so that those
    /// waiting for the watch to show something need not read the pods
    /// afresh or ask again on a timer.
    changed: Arc<watch::Sender<()>>,
}

fn uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref()
}

/// Whether `candidate` is a later version of its pod than `held` (resource
/// versions compare as numbers on every API server this runs against; one
/// that is not a number is taken as later).
fn later(candidate: &Pod, held: &Pod) -> bool {
    let number = |pod: &Pod| {
        pod.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
    };
    match (number(candidate), number(held)) {
        (Some(new), Some(old)) => new > old,
        _ => true,
    }
}

impl PodCache {
    /// The pods, or `None` while the watch's first list is not in.
    pub fn pods(&self) -> Option<Vec<Arc<Pod>>> {
        let pods = self
            .pods
            .read()
            .unwrap_or_else(|poison| poison.into_inner());
        pods.synced.then(|| pods.by_uid.values().cloned().collect())
    }

    /// The pod with UID `uid` as held now (the watch's first list may not
    /// be in yet).
    pub fn get(&self, uid: &str) -> Option<Arc<Pod>> {
        self.pods
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .by_uid
            .get(uid)
            .cloned()
    }

    /// A receiver marked changed at every later change to the pods held:
    /// subscribe before reading them, so that no change after the read is
    /// missed.
    pub fn subscribe(&self) -> watch::Receiver<()> {
        self.changed.subscribe()
    }

    /// The pods once the watch shows every pod `listed` names (by
    /// namespace and name), waiting for it up to `within`. `Err`: a pod
    /// still not shown, or that the watch's first list is not in.
    pub async fn showing(
        &self,
        listed: &KubeletPods,
        within: Duration,
    ) -> Result<Vec<Arc<Pod>>, NotShown> {
        let deadline = tokio::time::Instant::now() + within;
        let mut changes = self.subscribe();
        loop {
            // Marked before the read: a change after it ends the wait.
            changes.mark_unchanged();
            let missing = match self.pods() {
                None => NotShown::NotListedYet,
                Some(pods) => {
                    let shown: KubeletPods = pods.iter().map(|p| kubelet_key(p)).collect();
                    match listed.difference(&shown).next() {
                        None => return Ok(pods),
                        Some((namespace, name)) => NotShown::Pod {
                            namespace: namespace.clone(),
                            name: name.clone(),
                        },
                    }
                }
            };
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Err(missing),
            }
        }
    }

    /// Takes `pod` as the plugin just wrote it, unless the watch already
    /// showed a later version.
    pub fn remember(&self, pod: Pod) {
        {
            let mut pods = self
                .pods
                .write()
                .unwrap_or_else(|poison| poison.into_inner());
            insert_if_later(&mut pods.by_uid, kept(pod));
        }
        self.changed.send_replace(());
    }

    fn apply(&self, event: Event<Pod>) {
        self.change_held(event);
        self.changed.send_replace(());
    }

    fn change_held(&self, event: Event<Pod>) {
        let mut pods = self
            .pods
            .write()
            .unwrap_or_else(|poison| poison.into_inner());
        match event {
            Event::Apply(pod) => insert_if_later(&mut pods.by_uid, kept(pod)),
            Event::Delete(pod) => {
                if let Some(uid) = uid(&pod) {
                    pods.by_uid.remove(uid);
                }
            }
            Event::Init => pods.relisting = Some(HashMap::new()),
            Event::InitApply(pod) => {
                if let (Some(listing), Some(uid)) = (pods.relisting.as_mut(), uid(&pod)) {
                    listing.insert(uid.to_string(), kept(pod));
                }
            }
            Event::InitDone => {
                if let Some(listed) = pods.relisting.take() {
                    pods.by_uid = listed;
                    pods.synced = true;
                }
            }
        }
    }

    /// Follows the pods bound to `node` until `shutdown` becomes true
    /// (the watch reconnects, and lists again, after errors).
    pub async fn follow(self, client: Client, node: String, mut shutdown: watch::Receiver<bool>) {
        let api: Api<Pod> = Api::all(client);
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => self.apply(event),
                    Some(Err(error)) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "watching the node's pods failed; reconnecting (Allocate lists them meanwhile)"
                    ),
                    None => return,
                },
                // A dropped sender stops it too.
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
        }
    }
}

/// `pod` as held: without its managed fields (the API server's record of
/// who set which field, often the largest part of a pod; nothing here
/// reads it).
fn kept(mut pod: Pod) -> Arc<Pod> {
    pod.metadata.managed_fields = None;
    Arc::new(pod)
}

fn insert_if_later(by_uid: &mut HashMap<String, Arc<Pod>>, pod: Arc<Pod>) {
    let Some(key) = uid(&pod).map(str::to_string) else {
        return;
    };
    match by_uid.get(&key) {
        Some(held) if !later(&pod, held) => {}
        _ => {
            by_uid.insert(key, pod);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(uid: &str, version: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.to_string()),
                resource_version: Some(version.to_string()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn versions(cache: &PodCache) -> Option<Vec<(String, String)>> {
        cache.pods().map(|pods| {
            let mut out: Vec<(String, String)> = pods
                .into_iter()
                .map(|p| {
                    (
                        p.metadata.uid.clone().unwrap_or_default(),
                        p.metadata.resource_version.clone().unwrap_or_default(),
                    )
                })
                .collect();
            out.sort();
            out
        })
    }

    #[test]
    fn nothing_is_served_before_the_first_list_is_in() {
        let cache = PodCache::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(pod("a", "5")));
        assert_eq!(versions(&cache), None);
        cache.apply(Event::InitDone);
        assert_eq!(versions(&cache), Some(vec![("a".into(), "5".into())]));
    }

    #[test]
    fn an_older_version_never_replaces_a_newer_one() {
        let cache = PodCache::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitDone);
        // The plugin's own write is seen before the watch shows it.
        cache.remember(pod("a", "9"));
        cache.apply(Event::Apply(pod("a", "7")));
        assert_eq!(versions(&cache), Some(vec![("a".into(), "9".into())]));
        cache.apply(Event::Apply(pod("a", "10")));
        assert_eq!(versions(&cache), Some(vec![("a".into(), "10".into())]));
        cache.apply(Event::Delete(pod("a", "11")));
        assert_eq!(versions(&cache), Some(vec![]));
    }

    #[test]
    fn a_relist_replaces_what_was_held() {
        let cache = PodCache::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(pod("a", "5")));
        cache.apply(Event::InitDone);
        // The watch broke; a pod deleted meanwhile is gone from the relist.
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(pod("b", "8")));
        // Served meanwhile: the old list.
        assert_eq!(versions(&cache), Some(vec![("a".into(), "5".into())]));
        cache.apply(Event::InitDone);
        assert_eq!(versions(&cache), Some(vec![("b".into(), "8".into())]));
    }

    #[test]
    fn a_subscriber_is_told_of_every_change_after_it_subscribed() {
        let cache = PodCache::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitDone);
        let mut changes = cache.subscribe();
        assert!(!changes.has_changed().expect("sender held"));
        cache.apply(Event::Apply(pod("a", "5")));
        assert!(changes.has_changed().expect("sender held"));
        changes.mark_unchanged();
        cache.remember(pod("a", "6"));
        assert!(changes.has_changed().expect("sender held"));
    }

    fn named(uid: &str, name: &str) -> Pod {
        let mut held = pod(uid, "1");
        held.metadata.namespace = Some("ns".into());
        held.metadata.name = Some(name.into());
        held
    }

    #[tokio::test]
    async fn a_pod_kubelet_lists_is_waited_for_until_the_watch_shows_it() {
        let cache = PodCache::default();
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(named("a", "first")));
        cache.apply(Event::InitDone);
        let listed: KubeletPods = [("ns".to_string(), "second".to_string())].into();
        let waiting = tokio::spawn({
            let (cache, listed) = (cache.clone(), listed.clone());
            async move { cache.showing(&listed, Duration::from_secs(30)).await }
        });
        // The watch shows an unrelated change, then the pod kubelet lists.
        tokio::task::yield_now().await;
        cache.apply(Event::Apply(named("c", "third")));
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "still waiting for the pod kubelet lists"
        );
        cache.apply(Event::Apply(named("b", "second")));
        let pods = waiting.await.expect("joined").expect("shown");
        assert_eq!(pods.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_the_watch_never_shows_is_waited_for_no_longer_than_asked() {
        let cache = PodCache::default();
        let listed: KubeletPods = [("ns".to_string(), "second".to_string())].into();
        assert_eq!(
            cache.showing(&listed, Duration::from_millis(250)).await,
            Err(NotShown::NotListedYet)
        );
        cache.apply(Event::Init);
        cache.apply(Event::InitApply(named("a", "first")));
        cache.apply(Event::InitDone);
        let started = tokio::time::Instant::now();
        assert_eq!(
            cache.showing(&listed, Duration::from_millis(250)).await,
            Err(NotShown::Pod {
                namespace: "ns".into(),
                name: "second".into()
            })
        );
        assert_eq!(started.elapsed(), Duration::from_millis(250));
        let nothing = KubeletPods::new();
        assert_eq!(
            cache
                .showing(&nothing, Duration::ZERO)
                .await
                .map(|p| p.len()),
            Ok(1)
        );
    }
}
