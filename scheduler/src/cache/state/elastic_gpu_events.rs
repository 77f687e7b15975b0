//! ElasticGPUs from the watch, and from the claim controller's own writes:
//! the slices they hold for claims ([`crate::cache::reservations`]).

use super::{ClusterState, ElasticSync, LOCAL_RECORD_TRUST};
use crate::cache::book::{Book, WatchRefusal};
use crate::cache::fast_map::FastMap;
use crate::cache::reservations::Reservation;
use crate::vocabulary::elastic::ElasticGpu;
use kube::runtime::watcher::Event;
use std::time::Instant;

impl Book<ElasticGpu> for ClusterState {
    const KIND: &'static str = "ElasticGPU";

    fn apply_event(&mut self, event: Event<ElasticGpu>) {
        match event {
            Event::Init => self.begin_reservation_relist(),
            Event::InitApply(object) => self.relist_reservation(&object),
            Event::InitDone => self.finish_reservation_relist(),
            Event::Apply(object) => self.apply_reservation(&object, false),
            Event::Delete(object) => self.delete_reservation(&object),
        }
    }

    /// The API has no ElasticGPUs for this extender (404: the definitions
    /// are not installed; 403: it may not read them), which means no slice
    /// is held; the watch keeps retrying, so definitions installed later
    /// are picked up.
    fn refused(&mut self, code: u16) -> Option<WatchRefusal> {
        let refusal = match code {
            404 => WatchRefusal::Info(
                "Kubernetes API: no ElasticGPU resource (the elasticgpu.io definitions are not installed); \
                 no GPU slices are held for claims",
            ),
            403 => WatchRefusal::Warn(
                "Kubernetes API: this extender may not list ElasticGPUs (RBAC); \
                 GPU slices held for Elastic GPU claims are not counted",
            ),
            _ => return None,
        };
        self.no_reservations();
        Some(refusal)
    }
}

impl ClusterState {
    /// ElasticGPUs are watched: placements wait until they are listed.
    pub fn expect_reservations(&mut self) {
        if self.elastic == ElasticSync::NotWatched {
            self.elastic = ElasticSync::Waiting;
        }
    }

    /// The API has no ElasticGPUs for this extender: none hold anything.
    fn no_reservations(&mut self) {
        self.elastic = ElasticSync::Absent;
        self.reservation_relist = None;
        let names: Vec<String> = self.reservations.keys().cloned().collect();
        for name in names {
            self.remove_reservation(&name);
        }
        self.updates += 1;
    }

    /// Starts a complete list of ElasticGPUs.
    fn begin_reservation_relist(&mut self) {
        self.reservation_relist = Some(FastMap::default());
    }

    /// One ElasticGPU of a complete list.
    fn relist_reservation(&mut self, object: &ElasticGpu) {
        let relist = self.reservation_relist.get_or_insert_with(FastMap::default);
        if let Some(reservation) = read_reservation(object) {
            relist.insert(reservation.elastic_gpu.clone(), reservation);
        }
    }

    /// Ends a complete list of ElasticGPUs: it replaces what was known,
    /// except the extender's own recent writes that the list predates.
    fn finish_reservation_relist(&mut self) {
        let mut listed = self.reservation_relist.take().unwrap_or_default();
        for (name, old) in &self.reservations {
            let trusted = old
                .local_since
                .is_some_and(|since| since.elapsed() < LOCAL_RECORD_TRUST);
            if trusted && !listed.contains_key(name) {
                listed.insert(name.clone(), old.clone());
            }
        }
        let names: Vec<String> = self.reservations.keys().cloned().collect();
        for name in names {
            self.remove_reservation(&name);
        }
        for (_, reservation) in listed {
            self.insert_reservation(reservation);
        }
        if self.elastic == ElasticSync::Waiting {
            tracing::info!(
                "Kubernetes API: {} ElasticGPU slice(s) held for claims listed",
                self.reservations.len()
            );
        }
        self.elastic = ElasticSync::Known;
        self.updates += 1;
    }

    /// Applies an ElasticGPU from the watch (`local: false`) or from the
    /// answer to the extender's own write (`local: true`).
    pub fn apply_reservation(&mut self, object: &ElasticGpu, local: bool) {
        let Some(name) = object.metadata.name.as_deref() else {
            return;
        };
        let reservation = read_reservation(object);
        if let (Some(new), Some(old)) = (&reservation, self.reservations.get(name)) {
            // An event older than what is known changes nothing.
            if matches!((new.resource_version, old.resource_version), (Some(n), Some(o)) if n < o) {
                return;
            }
        }
        self.remove_reservation(name);
        if let Some(mut reservation) = reservation {
            if local {
                reservation.local_since = Some(Instant::now());
            }
            self.insert_reservation(reservation);
        }
        self.updates += 1;
    }

    /// An ElasticGPU was deleted.
    fn delete_reservation(&mut self, object: &ElasticGpu) {
        if let Some(name) = object.metadata.name.as_deref() {
            self.remove_reservation(name);
            self.updates += 1;
        }
    }
}

/// The slice an ElasticGPU holds; an unreadable one holds nothing (logged).
fn read_reservation(object: &ElasticGpu) -> Option<Reservation> {
    match Reservation::from_elastic_gpu(object) {
        Ok(reservation) => reservation,
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "ElasticGPU {}: unreadable; the slice it records is not counted",
                object.metadata.name.as_deref().unwrap_or("")
            );
            None
        }
    }
}
