//! The monitor's latest snapshot, shared between its loop (which
//! publishes one per pass) and the HTTP server (`/metrics`, `/healthz`).

use crate::metrics::{self, Snapshot};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use vgpu_node_contract::region::monotonic_ns;

/// What `/metrics` and `/healthz` read, shared with the HTTP server.
pub struct Shared {
    snapshot: RwLock<Arc<Snapshot>>,
    rendered: Mutex<Option<(u64, axum::body::Bytes)>>,
    hami_names: bool,
    heartbeat_ns: AtomicU64,
    stale_after: Duration,
}

impl Shared {
    pub fn new(hami_names: bool, interval: Duration) -> Self {
        Self {
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            rendered: Mutex::new(None),
            hami_names,
            heartbeat_ns: AtomicU64::new(monotonic_ns()),
            stale_after: (interval * 20).max(Duration::from_secs(5)),
        }
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.snapshot.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn publish(&self, snapshot: Snapshot) {
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(snapshot);
        self.heartbeat_ns.store(monotonic_ns(), Ordering::Release);
    }

    /// The latest snapshot in the text format; rendered once per snapshot,
    /// however many scrapes ask.
    pub fn render(&self) -> axum::body::Bytes {
        let mut cache = self.rendered.lock().unwrap_or_else(|p| p.into_inner());
        let snapshot = self.snapshot();
        if let Some((generation, bytes)) = cache.as_ref() {
            if *generation == snapshot.generation {
                return bytes.clone();
            }
        }
        let bytes = axum::body::Bytes::from(metrics::render(&snapshot, self.hami_names));
        *cache = Some((snapshot.generation, bytes.clone()));
        bytes
    }

    /// Renders without the cache (for measurements).
    pub fn render_uncached(&self) -> Vec<u8> {
        metrics::render(&self.snapshot(), self.hami_names)
    }

    /// Whether the loop has published recently.
    pub fn healthy(&self) -> bool {
        let age = monotonic_ns().saturating_sub(self.heartbeat_ns.load(Ordering::Acquire));
        Duration::from_nanos(age) < self.stale_after
    }
}
