//! The namespaces admission skips, from the watch
//! ([`crate::cache::skipped_namespaces`]).

use super::ClusterState;
use crate::cache::book::{Book, WatchRefusal};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::watcher::Event;

impl Book<Namespace> for ClusterState {
    const KIND: &'static str = "Namespace";

    fn apply_event(&mut self, event: Event<Namespace>) {
        let book = &mut self.skipped_namespaces;
        match event {
            Event::Init => book.begin_relist(),
            Event::InitApply(namespace) | Event::Apply(namespace) => book.apply(&namespace),
            Event::InitDone => book.finish_relist(),
            Event::Delete(namespace) => book.delete(&namespace),
        }
        self.updates += 1;
    }

    /// 403: this extender may not read namespaces (RBAC of one's own):
    /// placement checks the confinement of every namespace's pods but the
    /// named ones, and goes on; the watch keeps retrying.
    fn refused(&mut self, code: u16) -> Option<WatchRefusal> {
        if code != 403 {
            return None;
        }
        self.skipped_namespaces.refuse();
        Some(WatchRefusal::Warn(
            "Kubernetes API: this extender may not list Namespaces (RBAC); placement \
             checks the confinement of vGPU pods in namespaces labelled vgpu.io/webhook=ignore too",
        ))
    }
}
