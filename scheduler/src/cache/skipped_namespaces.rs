//! The namespaces vgpu's admission leaves alone: those labelled
//! `vgpu.io/webhook=ignore` (watched, by that label only) and those the
//! chart names (`scheduler.webhook.ignoreNamespaces`, given as flags).
//! Placement checks a pod's confinement again
//! ([`crate::admission::confinement`]) everywhere else.

use crate::cache::book::Listing;
use k8s_openapi::api::core::v1::Namespace;
use std::collections::HashSet;

/// The label that makes vgpu's admission (the webhook and the chart's
/// admission policies) skip a namespace's pods.
pub const SKIP_LABEL: &str = "vgpu.io/webhook";
/// Its value.
pub const SKIP_VALUE: &str = "ignore";

/// The label selector of the namespaces admission skips.
pub fn skip_selector() -> String {
    format!("{SKIP_LABEL}={SKIP_VALUE}")
}

/// The namespaces admission skips.
#[derive(Debug, Default)]
pub struct SkippedNamespaces {
    /// Named by the chart: skipped whatever their labels.
    named: HashSet<String>,
    labelled: HashSet<String>,
    relist: Option<HashSet<String>>,
    /// Watched: placements wait for the first complete list. Refused (no
    /// right to read namespaces): only the named ones are skipped, so a
    /// labelled namespace's pods are checked too (never the other way
    /// round).
    listing: Listing,
}

impl SkippedNamespaces {
    /// The labelled namespaces are watched from now on, besides `named`:
    /// placements wait for their first list (or the watch's refusal).
    pub fn expect(&mut self, named: impl IntoIterator<Item = String>) {
        self.named = named.into_iter().collect();
        self.listing.expect();
    }

    /// Whether placements may go ahead: listed, not watched, or refused.
    pub fn ready(&self) -> bool {
        self.listing.ready()
    }

    /// The watch was refused.
    pub fn refuse(&mut self) {
        self.listing.refuse();
    }

    /// Starts a complete list.
    pub fn begin_relist(&mut self) {
        self.relist = Some(HashSet::new());
    }

    /// Applies a namespace from a list or the watch (which only sends
    /// labelled ones, but one whose label changed arrives as deleted).
    pub fn apply(&mut self, namespace: &Namespace) {
        let Some(name) = namespace.metadata.name.as_deref() else {
            return;
        };
        if !labelled(namespace) {
            self.labelled.remove(name);
            return;
        }
        if let Some(listed) = &mut self.relist {
            listed.insert(name.to_string());
        }
        self.labelled.insert(name.to_string());
    }

    /// A namespace was deleted, or lost the label.
    pub fn delete(&mut self, namespace: &Namespace) {
        if let Some(name) = namespace.metadata.name.as_deref() {
            self.labelled.remove(name);
        }
    }

    /// Ends a complete list: labelled namespaces it did not hold are not
    /// skipped any more.
    pub fn finish_relist(&mut self) {
        if let Some(listed) = self.relist.take() {
            self.labelled = listed;
        }
        if self.listing.listed() {
            tracing::info!(
                "Kubernetes API: {} namespace(s) labelled {} (admission skips them)",
                self.labelled.len(),
                skip_selector()
            );
        }
    }

    /// Whether admission skips `namespace`.
    pub fn skips(&self, namespace: &str) -> bool {
        self.named.contains(namespace) || self.labelled.contains(namespace)
    }
}

fn labelled(namespace: &Namespace) -> bool {
    namespace
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(SKIP_LABEL))
        .is_some_and(|value| value == SKIP_VALUE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn namespace(name: &str, skipped: bool) -> Namespace {
        let labels = if skipped {
            json!({SKIP_LABEL: SKIP_VALUE})
        } else {
            json!({"team": "a"})
        };
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))
            .expect("namespace")
    }

    #[test]
    fn labelled_and_named_namespaces_are_skipped_once_listed() {
        let mut book = SkippedNamespaces::default();
        assert!(book.ready(), "not watched: nothing to wait for");
        book.expect(["gpu-system".to_string()]);
        assert!(!book.ready());
        book.begin_relist();
        book.apply(&namespace("tools", true));
        book.apply(&namespace("team-a", false));
        book.finish_relist();
        assert!(book.ready());
        assert!(book.skips("tools") && book.skips("gpu-system"));
        assert!(!book.skips("team-a"));

        // The label taken away, or the namespace deleted.
        book.apply(&namespace("tools", false));
        assert!(!book.skips("tools"));
        book.apply(&namespace("tools", true));
        book.delete(&namespace("tools", true));
        assert!(!book.skips("tools"));
    }

    #[test]
    fn a_relist_forgets_namespaces_that_lost_the_label_meanwhile() {
        let mut book = SkippedNamespaces::default();
        book.expect([]);
        book.begin_relist();
        book.apply(&namespace("tools", true));
        book.finish_relist();
        book.begin_relist();
        book.finish_relist();
        assert!(!book.skips("tools"));
    }

    #[test]
    fn a_refused_watch_skips_only_the_named_namespaces() {
        let mut book = SkippedNamespaces::default();
        book.expect(["gpu-system".to_string()]);
        book.refuse();
        assert!(book.ready());
        assert!(book.skips("gpu-system") && !book.skips("tools"));
    }
}
