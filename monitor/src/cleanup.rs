//! Removing what nobody needs any more.
//!
//! - **Dead process slots.** A process that died (even by SIGKILL) leaves
//!   its slot marked active with its memory charged; its liveness lock is
//!   gone with it. The monitor returns such slots
//!   ([`Region::reclaim_dead_slots`]). That takes the region's mutex, which
//!   lives in a file the container can write: a hostile or broken container
//!   could hold it forever. So reclaiming runs on a separate *janitor*
//!   thread, which waits at most [`MUTEX_WAIT`] for a region's mutex; a
//!   region whose mutex stays held is left alone for [`HELD_RETRY_AFTER`]
//!   (whatever happens to its file meanwhile: replacing the file does not
//!   buy another wait), so one janitor thread serves every region and no
//!   thread is ever left blocked. As a last resort, if one reclaim still
//!   takes longer than [`JANITOR_STUCK_AFTER`], that region is never
//!   reclaimed again (one log line), the stuck thread is abandoned and a
//!   fresh janitor serves the others.
//! - **Regions of deleted pods.** A container directory whose pod is gone
//!   (the API is available, synced, and has not listed the pod) for longer
//!   than the grace period is removed, unless a process still holds one of
//!   its slots. Nothing is removed when the API is unavailable.

use crate::names::Presence;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;
use vgpu_node_contract::region::{Region, RegionError, MAX_SLOTS};

/// A reclaim running longer than this is taken to be stuck.
pub const JANITOR_STUCK_AFTER: Duration = Duration::from_secs(5);
/// Longest wait for a region's mutex: its legitimate holders (the shim's
/// allocations) hold it for microseconds.
pub const MUTEX_WAIT: Duration = Duration::from_millis(100);
/// A region whose mutex stayed held is tried again after this long.
pub const HELD_RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Error)]
pub enum CleanupError {
    #[error("cannot remove {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a directory directly under {root}")]
    Outside { path: PathBuf, root: PathBuf },
}

/// Whether any active slot of `region` is held by a live process (a failed
/// probe counts as live: never delete on uncertainty).
pub use vgpu_node_contract::figures::has_live_process;

/// Whether any active slot's owner has died (there is something to reclaim).
pub fn has_dead_slot(region: &Region) -> bool {
    region
        .active_slots()
        .take(MAX_SLOTS)
        .any(|slot| matches!(region.slot_is_live(slot), Ok(false)))
}

/// Decides when a pod's region may go.
pub struct Reaper {
    grace: Duration,
    gone_since: HashMap<String, Instant>,
}

/// What to do with a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    Remove,
}

impl Reaper {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            gone_since: HashMap::new(),
        }
    }

    /// Judges the region `key`: `presence` of its pod, whether a process
    /// still lives in it. A region is removed once its pod has been gone for
    /// the whole grace period, as seen by consecutive calls; any doubt
    /// (unknown presence, a live process, a pod seen again) restarts the
    /// clock.
    pub fn judge(&mut self, key: &str, presence: Presence, live: bool, now: Instant) -> Verdict {
        if presence != Presence::Gone || live {
            self.gone_since.remove(key);
            return Verdict::Keep;
        }
        let since = *self.gone_since.entry(key.to_string()).or_insert(now);
        if now.duration_since(since) >= self.grace {
            Verdict::Remove
        } else {
            Verdict::Keep
        }
    }

    /// Forgets keys that are no longer tracked.
    pub fn retain(&mut self, keys: &HashSet<&str>) {
        self.gone_since.retain(|key, _| keys.contains(key.as_str()));
    }
}

/// Removes the container directory `dir`, which must be a direct child of
/// `root` (symlinks inside are removed, never followed).
pub fn remove_container_dir(root: &Path, dir: &Path) -> Result<(), CleanupError> {
    let direct_child = dir.parent() == Some(root)
        && dir
            .file_name()
            .is_some_and(|name| name != "." && name != "..");
    let is_dir = std::fs::symlink_metadata(dir)
        .map(|m| m.file_type().is_dir())
        .unwrap_or(false);
    if !direct_child || !is_dir {
        return Err(CleanupError::Outside {
            path: dir.to_path_buf(),
            root: root.to_path_buf(),
        });
    }
    std::fs::remove_dir_all(dir).map_err(|source| CleanupError::Remove {
        path: dir.to_path_buf(),
        source,
    })
}

struct Job {
    key: String,
    region: Arc<Region>,
}

struct Worker {
    sender: mpsc::Sender<Job>,
    /// Key and start of the reclaim in progress.
    busy: Arc<Mutex<Option<(String, Instant)>>>,
}

/// What the janitor thread shares with the monitor's loop.
#[derive(Clone, Default)]
struct Shared {
    /// Keys queued or being reclaimed.
    pending: Arc<Mutex<HashSet<String>>>,
    /// Keys whose mutex was found held, and when.
    held: Arc<Mutex<HashMap<String, Instant>>>,
    /// Slots reclaimed so far.
    reclaimed: Arc<AtomicU64>,
    /// Reclaims given up because a mutex stayed held.
    held_total: Arc<AtomicU64>,
}

/// Reclaims dead slots off the monitor's loop (see the module docs).
pub struct Janitor {
    worker: Worker,
    shared: Shared,
    /// Regions whose reclaim got stuck: never again.
    quarantined: HashSet<String>,
    /// Slots reclaimed so far.
    pub reclaimed: Arc<AtomicU64>,
    /// Reclaims given up because a region's mutex stayed held.
    pub held_total: Arc<AtomicU64>,
}

impl Default for Janitor {
    fn default() -> Self {
        Self::new()
    }
}

impl Janitor {
    pub fn new() -> Self {
        let shared = Shared::default();
        Self {
            worker: spawn_worker(shared.clone()),
            reclaimed: Arc::clone(&shared.reclaimed),
            held_total: Arc::clone(&shared.held_total),
            shared,
            quarantined: HashSet::new(),
        }
    }

    /// Queues a reclaim of `region` unless one is queued already, the
    /// region is quarantined, or its mutex was found held less than
    /// [`HELD_RETRY_AFTER`] ago.
    pub fn request(&mut self, key: &str, region: Arc<Region>) {
        if self.quarantined.contains(key) {
            return;
        }
        {
            let mut held = lock(&self.shared.held);
            match held.get(key) {
                Some(at) if at.elapsed() < HELD_RETRY_AFTER => return,
                Some(_) => {
                    held.remove(key);
                }
                None => {}
            }
        }
        {
            let mut pending = lock(&self.shared.pending);
            if !pending.insert(key.to_string()) {
                return;
            }
        }
        let job = Job {
            key: key.to_string(),
            region,
        };
        if self.worker.sender.send(job).is_err() {
            lock(&self.shared.pending).remove(key);
        }
    }

    /// Checks that the janitor is not stuck; replaces it if it is. Returns
    /// the key quarantined, if any.
    pub fn watchdog(&mut self, now: Instant) -> Option<String> {
        let stuck = {
            let busy = lock(&self.worker.busy);
            match &*busy {
                Some((key, since)) if now.duration_since(*since) > JANITOR_STUCK_AFTER => {
                    Some(key.clone())
                }
                _ => None,
            }
        };
        let key = stuck?;
        tracing::error!(
            "region {key}: its mutex has been held for over {} s; no more slot reclaims for it",
            JANITOR_STUCK_AFTER.as_secs()
        );
        self.quarantined.insert(key.clone());
        // The stuck thread keeps its own pending set entries; start afresh.
        self.shared.pending = Arc::new(Mutex::new(HashSet::new()));
        self.worker = spawn_worker(self.shared.clone());
        Some(key)
    }

    /// Forgets a region that is no longer tracked (a new file under the same
    /// key starts with a clean record, except that a mutex found held keeps
    /// its region waiting out [`HELD_RETRY_AFTER`]).
    pub fn forget(&mut self, key: &str) {
        self.quarantined.remove(key);
    }

    pub fn is_quarantined(&self, key: &str) -> bool {
        self.quarantined.contains(key)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

fn spawn_worker(shared: Shared) -> Worker {
    let (sender, receiver) = mpsc::channel::<Job>();
    let busy: Arc<Mutex<Option<(String, Instant)>>> = Arc::new(Mutex::new(None));
    let busy_in_thread = Arc::clone(&busy);
    let spawned = std::thread::Builder::new()
        .name("vgpu-janitor".into())
        .spawn(move || {
            for job in receiver {
                *lock(&busy_in_thread) = Some((job.key.clone(), Instant::now()));
                match job.region.reclaim_dead_slots_within(MUTEX_WAIT) {
                    Ok(0) => {}
                    Ok(count) => {
                        tracing::info!(
                            "region {}: reclaimed {count} dead process slot(s)",
                            job.key
                        );
                        shared.reclaimed.fetch_add(count as u64, Ordering::Relaxed);
                    }
                    Err(RegionError::Busy { .. }) => {
                        let first = lock(&shared.held)
                            .insert(job.key.clone(), Instant::now())
                            .is_none();
                        shared.held_total.fetch_add(1, Ordering::Relaxed);
                        if first {
                            tracing::warn!(
                                "region {}: its mutex stayed held for {} ms; its dead slots are tried again in {} s",
                                job.key,
                                MUTEX_WAIT.as_millis(),
                                HELD_RETRY_AFTER.as_secs()
                            );
                        }
                    }
                    Err(error) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "region {}: reclaim",
                        job.key
                    ),
                }
                *lock(&busy_in_thread) = None;
                lock(&shared.pending).remove(&job.key);
            }
        });
    if let Err(error) = spawned {
        tracing::error!(
            error = &error as &dyn std::error::Error,
            "cannot start the janitor thread"
        );
    }
    Worker { sender, busy }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_needs_the_pod_gone_for_the_whole_grace_period() {
        let mut reaper = Reaper::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(reaper.judge("k", Presence::Gone, false, t0), Verdict::Keep);
        assert_eq!(
            reaper.judge("k", Presence::Gone, false, t0 + Duration::from_secs(9)),
            Verdict::Keep
        );
        assert_eq!(
            reaper.judge("k", Presence::Gone, false, t0 + Duration::from_secs(10)),
            Verdict::Remove
        );
    }

    #[test]
    fn any_doubt_restarts_the_clock() {
        let mut reaper = Reaper::new(Duration::from_secs(10));
        let t0 = Instant::now();
        reaper.judge("k", Presence::Gone, false, t0);
        for (presence, live) in [
            (Presence::Unknown, false),
            (Presence::Present, false),
            (Presence::Gone, true),
        ] {
            assert_eq!(
                reaper.judge("k", presence, live, t0 + Duration::from_secs(11)),
                Verdict::Keep
            );
            assert_eq!(
                reaper.judge("k", Presence::Gone, false, t0 + Duration::from_secs(12)),
                Verdict::Keep,
                "clock restarted after {presence:?}/{live}"
            );
            reaper.gone_since.insert("k".into(), t0);
        }
    }

    #[test]
    fn only_direct_children_of_the_root_are_removed() {
        let root = std::env::temp_dir().join(format!("vgpu-cleanup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("a_b")).expect("dir");
        assert!(remove_container_dir(&root, &root.join("a_b/..")).is_err());
        assert!(remove_container_dir(&root, Path::new("/tmp")).is_err());
        remove_container_dir(&root, &root.join("a_b")).expect("removed");
        assert!(!root.join("a_b").exists());
        let _ = std::fs::remove_dir_all(&root);
    }
}
