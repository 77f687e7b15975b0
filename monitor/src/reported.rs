//! What the monitor has already said. A pass finds the same anomaly again
//! and again while it lasts; each is logged (and recorded as an Event on
//! its pod) when it is first found, and found anew only once it is gone.

use std::collections::{HashMap, HashSet};

/// A GPU process, by the GPU's UUID and its host PID.
pub type ProcessId = (String, u32);

/// The anomalies reported and not yet gone.
#[derive(Debug, Default)]
pub struct Reported {
    /// (container, device) of region devices on a GPU their pod was not
    /// given.
    misplaced: HashSet<(String, usize)>,
    /// (container, device) found holding memory above the granted cap.
    over_cap: HashSet<(String, usize)>,
    /// Times each container's region limits were restored.
    restored: HashMap<String, u64>,
    /// When each container's decision was made, as of the last pass.
    decided: HashMap<String, u64>,
    /// Processes using a GPU without the shim, logged.
    unenforced: HashSet<ProcessId>,
    /// Those of them recorded as an Event on their pod.
    unenforced_evented: HashSet<ProcessId>,
}

impl Reported {
    /// Notes that `device` of `container` is on a GPU its pod was not
    /// given; true the first time.
    pub fn misplaced(&mut self, container: &str, device: usize) -> bool {
        self.misplaced.insert((container.to_string(), device))
    }

    /// Notes whether `device` of `container` holds memory above its cap;
    /// true when it newly does.
    pub fn over_cap(&mut self, container: &str, device: usize, over: bool) -> bool {
        let key = (container.to_string(), device);
        if over {
            self.over_cap.insert(key)
        } else {
            self.over_cap.remove(&key);
            false
        }
    }

    /// Counts one more restoration of `container`'s limits; how many so
    /// far.
    pub fn limits_restored(&mut self, container: &str) -> u64 {
        let count = self.restored.entry(container.to_string()).or_insert(0);
        *count += 1;
        *count
    }

    /// Notes when `container`'s decision was made; true when an earlier
    /// pass saw an older one (the extender resized the pod).
    pub fn decision_remade(&mut self, container: &str, decided_unix_ms: Option<u64>) -> bool {
        let Some(now) = decided_unix_ms else {
            return false;
        };
        match self.decided.insert(container.to_string(), now) {
            Some(before) => before != now,
            None => false,
        }
    }

    /// How many times `container`'s limits were restored.
    pub fn restorations(&self, container: &str) -> u64 {
        self.restored.get(container).copied().unwrap_or(0)
    }

    /// Notes a process found without the shim; true the first time.
    pub fn unenforced(&mut self, process: &ProcessId) -> bool {
        self.unenforced.insert(process.clone())
    }

    /// Whether the process was recorded as an Event on its pod.
    pub fn unenforced_evented(&self, process: &ProcessId) -> bool {
        self.unenforced_evented.contains(process)
    }

    pub fn mark_unenforced_evented(&mut self, process: ProcessId) {
        self.unenforced_evented.insert(process);
    }

    /// Forgets the processes that are no longer found.
    pub fn keep_unenforced(&mut self, current: &HashSet<ProcessId>) {
        self.unenforced.retain(|seen| current.contains(seen));
        self.unenforced_evented
            .retain(|seen| current.contains(seen));
    }

    /// A region the scan removed (gone, or replaced and opened again):
    /// where its devices are is judged afresh.
    pub fn region_removed(&mut self, container: &str) {
        self.misplaced.retain(|(key, _)| key != container);
    }

    /// Forgets the caps and restorations of containers no longer there.
    pub fn keep_live(&mut self, live: &HashSet<&str>) {
        self.restored.retain(|key, _| live.contains(key.as_str()));
        self.decided.retain(|key, _| live.contains(key.as_str()));
        self.over_cap.retain(|(key, _)| live.contains(key.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_is_remade_only_when_a_later_pass_sees_another_time() {
        let mut reported = Reported::default();
        assert!(!reported.decision_remade("c", Some(1)), "first seen");
        assert!(!reported.decision_remade("c", Some(1)));
        assert!(reported.decision_remade("c", Some(2)), "resized");
        assert!(!reported.decision_remade("c", None), "a claim's grant");
        reported.keep_live(&HashSet::new());
        assert!(
            !reported.decision_remade("c", Some(3)),
            "forgotten with the region"
        );
    }

    #[test]
    fn each_anomaly_is_reported_once_while_it_lasts() {
        let mut reported = Reported::default();
        assert!(reported.misplaced("a", 0));
        assert!(!reported.misplaced("a", 0));
        assert!(reported.misplaced("a", 1), "another device");
        reported.region_removed("a");
        assert!(reported.misplaced("a", 0), "a region read afresh");

        assert!(reported.over_cap("a", 0, true));
        assert!(!reported.over_cap("a", 0, true));
        assert!(!reported.over_cap("a", 0, false));
        assert!(
            reported.over_cap("a", 0, true),
            "over again after it was under"
        );

        assert_eq!(reported.limits_restored("a"), 1);
        assert_eq!(reported.limits_restored("a"), 2);
        assert_eq!(reported.restorations("a"), 2);
        assert_eq!(reported.restorations("b"), 0);
        reported.keep_live(&HashSet::from(["b"]));
        assert_eq!(reported.restorations("a"), 0);
        assert!(reported.over_cap("a", 0, true), "forgotten with its region");

        let process = ("GPU-0".to_string(), 42);
        assert!(reported.unenforced(&process));
        assert!(!reported.unenforced(&process));
        assert!(!reported.unenforced_evented(&process));
        reported.mark_unenforced_evented(process.clone());
        assert!(reported.unenforced_evented(&process));
        reported.keep_unenforced(&HashSet::new());
        assert!(!reported.unenforced_evented(&process));
        assert!(
            reported.unenforced(&process),
            "found again after it was gone"
        );
    }
}
