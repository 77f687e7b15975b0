//! The filter's gate for coscheduling groups ([`crate::cache::groups`]): a pod of
//! a group passes only once its group's quorum is placed, or room is held
//! for it as one of the quorum; until then every node is turned down with
//! the reason, which kube-scheduler puts in the pod's events.

use crate::cache::gpus::contribution;
use crate::cache::groups::{Hold, HOLD_TTL_MS};
use crate::cache::pods::sidecar_names;
use crate::cache::state::ClusterState;
use crate::requests::PodRequest;
use crate::scheduler::{Own, Scheduler};
use crate::vocabulary::claims::claim_keys_held;
use crate::vocabulary::kubeshare::GroupLabels;
use k8s_openapi::api::core::v1::Pod;

/// What the gate says of a pod of a group.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Place it as any other pod.
    Open,
    /// Place it nowhere now, for this reason.
    Closed(String),
    /// The quorum may fit: plan it and hold its room.
    Plan,
}

fn threshold_text(labels: &GroupLabels) -> String {
    let text = format!("{:.6}", labels.threshold_millionths as f64 / 1e6);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The gate for pod `uid` of group `key`, as the state stands.
pub(crate) fn gate(
    state: &ClusterState,
    key: &str,
    labels: &GroupLabels,
    uid: &str,
    now_unix_ms: u64,
) -> Gate {
    let quorum = labels.quorum();
    let members = state.groups().members(key);
    let others = members.into_iter().flatten().filter(|(u, _)| *u != uid);
    for (_, member) in others.clone() {
        if member.labels.headcount != labels.headcount
            || member.labels.threshold_millionths != labels.threshold_millionths
        {
            return Gate::Closed(format!(
                "group {key}: its pods disagree (pod {} says headcount {}, threshold {}; this one {}, {}); none is placed until they agree",
                member.name,
                member.labels.headcount,
                threshold_text(&member.labels),
                labels.headcount,
                threshold_text(labels),
            ));
        }
    }
    if state.placed(uid) {
        return Gate::Open;
    }
    let placed = others.clone().filter(|(u, _)| state.placed(u)).count();
    if placed >= quorum as usize {
        return Gate::Open;
    }
    let holding: Vec<&str> = state
        .groups()
        .holds_of(key, now_unix_ms)
        .map(|hold| hold.uid.as_str())
        .filter(|held| !state.placed(held))
        .collect();
    if holding.contains(&uid) {
        return Gate::Open;
    }
    if !holding.is_empty() {
        return Gate::Closed(format!(
            "group {key}: room is held for {} of its pods being placed now; this one follows once {quorum} are placed",
            holding.len()
        ));
    }
    let live = 1 + others.filter(|(_, member)| !member.finished).count();
    if live < quorum as usize {
        return Gate::Closed(format!(
            "group {key}: {live} of its pods exist and {quorum} are needed ({} x {}) before any is placed",
            labels.headcount,
            threshold_text(labels)
        ));
    }
    Gate::Plan
}

impl Scheduler {
    /// Gate for `pod` of group `key`, planning and holding its quorum's room
    /// when it may fit: `Ok` to place the pod as any other, `Err` with the
    /// reason it may go nowhere now.
    pub(crate) fn pass_group_gate(
        &self,
        pod: &Pod,
        request: &PodRequest,
        key: &str,
        labels: &GroupLabels,
        now_unix_ms: u64,
    ) -> Result<(), String> {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let settled = |gate| match gate {
            Gate::Open => Some(Ok(())),
            Gate::Closed(why) => Some(Err(why)),
            Gate::Plan => None,
        };
        if let Some(answer) = settled(gate(&self.state().read(), key, labels, uid, now_unix_ms)) {
            return answer;
        }
        self.state().update(|state| {
            // Another call may have planned while the lock was let go.
            match settled(gate(state, key, labels, uid, now_unix_ms)) {
                Some(answer) => answer,
                None => self.plan_quorum(state, pod, request, key, labels, now_unix_ms),
            }
        })
    }

    /// Holds room for as many of group `key`'s unplaced pods as its quorum
    /// still needs, `pod` first, or holds nothing and says why not.
    fn plan_quorum(
        &self,
        state: &mut ClusterState,
        pod: &Pod,
        request: &PodRequest,
        key: &str,
        labels: &GroupLabels,
        now_unix_ms: u64,
    ) -> Result<(), String> {
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let quorum = labels.quorum() as usize;
        let members = state.groups().members(key).cloned().unwrap_or_default();
        let placed = members.keys().filter(|u| state.placed(u)).count();
        let needed = quorum.saturating_sub(placed);
        let mut order: Vec<(String, Pod)> = vec![(uid.to_string(), pod.clone())];
        let mut others: Vec<_> = members
            .into_iter()
            .filter(|(u, m)| u != uid && !m.finished && !state.placed(u))
            .collect();
        others.sort_by(|a, b| a.1.name.cmp(&b.1.name));
        order.extend(others.into_iter().map(|(u, m)| (u, m.pod)));
        let mut names: Vec<String> = state.nodes().map(|(name, _)| name.clone()).collect();
        names.sort();
        let mut held = 0usize;
        let mut last_miss = String::new();
        for (member_uid, member_pod) in &order {
            if held == needed {
                break;
            }
            let member_request = if member_uid == uid {
                request.clone()
            } else {
                match self.parse(member_pod) {
                    Ok(parsed) => parsed,
                    Err(why) => {
                        last_miss = why;
                        continue;
                    }
                }
            };
            if member_request.is_empty() {
                held += 1;
                continue;
            }
            match self.place_member(
                state,
                key,
                member_uid,
                member_pod,
                &member_request,
                &names,
                now_unix_ms,
            ) {
                Ok(hold) => {
                    state.groups_mut().hold(hold, now_unix_ms);
                    held += 1;
                }
                Err(why) => last_miss = why,
            }
        }
        if held < needed {
            state.groups_mut().release(key, now_unix_ms);
            let why = if last_miss.is_empty() {
                String::new()
            } else {
                format!(" ({last_miss})")
            };
            return Err(format!(
                "group {key}: only {held} of the {needed} pods it still needs to place fit at once now{why}; none is placed until {quorum} can be"
            ));
        }
        tracing::info!(
            "group {key}: room held for {held} pod(s), {placed} placed already, quorum {quorum}"
        );
        Ok(())
    }

    /// A place for one member of group `key` on the first node (by name) where it fits
    /// beside everything placed and held; the reason from the last node
    /// when there is none.
    #[allow(clippy::too_many_arguments)]
    fn place_member(
        &self,
        state: &ClusterState,
        key: &str,
        uid: &str,
        pod: &Pod,
        request: &PodRequest,
        names: &[String],
        now_unix_ms: u64,
    ) -> Result<Hold, String> {
        let own = Own {
            uid,
            counted_node: state.counted_node_of(uid),
            claims: claim_keys_held(pod),
            evicted: Vec::new(),
        };
        let policy = request.gpu_policy.unwrap_or(self.config().gpu_policy);
        let mut scratch = crate::fit::Scratch::default();
        let mut why = String::from("no node has vGPUs");
        for name in names {
            match self.evaluate(
                state,
                name,
                &own,
                request,
                policy,
                now_unix_ms,
                &mut scratch,
            ) {
                Ok(_) => {
                    let decision = self
                        .decision(state, name, request, &scratch, now_unix_ms)
                        .ok_or_else(|| format!("node {name} is gone"))?;
                    return Ok(Hold {
                        group: key.to_string(),
                        uid: uid.to_string(),
                        node: name.clone(),
                        contribution: contribution(&decision, &sidecar_names(pod), false),
                        expires_unix_ms: now_unix_ms + HOLD_TTL_MS,
                    });
                }
                Err(rejection) => {
                    why = format!(
                        "pod {}: {name}: {}",
                        pod.metadata.name.as_deref().unwrap_or(""),
                        rejection.message
                    )
                }
            }
        }
        Err(why)
    }
}
