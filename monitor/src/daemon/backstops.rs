//! The pass's backstops at work ([`crate::backstop`]): what each container
//! was granted, judged against what NVML says its processes hold and
//! use, and the signals, logs, counts and Events that follow.

use super::{Collected, Monitor};
use crate::assess::{granted, record_event, Assessment, Granted};
use crate::backstop::signal::{signal_owned, SignalError};
use crate::backstop::{Breach, ComputeVerdict, OverCapAction, OwnerTime};
use crate::names::ApiState;
use crate::owners::{Owner, Owners};
use crate::unenforced::ProcessUse;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long after it starts the monitor resumes GPU processes it finds
/// stopped: long enough for every process to have been placed (owners are
/// looked up 16 a pass).
const LEFTOVERS_FOR: Duration = Duration::from_secs(30);

impl Monitor {
    /// Holds every container to what its node granted, from NVML's
    /// accounting: its memory cap ([`crate::backstop::memory`]) and its
    /// compute share ([`crate::backstop::compute`]).
    pub(super) fn hold_grants(&mut self, collected: &Collected, assessment: &mut Assessment) {
        // Only the regions whose containers (or pods) have a process on a
        // GPU need their grants.
        let owned: HashSet<&str> = assessment
            .uses
            .iter()
            .filter_map(|u| match &u.owner {
                Owner::Region(key) => Some(key.as_str()),
                Owner::Pod(uid) => Some(uid.as_str()),
                Owner::Unknown => None,
            })
            .collect();
        let granted = granted(
            self.discovery.regions().filter(|r| {
                owned.contains(r.key.as_str())
                    || r.pod_uid.as_deref().is_some_and(|uid| owned.contains(uid))
            }),
            &assessment.restores,
            collected.api_state == ApiState::Disabled,
        );
        let owners = Owners::new(
            self.discovery
                .regions()
                .map(|r| (r.key.as_str(), r.pod_uid.as_deref())),
        );
        self.hold_memory(collected, assessment, &granted, &owners);
        self.hold_compute(collected, assessment, &granted, &owners);
        for (key, &index) in &assessment.container_index {
            if let Some(summary) = assessment.containers.get_mut(index) {
                summary.over_cap_kills = self.over_cap_kills.get(key).copied().unwrap_or(0);
                summary.over_share_kills = self.over_share_kills.get(key).copied().unwrap_or(0);
                summary.compute_pauses = self.compute_pauses.get(key).copied().unwrap_or(0);
            }
        }
    }

    /// A breach of a memory cap kills the process that took the container
    /// there (or is reported), logged, counted and recorded as a Warning
    /// Event.
    fn hold_memory(
        &mut self,
        collected: &Collected,
        assessment: &Assessment,
        granted: &Granted,
        owners: &Owners,
    ) {
        let breaches = self.memory_backstop.judge(
            &assessment.uses,
            &granted.caps,
            &granted.pod_of,
            collected.started,
        );
        for breach in breaches {
            self.act_on_breach(&breach, owners, &granted.pod_of, collected.started);
        }
    }

    fn act_on_breach(
        &mut self,
        breach: &Breach,
        owners: &Owners,
        pod_of: &HashMap<String, String>,
        now: Instant,
    ) {
        let key = key_of(&breach.owner, pod_of);
        let over = format!(
            "{} holds {} MiB of GPU {} as the driver counts it, over its cap of {} MiB (and {} MiB for its processes' contexts)",
            whose(&breach.owner),
            breach.used_bytes >> 20,
            breach.gpu_uuid,
            breach.cap_bytes >> 20,
            (breach.allowed_bytes - breach.cap_bytes) >> 20,
        );
        let (reason, message) = match (breach.action, breach.victim) {
            (OverCapAction::Kill, Some(victim)) => {
                let proc = &self.host_proc;
                let still_owned = |pid| owners.owner_of(pid, proc) == breach.owner;
                match signal_owned(victim.pid, still_owned, libc::SIGKILL) {
                    Ok(()) => {
                        self.memory_backstop.signalled(victim.pid, now);
                        if let Some(key) = key {
                            *self.over_cap_kills.entry(key.to_string()).or_insert(0) += 1;
                        }
                        (
                            "GPUMemoryOverCapKilled",
                            format!(
                                "{over}: process {} killed (it held {} MiB, of which the vgpu shim charged {} MiB)",
                                victim.pid,
                                victim.used_bytes >> 20,
                                victim.charged_bytes >> 20
                            ),
                        )
                    }
                    Err(SignalError::Gone { .. }) => return,
                    // Told once per process: the breach stands every pass.
                    Err(_) if !self.signal_failures.insert(victim.pid) => return,
                    Err(error) => (
                        "GPUMemoryOverCap",
                        format!(
                            "{over}: process {} could not be killed: {error}",
                            victim.pid
                        ),
                    ),
                }
            }
            _ => ("GPUMemoryOverCap", format!("{over}: reported only")),
        };
        self.tell(key, reason, message);
    }

    /// A container over its share while another waits has its GPU
    /// processes paused until it has paid the time back, then resumed;
    /// past the owed limit its busiest process is killed (or it is
    /// reported). Each episode is logged and recorded as a Warning Event.
    fn hold_compute(
        &mut self,
        collected: &Collected,
        assessment: &Assessment,
        granted: &Granted,
        owners: &Owners,
    ) {
        let launching: Vec<(Owner, String)> = assessment
            .seen
            .iter()
            .filter(|seen| seen.contender.active)
            .map(|seen| (Owner::Region(seen.key.clone()), seen.uuid.clone()))
            .collect();
        let verdict = self.compute_backstop.judge(
            &assessment.uses,
            &launching,
            &granted.shares,
            &granted.pod_of,
            collected.started,
        );
        let ComputeVerdict {
            pause,
            resume,
            began,
            past_limit,
            ..
        } = verdict;
        self.resume_leftovers(&assessment.uses, owners, collected.started);
        for (pid, owner) in resume {
            let proc = &self.host_proc;
            let still_owned = |pid| owners.owner_of(pid, proc) == owner;
            if let Err(error) = signal_owned(pid, still_owned, libc::SIGCONT) {
                tracing::debug!("process {pid} not resumed: {error}");
            }
        }
        for (pid, owner) in pause {
            let proc = &self.host_proc;
            let still_owned = |pid| owners.owner_of(pid, proc) == owner;
            match signal_owned(pid, still_owned, libc::SIGSTOP) {
                Ok(()) => {}
                Err(error) => {
                    self.compute_backstop.forget(pid);
                    if self.signal_failures.insert(pid) {
                        tracing::warn!("process {pid} could not be paused: {error}");
                    }
                }
            }
        }
        let action = self.compute_backstop.rule().action;
        for time in began {
            let key = key_of(&time.owner, &granted.pod_of);
            if let Some(key) = key {
                *self.compute_pauses.entry(key.to_string()).or_insert(0) += 1;
            }
            let what = match action {
                OverCapAction::Kill => format!(
                    "its {} GPU process(es) are paused until it has paid the time back",
                    time.pids.len()
                ),
                OverCapAction::Report => "reported only".to_string(),
            };
            let message = format!("{}: {what}", over_share(&time));
            self.tell(key, "GPUComputeOverShare", message);
        }
        for time in past_limit {
            let key = key_of(&time.owner, &granted.pod_of);
            let over = format!(
                "{} and owes {:.1} s of device time, which pausing did not pay back",
                over_share(&time),
                time.owed.as_secs_f64()
            );
            let (reason, message) = match (action, time.pids.first()) {
                (OverCapAction::Kill, Some(&victim)) => {
                    let proc = &self.host_proc;
                    let still_owned = |pid| owners.owner_of(pid, proc) == time.owner;
                    match signal_owned(victim, still_owned, libc::SIGKILL) {
                        Ok(()) => {
                            if let Some(key) = key {
                                *self.over_share_kills.entry(key.to_string()).or_insert(0) += 1;
                            }
                            (
                                "GPUComputeOverShareKilled",
                                format!("{over}: process {victim} (its busiest) killed"),
                            )
                        }
                        Err(SignalError::Gone { .. }) => continue,
                        Err(error) => (
                            "GPUComputeOverShare",
                            format!("{over}: process {victim} could not be killed: {error}"),
                        ),
                    }
                }
                _ => ("GPUComputeOverShare", format!("{over}: reported only")),
            };
            self.tell(key, reason, message);
        }
    }

    /// In the monitor's first [`LEFTOVERS_FOR`]: resumes each container
    /// GPU process found stopped when it is first seen, which a monitor
    /// before this one may have paused and could not resume (it was
    /// killed). Only then, so that a container's own job control is not
    /// fought afterwards.
    fn resume_leftovers(&mut self, uses: &[ProcessUse], owners: &Owners, now: Instant) {
        let until = *self.leftovers_until.get_or_insert(now + LEFTOVERS_FOR);
        if now >= until {
            self.leftovers_checked = HashSet::new();
            return;
        }
        for use_ in uses {
            if use_.owner == Owner::Unknown
                || !self.leftovers_checked.insert(use_.pid)
                || self
                    .compute_backstop
                    .paused()
                    .any(|(pid, _)| pid == use_.pid)
                || !self.host_proc.is_stopped(use_.pid)
            {
                continue;
            }
            let proc = &self.host_proc;
            let still_owned = |pid| owners.owner_of(pid, proc) == use_.owner;
            match signal_owned(use_.pid, still_owned, libc::SIGCONT) {
                Ok(()) => tracing::info!(
                    "resumed GPU process {} found stopped (a monitor before this one may have paused it)",
                    use_.pid
                ),
                Err(error) => tracing::debug!("process {} not resumed: {error}", use_.pid),
            }
        }
    }

    /// Resumes every process the compute backstop paused (on shutdown:
    /// nobody stays stopped by a monitor that is gone).
    pub(super) fn resume_paused(&mut self) {
        let paused: Vec<u32> = self.compute_backstop.paused().map(|(pid, _)| pid).collect();
        for &pid in &paused {
            // The monitor's own record says it stopped this process; a PID
            // reused since then is only sent a harmless continue.
            if let Err(error) = signal_owned(pid, |_| true, libc::SIGCONT) {
                tracing::debug!("process {pid} not resumed: {error}");
            }
            self.compute_backstop.forget(pid);
        }
        if !paused.is_empty() {
            tracing::info!("resumed {} paused GPU process(es)", paused.len());
        }
    }

    /// Logs `message` and records it as a Warning Event on the pod of the
    /// container `key`, when known.
    pub(super) fn tell(&self, key: Option<&str>, reason: &str, message: String) {
        tracing::warn!("{message}");
        let Some(region) = key.and_then(|key| self.discovery.get(key)) else {
            return;
        };
        let pod = region
            .pod_uid
            .as_deref()
            .and_then(|uid| self.pods.lookup(uid));
        record_event(self.events.as_ref(), &pod, region, reason, message);
    }
}

/// The region key an owner's counts and Events go to: its own, or for a
/// pod, one of its containers'.
fn key_of<'a>(owner: &'a Owner, pod_of: &'a HashMap<String, String>) -> Option<&'a str> {
    match owner {
        Owner::Region(key) => Some(key.as_str()),
        Owner::Pod(uid) => pod_of
            .iter()
            .filter(|(_, pod)| *pod == uid)
            .map(|(key, _)| key.as_str())
            .min(),
        Owner::Unknown => None,
    }
}

fn whose(owner: &Owner) -> String {
    match owner {
        Owner::Region(key) => format!("container {key}"),
        Owner::Pod(uid) => format!("pod {uid}"),
        Owner::Unknown => "a process of no pod".to_string(),
    }
}

fn over_share(time: &OwnerTime) -> String {
    format!(
        "{} took {} % of GPU {} as the driver measures it, over its share of {} %, while another container used it",
        whose(&time.owner),
        time.used_percent,
        time.gpu_uuid,
        time.share_percent
    )
}
