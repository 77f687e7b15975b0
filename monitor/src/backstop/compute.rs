//! The compute backstop: the device time NVML measured for each process
//! against what its container's share allows.
//!
//! Each pass, every owner's processes on a GPU ([`super::groups`]) are
//! summed as NVML measured them over its window, and an account per owner
//! and GPU keeps what it took against what it may take. While the GPU is
//! *contended* (another owner's work ran there, or its shim launched
//! work there, within [`CONTENDED_FOR`]),
//! the owner earns its share plus [`ComputeRule::tolerance_percent`] of the
//! device's time and spends what it used; alone on its GPU it owes nothing.
//! An owner in debt has its GPU processes paused (`SIGSTOP`) until the
//! debt is repaid, then resumed (`SIGCONT`): a duty cycle whose pauses are
//! as long as the work it took. Work already queued on the GPU runs on
//! while its processes are paused, and is charged as it runs, so a pause
//! lasts until that work too is paid for: long kernels and graphs only
//! make the pauses longer. An owner whose debt still grows past
//! [`ComputeRule::owed_limit`] (it queued more than a pause can drain, or
//! a process of its own resumes the paused ones) meets the over-cap
//! action: its busiest process is killed. With [`OverCapAction::Report`]
//! nothing is paused or killed; the owner is reported once it would be.

use super::groups::{by_owner, Group, OwnerOnGpu};
use super::memory::OverCapAction;
use crate::owners::Owner;
use crate::unenforced::ProcessUse;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long after another owner's work last ran on a GPU it still counts
/// as contended: a neighbour held back (by its own shim, or by work queued
/// ahead of it) may show no device time for a while, and is still waiting.
pub const CONTENDED_FOR: Duration = Duration::from_secs(10);

/// Most device time an owner may save while under its share (held back
/// by work queued ahead of its own), to spend catching up: a shim's
/// limiter lets a container that was kept waiting run its saved time at
/// once (1 s windows of 72 % at a 50 % share were measured beside a hog),
/// and its long-run share is what holds.
pub const CREDIT_LIMIT: Duration = Duration::from_secs(2);

/// What an owner first seen starts with: a program starting up (a shim's
/// limiter starts with tokens in hand) is not paused for its first burst,
/// while one that takes 10 points more than it may owes within 5 s.
pub const STARTING_CREDIT: Duration = Duration::from_millis(500);

/// The longest gap between passes counted at one pass's rate (a stalled
/// monitor does not bill a whole stall at the last rate seen).
const LONGEST_STEP: Duration = Duration::from_secs(1);

/// When a container's processes take more than their share, and what is
/// done.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeRule {
    /// Percentage points of the device above its share a container may
    /// take before it owes time (what the shim's own limiter may be off by).
    pub tolerance_percent: u32,
    /// Device time owed past which pausing is not enough.
    pub owed_limit: Duration,
    pub action: OverCapAction,
}

impl Default for ComputeRule {
    fn default() -> Self {
        Self {
            tolerance_percent: 5,
            owed_limit: Duration::from_secs(5),
            action: OverCapAction::Kill,
        }
    }
}

/// An owner held to a share on one GPU, as it stands after a pass.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnerTime {
    pub owner: Owner,
    pub gpu_uuid: String,
    /// Percent of the device its processes used over NVML's window.
    pub used_percent: u32,
    /// Its share, in percent.
    pub share_percent: u32,
    /// Device time it owes (zero: none).
    pub owed: Duration,
    /// Its processes on the GPU (host PIDs), busiest first.
    pub pids: Vec<u32>,
    /// Whether its processes are to be paused.
    pub paused: bool,
}

/// What a pass decided.
#[derive(Debug, Default)]
pub struct ComputeVerdict {
    /// Every owner held to a share on a contended GPU.
    pub owners: Vec<OwnerTime>,
    /// Processes to pause now, with their owner.
    pub pause: Vec<(u32, Owner)>,
    /// Processes paused before, to resume now, with their owner.
    pub resume: Vec<(u32, Owner)>,
    /// Owners that began owing time in this pass, after none for
    /// [`CONTENDED_FOR`] (one notice per episode).
    pub began: Vec<OwnerTime>,
    /// Owners past [`ComputeRule::owed_limit`]: their busiest process is
    /// killed (action kill) or they are reported (once an episode).
    pub past_limit: Vec<OwnerTime>,
}

#[derive(Debug)]
struct Account {
    /// Device seconds it may still take (negative: owed).
    balance: f64,
    last: Instant,
    /// When it last owed anything.
    last_owed: Option<Instant>,
    /// Reported past the limit in this episode (action report).
    reported: bool,
}

/// The backstop's memory of past passes.
#[derive(Debug, Default)]
pub struct ComputeBackstop {
    rule: ComputeRule,
    accounts: HashMap<OwnerOnGpu, Account>,
    /// When each owner's work last ran on each GPU.
    last_active: HashMap<OwnerOnGpu, Instant>,
    /// Processes paused now, with their owner.
    paused: HashMap<u32, Owner>,
}

impl ComputeBackstop {
    pub fn new(rule: ComputeRule) -> Self {
        Self {
            rule,
            ..Self::default()
        }
    }

    pub fn rule(&self) -> ComputeRule {
        self.rule
    }

    /// Every process paused now, with its owner (to resume them all when
    /// the monitor stops).
    pub fn paused(&self) -> impl Iterator<Item = (u32, &Owner)> + '_ {
        self.paused.iter().map(|(pid, owner)| (*pid, owner))
    }

    /// Forgets a paused process (it could not be paused, or is gone).
    pub fn forget(&mut self, pid: u32) {
        self.paused.remove(&pid);
    }

    /// One pass over every GPU process (`uses`, with the device time NVML
    /// measured for each), against `shares` (region key and GPU UUID to its
    /// share in percent, 0 for none) and `pod_of` (region key to its pod's
    /// UID). `launching` are the owners whose shims launched work on a GPU
    /// within the activity window: waiting behind another's work, a
    /// neighbour may get too little device time for NVML to show, and
    /// still be held back.
    pub fn judge(
        &mut self,
        uses: &[ProcessUse],
        launching: &[OwnerOnGpu],
        shares: &HashMap<(String, String), u32>,
        pod_of: &HashMap<String, String>,
        now: Instant,
    ) -> ComputeVerdict {
        let ran = uses
            .iter()
            .filter(|u| u.sm_percent > 0)
            .map(|u| (u.owner.clone(), u.gpu_uuid.clone()));
        for id in ran.chain(launching.iter().cloned()) {
            self.last_active.insert(id, now);
        }
        self.last_active
            .retain(|_, at| now.saturating_duration_since(*at) < CONTENDED_FOR);
        let live: Vec<&ProcessUse> = uses.iter().collect();
        let groups = by_owner(&live, shares, pod_of, |shares| {
            if shares.iter().any(|&s| is_unlimited(s)) {
                return None;
            }
            Some(shares.iter().sum::<u32>().min(100))
        });
        let mut verdict = ComputeVerdict::default();
        let mut want_paused: HashMap<u32, Owner> = HashMap::new();
        let mut judged = HashSet::new();
        for (id, Group { granted, members }) in groups {
            if is_unlimited(granted) {
                continue;
            }
            let theirs: HashSet<&Owner> = members.iter().map(|u| &u.owner).collect();
            let contended = self
                .last_active
                .keys()
                .any(|(owner, gpu)| *gpu == id.1 && !theirs.contains(owner) && *owner != id.0);
            let used: u32 = members.iter().map(|u| u.sm_percent).sum::<u32>().min(100);
            let account = self.accounts.entry(id.clone()).or_insert(Account {
                balance: STARTING_CREDIT.as_secs_f64(),
                last: now,
                last_owed: None,
                reported: false,
            });
            let step = now
                .saturating_duration_since(account.last)
                .min(LONGEST_STEP)
                .as_secs_f64();
            account.last = now;
            let credit = CREDIT_LIMIT.as_secs_f64();
            if contended {
                let allowed = f64::from(granted + self.rule.tolerance_percent);
                account.balance += (allowed - f64::from(used)) / 100.0 * step;
                account.balance = account.balance.min(credit);
            } else {
                account.balance = account.balance.clamp(0.0, credit);
            }
            judged.insert(id.clone());
            if !contended && account.last_owed.is_none() {
                continue;
            }
            let owes = account.balance < 0.0;
            let mut began = false;
            if owes {
                began = account
                    .last_owed
                    .is_none_or(|at| now.saturating_duration_since(at) >= CONTENDED_FOR);
                account.last_owed = Some(now);
            } else if account
                .last_owed
                .is_some_and(|at| now.saturating_duration_since(at) >= CONTENDED_FOR)
            {
                account.last_owed = None;
                account.reported = false;
            }
            let mut busiest: Vec<&ProcessUse> = members.clone();
            busiest.sort_by_key(|u| (std::cmp::Reverse(u.sm_percent), u.pid));
            let pause = owes && self.rule.action == OverCapAction::Kill;
            let time = OwnerTime {
                owner: id.0.clone(),
                gpu_uuid: id.1.clone(),
                used_percent: used,
                share_percent: granted,
                owed: Duration::from_secs_f64((-account.balance).max(0.0)),
                pids: busiest.iter().map(|u| u.pid).collect(),
                paused: pause,
            };
            if pause {
                for u in &members {
                    want_paused.insert(u.pid, u.owner.clone());
                }
            }
            if time.owed > self.rule.owed_limit {
                match self.rule.action {
                    OverCapAction::Kill => {
                        // Acted on: it starts owing again from nothing.
                        account.balance = 0.0;
                        verdict.past_limit.push(time.clone());
                    }
                    OverCapAction::Report if !account.reported => {
                        account.reported = true;
                        verdict.past_limit.push(time.clone());
                    }
                    OverCapAction::Report => {}
                }
            }
            if began {
                verdict.began.push(time.clone());
            }
            verdict.owners.push(time);
        }
        self.accounts.retain(|id, _| judged.contains(id));
        for (pid, owner) in &want_paused {
            if !self.paused.contains_key(pid) {
                verdict.pause.push((*pid, owner.clone()));
            }
        }
        for (pid, owner) in &self.paused {
            if !want_paused.contains_key(pid) {
                verdict.resume.push((*pid, owner.clone()));
            }
        }
        verdict.pause.sort_by_key(|(pid, _)| *pid);
        verdict.resume.sort_by_key(|(pid, _)| *pid);
        self.paused = want_paused;
        verdict
    }
}

/// A share that holds nothing: none set, or the whole device.
fn is_unlimited(share: u32) -> bool {
    share == 0 || share >= 100
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: &str = "GPU-a";
    const PASS: Duration = Duration::from_millis(100);

    fn use_(pid: u32, owner: &str, sm_percent: u32) -> ProcessUse {
        ProcessUse {
            gpu_uuid: GPU.into(),
            pid,
            owner: Owner::Region(owner.into()),
            used_bytes: 0,
            charged_bytes: 0,
            sm_percent,
        }
    }

    fn shares(entries: &[(&str, u32)]) -> HashMap<(String, String), u32> {
        entries
            .iter()
            .map(|(key, share)| ((key.to_string(), GPU.to_string()), *share))
            .collect()
    }

    fn rule(action: OverCapAction) -> ComputeRule {
        ComputeRule {
            tolerance_percent: 5,
            owed_limit: Duration::from_secs(2),
            action,
        }
    }

    /// Passes from `start` until one pauses something: (pass, verdict).
    fn until_paused(
        backstop: &mut ComputeBackstop,
        uses: &[ProcessUse],
        launching: &[OwnerOnGpu],
        shares: &HashMap<(String, String), u32>,
        pods: &HashMap<String, String>,
        start: Instant,
        passes: u32,
    ) -> Option<(u32, ComputeVerdict)> {
        (0..passes).find_map(|pass| {
            let verdict = backstop.judge(uses, launching, shares, pods, start + PASS * pass);
            (!verdict.pause.is_empty()).then_some((pass, verdict))
        })
    }

    #[test]
    fn an_owner_over_its_share_beside_another_is_paused_until_it_has_paid_then_resumed() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("hog", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        // The hog takes 90 % of the device, the neighbour 10 %: the hog
        // earns 35 % and spends 90 %, so it owes once its starting credit
        // (0.5 s) is spent: after 0.5 / 0.55 = 0.9 s.
        let over = [use_(10, "hog", 90), use_(20, "neighbour", 10)];
        let (pass, verdict) =
            until_paused(&mut backstop, &over, &[], &shares, &pods, start, 50).expect("paused");
        assert_eq!(pass, 10, "not before its credit was spent");
        assert_eq!(verdict.pause, vec![(10, Owner::Region("hog".into()))]);
        assert_eq!(verdict.began.len(), 1);
        let hog = &verdict.owners.iter().find(|o| o.pids == [10]).expect("hog");
        assert!(hog.paused && hog.owed > Duration::ZERO, "{hog:?}");
        // Paused, its queued work drains: NVML shows it under its share, and
        // it pays back what it owes at 35 % a second.
        let drained = [use_(10, "hog", 0), use_(20, "neighbour", 50)];
        let resumed = (11..21).find_map(|pass| {
            let verdict = backstop.judge(&drained, &[], &shares, &pods, start + PASS * pass);
            assert!(verdict.pause.is_empty() && verdict.began.is_empty());
            (!verdict.resume.is_empty()).then_some(verdict)
        });
        assert_eq!(
            resumed.expect("resumed within a second").resume,
            vec![(10, Owner::Region("hog".into()))]
        );
    }

    #[test]
    fn an_owner_alone_on_its_gpu_or_within_its_share_and_tolerance_owes_nothing() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("hog", 30), ("steady", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        for pass in 0..50 {
            let at = start + PASS * pass;
            // Alone: all of the device.
            let alone = backstop.judge(&[use_(10, "hog", 100)], &[], &shares, &pods, at);
            assert!(
                alone.pause.is_empty() && alone.owners.is_empty(),
                "{alone:?}"
            );
        }
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        for pass in 0..50 {
            let at = start + PASS * pass;
            // 34 % of a 30 % share is within the 5 points' tolerance.
            let steady = [use_(11, "steady", 34), use_(20, "neighbour", 50)];
            let verdict = backstop.judge(&steady, &[], &shares, &pods, at);
            assert!(
                verdict.pause.is_empty() && verdict.began.is_empty(),
                "{verdict:?}"
            );
        }
    }

    #[test]
    fn a_neighbour_whose_shim_launches_contends_though_nvml_shows_it_no_time() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("hog", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        // Its kernels wait behind the hog's: too little time to show.
        let over = [use_(10, "hog", 100), use_(20, "neighbour", 0)];
        let unseen = until_paused(&mut backstop, &over, &[], &shares, &pods, start, 100);
        assert!(unseen.is_none(), "alone as far as NVML shows: {unseen:?}");
        let launching = [(Owner::Region("neighbour".into()), GPU.to_string())];
        let later = start + PASS * 100;
        let (_, seen) = until_paused(&mut backstop, &over, &launching, &shares, &pods, later, 50)
            .expect("paused once the neighbour's launches are seen");
        assert_eq!(seen.pause, vec![(10, Owner::Region("hog".into()))]);
    }

    #[test]
    fn a_neighbour_catching_up_on_time_it_was_kept_from_is_not_paused() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("hog", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        let launching = [(Owner::Region("neighbour".into()), GPU.to_string())];
        // 2 s kept at 10 %, then 2 s at 72 %: 41 % over the four.
        for pass in 0..=40 {
            let used = if pass <= 20 { 10 } else { 72 };
            let now = [use_(10, "hog", 20), use_(20, "neighbour", used)];
            let verdict = backstop.judge(&now, &launching, &shares, &pods, start + PASS * pass);
            assert!(verdict.pause.is_empty(), "pass {pass}: {verdict:?}");
        }
    }

    #[test]
    fn an_owner_whose_debt_grows_past_the_limit_has_its_busiest_process_killed() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("hog", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        // Paused, it still runs at 95 %: work queued deeper than a pause
        // drains. It spends 60 % of each second beyond what it earns: its
        // 0.5 s of credit, then 2 s owed, within 5 s.
        let queued = [
            use_(10, "hog", 5),
            use_(11, "hog", 90),
            use_(20, "neighbour", 5),
        ];
        let mut past = None;
        for pass in 0..=70 {
            let verdict = backstop.judge(&queued, &[], &shares, &pods, start + PASS * pass);
            if let Some(owner) = verdict.past_limit.into_iter().next() {
                past = Some((pass, owner));
                break;
            }
        }
        let (pass, owner) = past.expect("past the limit within 5 s");
        assert!(pass >= 40, "not before 2 s are owed: pass {pass}");
        assert_eq!(owner.pids.first(), Some(&11), "the busiest first");
        assert!(owner.paused);
    }

    #[test]
    fn report_pauses_nothing_and_reports_once_an_episode() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Report));
        let shares = shares(&[("hog", 30), ("neighbour", 50)]);
        let pods = HashMap::new();
        let start = Instant::now();
        let over = [use_(10, "hog", 95), use_(20, "neighbour", 5)];
        let mut reports = 0;
        for pass in 0..100 {
            let verdict = backstop.judge(&over, &[], &shares, &pods, start + PASS * pass);
            assert!(verdict.pause.is_empty(), "report pauses nothing");
            reports += verdict.past_limit.len();
        }
        assert_eq!(reports, 1);
    }

    #[test]
    fn a_pod_whose_container_cannot_be_told_apart_is_held_to_its_containers_shares_together() {
        let mut backstop = ComputeBackstop::new(rule(OverCapAction::Kill));
        let shares = shares(&[("pod-a_main", 20), ("pod-a_side", 20), ("neighbour", 50)]);
        let pods: HashMap<String, String> = [
            ("pod-a_main".to_string(), "pod-a".to_string()),
            ("pod-a_side".to_string(), "pod-a".to_string()),
        ]
        .into();
        let start = Instant::now();
        let mut hidden = use_(10, "unused", 80);
        hidden.owner = Owner::Pod("pod-a".into());
        let over = [hidden, use_(20, "neighbour", 20)];
        let (_, verdict) =
            until_paused(&mut backstop, &over, &[], &shares, &pods, start, 100).expect("paused");
        let pod = verdict
            .owners
            .iter()
            .find(|o| o.owner == Owner::Pod("pod-a".into()))
            .expect("the pod");
        assert_eq!(pod.share_percent, 40);
        assert_eq!(verdict.pause, vec![(10, Owner::Pod("pod-a".into()))]);
    }
}
