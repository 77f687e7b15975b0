//! The memory backstop: NVML's per-process memory against what each
//! container was granted.
//!
//! Each pass, the processes NVML lists on a GPU are summed by owner
//! ([`crate::owners`]): a container's region, or a pod whose container
//! could not be told apart (held to what its containers were granted on
//! that GPU together). An owner whose processes hold more than its cap
//! plus [`MemoryRule::margin_per_process`] for each of its processes on
//! the GPU (what NVML counts that is no allocation: contexts, the driver's
//! own per-context memory) is *over*; [`MemoryRule::samples`] passes over
//! in a row make a [`Breach`]. Its victim is the process whose NVML memory
//! most exceeds what the shim charged to it (a process without the shim
//! was charged nothing), then the largest. A killed process is left out of
//! the sums for [`SIGNALLED_GRACE`], while the driver may still list it.

use super::groups::{by_owner, Group};
use crate::owners::Owner;
use crate::unenforced::ProcessUse;
use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::{Duration, Instant};
use thiserror::Error;
use vgpu_node_contract::region::UNCAPPED;

/// How long a killed process is left out of the sums.
pub const SIGNALLED_GRACE: Duration = Duration::from_secs(10);

/// What is done about a breach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OverCapAction {
    /// Logged, counted and recorded as an Event; nothing is stopped.
    Report,
    /// The victim is killed (`SIGKILL`), then reported as above.
    #[default]
    Kill,
}

/// An action name that is neither.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{0:?}: expected report or kill")]
pub struct UnknownAction(String);

impl FromStr for OverCapAction {
    type Err = UnknownAction;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "report" => Ok(Self::Report),
            "kill" => Ok(Self::Kill),
            other => Err(UnknownAction(other.to_string())),
        }
    }
}

impl OverCapAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::Report => "report",
            Self::Kill => "kill",
        }
    }
}

/// When a container is over its cap, and what is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRule {
    /// What each process may hold beyond its container's cap, for what
    /// NVML counts that the shim charges as no allocation.
    pub margin_per_process: u64,
    /// Passes over in a row that make a breach.
    pub samples: u32,
    pub action: OverCapAction,
}

impl Default for MemoryRule {
    fn default() -> Self {
        Self {
            margin_per_process: DEFAULT_MARGIN,
            samples: 3,
            action: OverCapAction::Kill,
        }
    }
}

/// [`MemoryRule::margin_per_process`] unless configured: more than the
/// driver's per-context memory beyond what the shim measures and charges
/// for a context (its local-memory and printf buffers, which grow with
/// what kernels ask for).
pub const DEFAULT_MARGIN: u64 = 256 << 20;

/// A container (or pod) past its cap for long enough.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breach {
    pub owner: Owner,
    pub gpu_uuid: String,
    /// What its processes hold, as NVML says.
    pub used_bytes: u64,
    /// Its cap.
    pub cap_bytes: u64,
    /// Its cap and the margin for its processes.
    pub allowed_bytes: u64,
    /// The process to act on (`None`: every one is already signalled).
    pub victim: Option<Victim>,
    pub action: OverCapAction,
}

/// The process a breach is blamed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Victim {
    pub pid: u32,
    pub used_bytes: u64,
    pub charged_bytes: u64,
}

/// The backstop's memory of past passes.
#[derive(Debug, Default)]
pub struct MemoryBackstop {
    rule: MemoryRule,
    /// Passes over in a row, by owner and GPU.
    streaks: HashMap<(Owner, String), u32>,
    /// Breaches reported (action `report`) and not yet over.
    reported: HashSet<(Owner, String)>,
    /// Processes killed, and when.
    signalled: HashMap<u32, Instant>,
}

impl MemoryBackstop {
    pub fn new(rule: MemoryRule) -> Self {
        Self {
            rule,
            ..Self::default()
        }
    }

    pub fn rule(&self) -> MemoryRule {
        self.rule
    }

    /// Notes that `pid` was killed at `now`.
    pub fn signalled(&mut self, pid: u32, now: Instant) {
        self.signalled.insert(pid, now);
    }

    /// One pass over every GPU process (`uses`), against `caps` (region
    /// key and GPU UUID to its cap in bytes) and `pod_of` (region key to
    /// its pod's UID). Returns the breaches to act on now.
    pub fn judge(
        &mut self,
        uses: &[ProcessUse],
        caps: &HashMap<(String, String), u64>,
        pod_of: &HashMap<String, String>,
        now: Instant,
    ) -> Vec<Breach> {
        self.signalled
            .retain(|_, at| now.saturating_duration_since(*at) < SIGNALLED_GRACE);
        let live: Vec<&ProcessUse> = uses
            .iter()
            .filter(|u| !self.signalled.contains_key(&u.pid))
            .collect();
        // Every owner and GPU with a cap, and the processes it answers for.
        let groups = by_owner(&live, caps, pod_of, |caps| {
            if caps.contains(&UNCAPPED) {
                return None;
            }
            Some(caps.iter().fold(0u64, |a, b| a.saturating_add(*b)))
        });
        let mut breaches = Vec::new();
        let mut over_now = HashSet::new();
        for (
            (owner, gpu_uuid),
            Group {
                granted: cap,
                members,
            },
        ) in groups
        {
            if cap == UNCAPPED {
                continue;
            }
            let used = members
                .iter()
                .fold(0u64, |sum, u| sum.saturating_add(u.used_bytes));
            let allowed = cap.saturating_add(
                self.rule
                    .margin_per_process
                    .saturating_mul(members.len() as u64),
            );
            let id = (owner.clone(), gpu_uuid.clone());
            if used <= allowed {
                continue;
            }
            over_now.insert(id.clone());
            let streak = self.streaks.entry(id.clone()).or_insert(0);
            *streak += 1;
            if *streak < self.rule.samples {
                continue;
            }
            if self.rule.action == OverCapAction::Report && !self.reported.insert(id.clone()) {
                continue;
            }
            // Acted on: the next action needs as many passes again.
            *streak = 0;
            let victim = members
                .iter()
                .max_by_key(|u| (u.used_bytes.saturating_sub(u.charged_bytes), u.used_bytes))
                .map(|u| Victim {
                    pid: u.pid,
                    used_bytes: u.used_bytes,
                    charged_bytes: u.charged_bytes,
                });
            breaches.push(Breach {
                owner,
                gpu_uuid,
                used_bytes: used,
                cap_bytes: cap,
                allowed_bytes: allowed,
                victim,
                action: self.rule.action,
            });
        }
        self.streaks.retain(|id, _| over_now.contains(id));
        self.reported.retain(|id| over_now.contains(id));
        breaches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GPU: &str = "GPU-a";

    fn use_(pid: u32, owner: Owner, used_mib: u64, charged_mib: u64) -> ProcessUse {
        ProcessUse {
            gpu_uuid: GPU.into(),
            pid,
            owner,
            used_bytes: used_mib * MIB,
            charged_bytes: charged_mib * MIB,
            sm_percent: 0,
        }
    }

    fn region(key: &str) -> Owner {
        Owner::Region(key.into())
    }

    fn rule(action: OverCapAction) -> MemoryRule {
        MemoryRule {
            margin_per_process: 100 * MIB,
            samples: 3,
            action,
        }
    }

    fn caps(entries: &[(&str, u64)]) -> HashMap<(String, String), u64> {
        entries
            .iter()
            .map(|(key, mib)| ((key.to_string(), GPU.to_string()), mib * MIB))
            .collect()
    }

    #[test]
    fn three_passes_over_the_cap_and_margin_kill_the_process_the_shim_did_not_charge() {
        let mut backstop = MemoryBackstop::new(rule(OverCapAction::Kill));
        let caps = caps(&[("a", 1024)]);
        let pods = HashMap::new();
        let now = Instant::now();
        // Two processes: the shim's, charged what it holds, and one
        // without it holding 3 GiB.
        let over = [
            use_(10, region("a"), 900, 900),
            use_(11, region("a"), 3072, 0),
        ];
        // At the cap and margin: never a breach.
        let at = [use_(10, region("a"), 1024 + 100, 1024)];
        for _ in 0..5 {
            assert!(backstop.judge(&at, &caps, &pods, now).is_empty());
        }
        assert!(backstop.judge(&over, &caps, &pods, now).is_empty());
        assert!(backstop.judge(&over, &caps, &pods, now).is_empty());
        let breaches = backstop.judge(&over, &caps, &pods, now);
        assert_eq!(breaches.len(), 1);
        let breach = &breaches[0];
        assert_eq!(breach.owner, region("a"));
        assert_eq!(breach.used_bytes, 3972 * MIB);
        assert_eq!(breach.allowed_bytes, 1224 * MIB);
        assert_eq!(breach.victim.map(|v| v.pid), Some(11));
        // Killed: left out of the sums, the container is under again.
        backstop.signalled(11, now);
        for _ in 0..5 {
            assert!(backstop.judge(&over, &caps, &pods, now).is_empty());
        }
        // A pass under the cap breaks a streak.
        let mut backstop = MemoryBackstop::new(rule(OverCapAction::Kill));
        for _ in 0..10 {
            assert!(backstop.judge(&over, &caps, &pods, now).is_empty());
            assert!(backstop.judge(&over, &caps, &pods, now).is_empty());
            assert!(backstop.judge(&at, &caps, &pods, now).is_empty());
        }
    }

    #[test]
    fn reports_once_per_episode_and_ignores_owners_without_a_cap() {
        let mut backstop = MemoryBackstop::new(rule(OverCapAction::Report));
        let caps = caps(&[("a", 1024), ("free", UNCAPPED)]);
        let pods = HashMap::new();
        let now = Instant::now();
        let over = [
            use_(10, region("a"), 4096, 4096),
            use_(20, region("free"), 80_000, 0),
            use_(30, region("unknown-region"), 80_000, 0),
            use_(40, Owner::Unknown, 80_000, 0),
        ];
        let mut reported = 0;
        for _ in 0..10 {
            for breach in backstop.judge(&over, &caps, &pods, now) {
                assert_eq!(breach.owner, region("a"));
                assert_eq!(breach.action, OverCapAction::Report);
                // A forged charge only shifts the blame within a container.
                assert_eq!(breach.victim.map(|v| v.pid), Some(10));
                reported += 1;
            }
        }
        assert_eq!(reported, 1);
    }

    #[test]
    fn a_pod_whose_container_is_not_told_apart_is_held_to_its_containers_together() {
        let mut backstop = MemoryBackstop::new(rule(OverCapAction::Kill));
        let caps = caps(&[("p_main", 1024), ("p_side", 1024)]);
        let pods: HashMap<String, String> = [("p_main", "p"), ("p_side", "p")]
            .iter()
            .map(|(k, p)| (k.to_string(), p.to_string()))
            .collect();
        let now = Instant::now();
        let within = [
            use_(10, region("p_main"), 1000, 1000),
            use_(11, Owner::Pod("p".into()), 1000, 0),
        ];
        for _ in 0..5 {
            assert!(backstop.judge(&within, &caps, &pods, now).is_empty());
        }
        let over = [
            use_(10, region("p_main"), 1000, 1000),
            use_(11, Owner::Pod("p".into()), 2000, 0),
        ];
        let mut breaches = Vec::new();
        for _ in 0..3 {
            breaches = backstop.judge(&over, &caps, &pods, now);
        }
        assert_eq!(breaches.len(), 1);
        assert_eq!(breaches[0].owner, Owner::Pod("p".into()));
        assert_eq!(breaches[0].cap_bytes, 2048 * MIB);
        assert_eq!(breaches[0].victim.map(|v| v.pid), Some(11));
    }

    #[test]
    fn actions_are_read_by_name() {
        assert_eq!("kill".parse(), Ok(OverCapAction::Kill));
        assert_eq!(" report ".parse(), Ok(OverCapAction::Report));
        assert_eq!(
            "stop".parse::<OverCapAction>().map_err(|e| e.to_string()),
            Err("\"stop\": expected report or kill".to_string())
        );
    }
}
