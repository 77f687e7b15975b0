//! The vGPU pods filter passed, kept for the bind that follows.
//!
//! kube-scheduler sends the whole pod with every filter call and only its
//! name and UID with the bind; without this copy each bind would first
//! read the pod from the API server, a round trip under the load of a
//! burst. A copy that is behind is safe: the bind writes the pod under the
//! copy's `resourceVersion` as a precondition, so a pod changed since is
//! refused and read again ([`crate::extender::bind`]).

use k8s_openapi::api::core::v1::Pod;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a copy waits for its bind: kube-scheduler binds right after
/// the scheduling cycle whose filter sent it.
const KEPT_FOR: Duration = Duration::from_secs(30);
/// The most pod JSON kept at once; the oldest copies go first.
const MAX_KEPT_BYTES: usize = 8 << 20;
/// A pod larger than this is read again at bind rather than kept.
const MAX_POD_BYTES: usize = 256 << 10;

struct Kept {
    uid: String,
    at: Instant,
    /// The size of the pod's JSON, as it came.
    bytes: usize,
    pod: Pod,
}

/// The copies, oldest first.
#[derive(Default)]
pub struct FilteredPods {
    kept: Mutex<KeptPods>,
}

#[derive(Default)]
struct KeptPods {
    entries: VecDeque<Kept>,
    bytes: usize,
}

impl KeptPods {
    fn pop_oldest(&mut self) {
        if let Some(old) = self.entries.pop_front() {
            self.bytes -= old.bytes;
        }
    }
}

impl FilteredPods {
    /// Keeps `pod` (its JSON `bytes` long) for its bind, replacing an
    /// earlier copy of it.
    pub fn remember(&self, pod: &Pod, bytes: usize) {
        let Some(uid) = pod.metadata.uid.as_deref().filter(|uid| !uid.is_empty()) else {
            return;
        };
        if bytes > MAX_POD_BYTES {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(index) = kept.entries.iter().position(|k| k.uid == uid) {
            if let Some(old) = kept.entries.remove(index) {
                kept.bytes -= old.bytes;
            }
        }
        while kept
            .entries
            .front()
            .is_some_and(|oldest| oldest.at.elapsed() >= KEPT_FOR)
            || kept.bytes + bytes > MAX_KEPT_BYTES
        {
            if kept.entries.is_empty() {
                break;
            }
            kept.pop_oldest();
        }
        kept.bytes += bytes;
        kept.entries.push_back(Kept {
            uid: uid.to_string(),
            at: Instant::now(),
            bytes,
            pod: pod.clone(),
        });
    }

    /// The copy of pod `namespace/name` with `uid`, if one was kept
    /// within [`KEPT_FOR`]; it is kept no longer.
    pub fn take(&self, namespace: &str, name: &str, uid: &str) -> Option<Pod> {
        if uid.is_empty() {
            return None;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let index = kept.entries.iter().position(|k| k.uid == uid)?;
        let entry = kept.entries.remove(index)?;
        kept.bytes -= entry.bytes;
        let meta = &entry.pod.metadata;
        let same =
            meta.namespace.as_deref() == Some(namespace) && meta.name.as_deref() == Some(name);
        (same && entry.at.elapsed() < KEPT_FOR).then_some(entry.pod)
    }

    /// How many copies are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entries
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(namespace: &str, name: &str, uid: &str, version: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                uid: Some(uid.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn a_bind_takes_the_latest_copy_once() {
        let kept = FilteredPods::default();
        kept.remember(&pod("team", "a", "u1", "7"), 1000);
        kept.remember(&pod("team", "a", "u1", "9"), 1000);
        assert_eq!(kept.len(), 1);
        let taken = kept.take("team", "a", "u1").expect("kept");
        assert_eq!(taken.metadata.resource_version.as_deref(), Some("9"));
        assert!(kept.take("team", "a", "u1").is_none());
    }

    #[test]
    fn a_copy_is_given_only_to_the_pod_it_is_of() {
        let kept = FilteredPods::default();
        kept.remember(&pod("team", "a", "u1", "7"), 1000);
        // Another pod's name under this UID (a forged or confused bind).
        assert!(kept.take("team", "b", "u1").is_none());
        kept.remember(&pod("team", "a", "u1", "7"), 1000);
        assert!(kept.take("other", "a", "u1").is_none());
        kept.remember(&pod("team", "a", "u1", "7"), 1000);
        assert!(kept.take("team", "a", "u2").is_none());
        assert!(kept.take("team", "a", "").is_none());
        // A pod with no UID is not kept.
        kept.remember(&pod("team", "c", "", "1"), 1000);
        assert!(kept.take("team", "c", "").is_none());
    }

    #[test]
    fn large_pods_are_not_kept_and_the_oldest_copies_make_room() {
        let kept = FilteredPods::default();
        kept.remember(&pod("team", "huge", "u0", "1"), MAX_POD_BYTES + 1);
        assert_eq!(kept.len(), 0);
        let each = MAX_POD_BYTES;
        let fit = MAX_KEPT_BYTES / each;
        for n in 0..=fit {
            kept.remember(&pod("team", &format!("p{n}"), &format!("u{n}"), "1"), each);
        }
        assert_eq!(kept.len(), fit);
        assert!(kept.take("team", "p0", "u0").is_none(), "the oldest went");
        assert!(kept
            .take("team", &format!("p{fit}"), &format!("u{fit}"))
            .is_some());
    }
}
