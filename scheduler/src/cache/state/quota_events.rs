//! ResourceQuotas from the watch ([`crate::cache::quotas`]).

use super::ClusterState;
use crate::cache::book::{Book, WatchRefusal};
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::runtime::watcher::Event;

impl Book<ResourceQuota> for ClusterState {
    const KIND: &'static str = "ResourceQuota";

    fn apply_event(&mut self, event: Event<ResourceQuota>) {
        match event {
            Event::Init => self.quotas.begin_relist(),
            Event::InitApply(quota) | Event::Apply(quota) => self.quotas.apply(&quota),
            Event::InitDone => self.quotas.finish_relist(),
            Event::Delete(quota) => self.quotas.delete(&quota),
        }
        self.updates += 1;
    }

    /// 403: this extender may not read quotas (a chart before they were
    /// enforced, or RBAC of one's own): none is enforced, and placements
    /// go on; the watch keeps retrying.
    fn refused(&mut self, code: u16) -> Option<WatchRefusal> {
        if code != 403 {
            return None;
        }
        self.quotas.refuse();
        Some(WatchRefusal::Warn(
            "Kubernetes API: this extender may not list ResourceQuotas (RBAC); \
             namespaces' quotas of GPU memory and cores are not enforced",
        ))
    }
}
