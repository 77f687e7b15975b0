//! The loads a filter call computed, kept for the prioritize call that
//! follows it for the same pod.

use crate::cache::fast_map::FastMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long, and for how many pods, the loads are kept.
const SCORE_CACHE_TTL: Duration = Duration::from_secs(5);
const SCORE_CACHE_ENTRIES: usize = 16;

/// The loads of the nodes a pod fits on, by node name hash: the load after
/// placing the pod, and the GPUs of a wanted model.
pub struct ScoreEntry {
    pub uid: String,
    pub version: String,
    pub at: Instant,
    pub loads: FastMap<u64, (f64, u32)>,
}

/// The last pods' entries.
#[derive(Default)]
pub struct ScoreCache {
    entries: Mutex<Vec<ScoreEntry>>,
}

impl ScoreCache {
    pub fn remember(&self, entry: ScoreEntry) {
        let mut cache = self
            .entries
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        cache.retain(|e| e.uid != entry.uid && e.at.elapsed() < SCORE_CACHE_TTL);
        if cache.len() >= SCORE_CACHE_ENTRIES {
            cache.remove(0);
        }
        cache.push(entry);
    }

    /// The loads the filter call for this pod version computed, if recent.
    pub fn recall(&self, uid: &str, version: &str) -> Option<ScoreEntry> {
        let mut cache = self
            .entries
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let index = cache.iter().position(|e| e.uid == uid)?;
        let entry = cache.remove(index);
        (entry.version == version && entry.at.elapsed() < SCORE_CACHE_TTL).then_some(entry)
    }
}
