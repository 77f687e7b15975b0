//! The device plugins' node Leases from the watch ([`crate::cache::leases`]).

use super::ClusterState;
use crate::cache::book::Book;
use crate::cache::clock::now_unix_ms;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher::Event;

impl Book<Lease> for ClusterState {
    const KIND: &'static str = "node Lease";

    fn apply_event(&mut self, event: Event<Lease>) {
        match event {
            Event::Init => self.leases.begin_relist(),
            Event::InitApply(lease) | Event::Apply(lease) => {
                self.leases.apply(&lease, now_unix_ms());
                self.updates += 1;
            }
            Event::InitDone => {
                self.leases.finish_relist();
                self.updates += 1;
            }
            Event::Delete(lease) => {
                self.leases.delete(&lease);
                self.updates += 1;
            }
        }
    }
}
