//! The filter's gate for coscheduling groups ([`crate::cache::groups`]): a
//! pod of a group passes only once its group's quorum is placed, or room is
//! held for it as one of the quorum; until then every node is turned down
//! with the reason, which kube-scheduler puts in the pod's events.

use crate::cache::gpus::contribution;
use crate::cache::groups::{Hold, HOLD_TTL_MS};
use crate::cache::pods::sidecar_names;
use crate::cache::state::{ClusterState, SharedState};
use crate::placement::fit::packing::Scratch;
use crate::placement::pod_to_place::{NamespaceHeld, PodToPlace};
use crate::placement::rejection::Rejection;
use crate::placement::rules::{PodRequestError, Rules};
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::claims::claim_keys_held;
use crate::vocabulary::kubeshare::GroupLabels;
use k8s_openapi::api::core::v1::Pod;
use thiserror::Error;
use vgpu_cluster::report::with_causes;
use vgpu_cluster::requests::PodRequest;

/// What the gate says of a pod of a group.
#[derive(Debug, PartialEq, Eq)]
pub enum Gate {
    /// Place it as any other pod.
    Open,
    /// Place it nowhere now, for this reason.
    Closed(GroupWait),
    /// The quorum may fit: plan it and hold its room.
    Plan,
}

/// Why a pod of a group may go nowhere now.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GroupWait {
    #[error(
        "group {group}: its pods disagree (pod {other} says headcount {other_headcount}, threshold {other_threshold}; \
         this one {headcount}, {threshold}); none is placed until they agree"
    )]
    Disagree {
        group: String,
        other: String,
        other_headcount: u32,
        other_threshold: String,
        headcount: u32,
        threshold: String,
    },
    #[error(
        "group {group}: room is held for {holding} of its pods being placed now; this one follows once {quorum} are placed"
    )]
    HeldForOthers {
        group: String,
        holding: usize,
        quorum: u32,
    },
    #[error(
        "group {group}: {live} of its pods exist and {quorum} are needed ({headcount} x {threshold}) before any is placed"
    )]
    TooFew {
        group: String,
        live: usize,
        quorum: u32,
        headcount: u32,
        threshold: String,
    },
    #[error(
        "group {group}: only {held} of the {needed} pods it still needs to place fit at once now{}; \
         none is placed until {quorum} can be",
        last_miss.as_ref().map(|miss| format!(" ({miss})")).unwrap_or_default()
    )]
    QuorumDoesNotFit {
        group: String,
        held: usize,
        needed: usize,
        quorum: usize,
        /// Why the last pod tried did not fit.
        last_miss: Option<Box<MemberMiss>>,
    },
}

/// Why one pod of a quorum being planned has no place.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum MemberMiss {
    #[error("{}", with_causes(.0))]
    Request(PodRequestError),
    #[error("no node has vGPUs")]
    NoNodes,
    #[error("node {0} is gone")]
    NodeGone(String),
    #[error("pod {pod}: {node}: {rejection}")]
    Rejected {
        pod: String,
        node: String,
        rejection: Rejection,
    },
}

fn threshold_text(labels: &GroupLabels) -> String {
    let text = format!("{:.6}", labels.threshold_millionths as f64 / 1e6);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The gate for pod `uid` of group `key`, as the state stands.
pub fn gate(
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
            return Gate::Closed(GroupWait::Disagree {
                group: key.to_string(),
                other: member.name.clone(),
                other_headcount: member.labels.headcount,
                other_threshold: threshold_text(&member.labels),
                headcount: labels.headcount,
                threshold: threshold_text(labels),
            });
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
        return Gate::Closed(GroupWait::HeldForOthers {
            group: key.to_string(),
            holding: holding.len(),
            quorum,
        });
    }
    let live = 1 + others.filter(|(_, member)| !member.finished).count();
    if live < quorum as usize {
        return Gate::Closed(GroupWait::TooFew {
            group: key.to_string(),
            live,
            quorum,
            headcount: labels.headcount,
            threshold: threshold_text(labels),
        });
    }
    Gate::Plan
}

/// Gate for `pod` of group `key`, planning and holding its quorum's room
/// in `shared` when it may fit: `Ok` to place the pod as any other, `Err`
/// with the reason it may go nowhere now.
pub fn pass_gate(
    shared: &SharedState,
    rules: &Rules,
    pod: &Pod,
    request: &PodRequest,
    group: (&str, &GroupLabels),
    now_unix_ms: u64,
) -> Result<(), GroupWait> {
    let (key, labels) = group;
    let uid = pod.metadata.uid.as_deref().unwrap_or("");
    let settled = |gate| match gate {
        Gate::Open => Some(Ok(())),
        Gate::Closed(why) => Some(Err(why)),
        Gate::Plan => None,
    };
    if let Some(answer) = settled(gate(&shared.read(), key, labels, uid, now_unix_ms)) {
        return answer;
    }
    shared.update(|state| {
        // Another call may have planned while the lock was let go.
        match settled(gate(state, key, labels, uid, now_unix_ms)) {
            Some(answer) => answer,
            None => plan_quorum(state, rules, pod, request, group, now_unix_ms),
        }
    })
}

/// Holds room in `state` for as many of group `key`'s unplaced pods as its
/// quorum still needs, `pod` first, or holds nothing and says why not.
pub fn plan_quorum(
    state: &mut ClusterState,
    rules: &Rules,
    pod: &Pod,
    request: &PodRequest,
    group: (&str, &GroupLabels),
    now_unix_ms: u64,
) -> Result<(), GroupWait> {
    let (key, labels) = group;
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
    let mut last_miss = None;
    for (member_uid, member_pod) in &order {
        if held == needed {
            break;
        }
        let member_request = if member_uid == uid {
            request.clone()
        } else {
            match rules.parse(member_pod) {
                Ok(parsed) => parsed,
                Err(why) => {
                    last_miss = Some(Box::new(MemberMiss::Request(why)));
                    continue;
                }
            }
        };
        if member_request.is_empty() {
            held += 1;
            continue;
        }
        let snapshot = Snapshot::new(state, rules, now_unix_ms);
        match place_member(
            &snapshot,
            key,
            member_uid,
            member_pod,
            &member_request,
            &names,
        ) {
            Ok(hold) => {
                state.groups_mut().hold(hold, now_unix_ms);
                held += 1;
            }
            Err(why) => last_miss = Some(Box::new(why)),
        }
    }
    if held < needed {
        state.groups_mut().release(key, now_unix_ms);
        return Err(GroupWait::QuorumDoesNotFit {
            group: key.to_string(),
            held,
            needed,
            quorum,
            last_miss,
        });
    }
    tracing::info!(
        "group {key}: room held for {held} pod(s), {placed} placed already, quorum {quorum}"
    );
    Ok(())
}

/// A place for one member of group `key` on the first node (by name) where
/// it fits beside everything placed and held; the reason from the last
/// node when there is none.
fn place_member(
    snapshot: &Snapshot<'_>,
    key: &str,
    uid: &str,
    pod: &Pod,
    request: &PodRequest,
    names: &[String],
) -> Result<Hold, MemberMiss> {
    let state = snapshot.state;
    let member = PodToPlace {
        uid,
        counted_node: state.counted_node_of(uid),
        claims: claim_keys_held(pod),
        evicted: Vec::new(),
        quota: NamespaceHeld::of(state, pod.metadata.namespace.as_deref().unwrap_or(""), uid),
    };
    let policy = request.gpu_policy.unwrap_or(snapshot.rules.gpu_policy);
    let mut scratch = Scratch::default();
    let mut why = MemberMiss::NoNodes;
    for name in names {
        match snapshot.evaluate(name, &member, request, policy, &mut scratch) {
            Ok(_) => {
                let decision = snapshot
                    .decision(name, request, &scratch)
                    .ok_or_else(|| MemberMiss::NodeGone(name.clone()))?;
                return Ok(Hold {
                    group: key.to_string(),
                    uid: uid.to_string(),
                    node: name.clone(),
                    contribution: contribution(&decision, &sidecar_names(pod), false),
                    expires_unix_ms: snapshot.now_unix_ms + HOLD_TTL_MS,
                });
            }
            Err(rejection) => {
                why = MemberMiss::Rejected {
                    pod: pod.metadata.name.clone().unwrap_or_default(),
                    node: name.clone(),
                    rejection,
                }
            }
        }
    }
    Err(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::book::Book;
    use crate::cache::clock::now_unix_ms;
    use crate::cache::fixtures::{asking_vgpus, labelled, node};
    use crate::cache::state::listed;
    use crate::placement::fit::packing::Scratch;
    use crate::vocabulary::kubeshare::{group_of, GROUP_HEADCOUNT_LABEL, GROUP_NAME_LABEL};

    /// Pod `uid` of group `ns/g` of `headcount`, asking for one vGPU of
    /// `memory_gib`.
    fn member(uid: &str, headcount: &str, memory_gib: u64) -> Pod {
        let pod = asking_vgpus(uid, 1, memory_gib * 1024, 10);
        labelled(
            labelled(pod, GROUP_NAME_LABEL, "g"),
            GROUP_HEADCOUNT_LABEL,
            headcount,
        )
    }

    fn gate_of(state: &ClusterState, pod: &Pod) -> Gate {
        let (key, labels) = group_of(pod).expect("labels").expect("a group");
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        gate(state, &key, &labels, uid, now_unix_ms())
    }

    fn plan(state: &mut ClusterState, pod: &Pod) -> Result<(), GroupWait> {
        let rules = Rules::default();
        let request = rules.parse(pod).expect("request");
        let (key, labels) = group_of(pod).expect("labels").expect("a group");
        plan_quorum(state, &rules, pod, &request, (&key, &labels), now_unix_ms())
    }

    #[test]
    fn no_pod_is_placed_until_the_quorum_exists_and_agrees() {
        let alone = member("m1", "2", 4);
        let state = listed(vec![node("n1", 2)], vec![alone.clone()]);
        let Gate::Closed(why) = gate_of(&state, &alone) else {
            panic!("the gate opened for one pod of two");
        };
        assert_eq!(
            why.to_string(),
            "group ns/g: 1 of its pods exist and 2 are needed (2 x 1) before any is placed"
        );
        let state = listed(
            vec![node("n1", 2)],
            vec![alone.clone(), member("m2", "3", 4)],
        );
        assert!(matches!(
            gate_of(&state, &alone),
            Gate::Closed(GroupWait::Disagree {
                other_headcount: 3,
                headcount: 2,
                ..
            })
        ));
        let state = listed(
            vec![node("n1", 2)],
            vec![alone.clone(), member("m2", "2", 4)],
        );
        assert_eq!(gate_of(&state, &alone), Gate::Plan);
    }

    #[test]
    fn a_quorum_that_fits_gets_its_room_held_and_others_wait_for_it() {
        let (m1, m2, m3) = (
            member("m1", "2", 16),
            member("m2", "2", 16),
            member("m3", "2", 16),
        );
        let mut state = listed(
            vec![node("n1", 2)],
            vec![m1.clone(), m2.clone(), m3.clone()],
        );
        assert_eq!(plan(&mut state, &m1), Ok(()));
        // m1 and the first other by name (m2) are held, one per GPU.
        let now = now_unix_ms();
        let mut held: Vec<&str> = state
            .groups()
            .holds_of("ns/g", now)
            .map(|hold| hold.uid.as_str())
            .collect();
        held.sort_unstable();
        assert_eq!(held, vec!["m1", "m2"]);
        assert_eq!(gate_of(&state, &m1), Gate::Open);
        assert_eq!(gate_of(&state, &m2), Gate::Open);
        assert_eq!(
            gate_of(&state, &m3),
            Gate::Closed(GroupWait::HeldForOthers {
                group: "ns/g".into(),
                holding: 2,
                quorum: 2,
            })
        );
        // The held room is taken for every other pod.
        let rules = Rules::default();
        let snapshot = Snapshot::new(&state, &rules, now);
        let stranger = asking_vgpus("s", 1, 16 * 1024, 10);
        let request = rules.parse(&stranger).expect("request");
        let placing = PodToPlace::of(&state, &stranger);
        assert!(snapshot
            .evaluate(
                "n1",
                &placing,
                &request,
                rules.gpu_policy,
                &mut Scratch::default()
            )
            .is_err());
    }

    #[test]
    fn a_quorum_that_does_not_fit_holds_nothing_and_says_why() {
        let (m1, m2) = (member("m1", "2", 16), member("m2", "2", 16));
        let mut state = listed(vec![node("n1", 1)], vec![m1.clone(), m2.clone()]);
        match plan(&mut state, &m1) {
            Err(GroupWait::QuorumDoesNotFit {
                held: 1,
                needed: 2,
                quorum: 2,
                last_miss: Some(miss),
                ..
            }) => match *miss {
                MemberMiss::Rejected {
                    pod,
                    node,
                    rejection,
                } => {
                    assert_eq!((pod.as_str(), node.as_str()), ("m2", "n1"));
                    assert!(!rejection.is_permanent(), "{rejection}");
                }
                other => panic!("expected m2 turned down on n1, got {other:?}"),
            },
            other => panic!("expected the quorum not to fit, got {other:?}"),
        }
        assert_eq!(state.groups().holds_of("ns/g", now_unix_ms()).count(), 0);
        // Through the shared state, as the filter asks.
        let shared = SharedState::new();
        shared.update(|s| {
            s.relist(vec![node("n1", 1)]);
            s.relist(vec![crate::cache::fixtures::lease("n1", 40, 0)]);
            s.relist(vec![m1.clone(), m2.clone()]);
        });
        let rules = Rules::default();
        let request = rules.parse(&m1).expect("request");
        let (key, labels) = group_of(&m1).expect("labels").expect("a group");
        let answer = pass_gate(
            &shared,
            &rules,
            &m1,
            &request,
            (&key, &labels),
            now_unix_ms(),
        );
        let why = answer.expect_err("no room for two");
        assert!(
            why.to_string().starts_with(
                "group ns/g: only 1 of the 2 pods it still needs to place fit at once now (pod m2: n1: "
            ),
            "{why}"
        );
    }
}
