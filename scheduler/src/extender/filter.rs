//! `POST /filter`: which of kube-scheduler's candidate nodes the pod fits
//! on; the loads computed are kept for the prioritize call that follows.

use crate::cache::clock::now_unix_ms;
use crate::extender::reply::Reply;
use crate::extender::scheduler::{NotServing, Scheduler};
use crate::extender::score_cache::ScoreEntry;
use crate::extender::wire::{ExtenderArgs, ExtenderFilterResult, FailedNodesMap, RawNodeList};
use crate::placement::coscheduling::pass_gate;
use crate::placement::filter::{filter_nodes, NodeVerdicts};
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::rules::{pod_key, PodRequestError};
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::kubeshare::{group_of, KubeShareError};
use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::hash::BuildHasher;
use std::time::Instant;
use thiserror::Error;
use vgpu_cluster::report::with_causes;

/// Why a filter call gets no verdicts (the answer's `Error`).
#[derive(Debug, Error)]
pub enum FilterError {
    #[error(transparent)]
    NotServing(#[from] NotServing),
    #[error("ExtenderArgs has no Pod")]
    NoPod,
    #[error("ExtenderArgs has neither NodeNames nor Nodes")]
    NoCandidates,
    #[error(transparent)]
    Request(#[from] PodRequestError),
    #[error(
        "vgpu-scheduler is still listing pods and nodes from the Kubernetes API; retry shortly"
    )]
    NotListed,
    #[error("pod {pod}")]
    GroupLabels {
        pod: String,
        #[source]
        source: KubeShareError,
    },
}

/// `ExtenderFilterResult`, written from borrowed parts.
#[derive(Serialize)]
struct FilterReply<'a> {
    #[serde(rename = "Nodes")]
    nodes: Option<RawNodeList<'a>>,
    #[serde(rename = "NodeNames")]
    node_names: Option<&'a [&'a str]>,
    #[serde(rename = "FailedNodes")]
    failed_nodes: &'a FailedNodesMap,
    #[serde(rename = "FailedAndUnresolvableNodes")]
    failed_and_unresolvable_nodes: &'a FailedNodesMap,
    #[serde(rename = "Error")]
    error: &'a str,
}

/// Candidate node names, in the order kube-scheduler sent them (borrowed
/// from the request body unless written with escapes).
pub(super) fn candidates<'a>(args: &ExtenderArgs<'a>) -> Result<Vec<Cow<'a, str>>, FilterError> {
    if let Some(names) = &args.node_names {
        return Ok(names.iter().map(|n| n.0.clone()).collect());
    }
    if let Some(nodes) = &args.nodes {
        return Ok(nodes
            .items
            .iter()
            .flatten()
            .filter_map(|node| RawNodeList::node_name(node))
            .collect());
    }
    Err(FilterError::NoCandidates)
}

impl Scheduler {
    /// `POST /filter`.
    pub fn filter(&self, body: &[u8]) -> Reply {
        let (args, pod) = match ExtenderArgs::read(body) {
            Ok(read) => read,
            Err(error) => {
                return Reply::json(
                    error.status(),
                    &ExtenderFilterResult::error(error.to_string()),
                )
            }
        };
        let read = pod
            .as_ref()
            .ok_or(FilterError::NoPod)
            .and_then(|pod| Ok((pod, candidates(&args)?)));
        let (pod, names) = match read {
            Ok(read) => read,
            Err(error) => {
                return Reply::json(200, &ExtenderFilterResult::error(with_causes(&error)))
            }
        };
        let borrowed: Vec<&str> = names.iter().map(AsRef::as_ref).collect();
        let pod_bytes = args.pod.map_or(0, |raw| raw.get().len());
        let verdicts = match self.filter_verdicts(pod, borrowed, pod_bytes) {
            Ok(verdicts) => verdicts,
            Err(error) => {
                return Reply::json(200, &ExtenderFilterResult::error(with_causes(&error)))
            }
        };
        let passed: Vec<&str> = verdicts.fits.iter().map(|fit| fit.node).collect();
        let mut reply = FilterReply {
            nodes: None,
            node_names: None,
            failed_nodes: &verdicts.failed,
            failed_and_unresolvable_nodes: &verdicts.unresolvable,
            error: "",
        };
        if args.node_names.is_some() {
            reply.node_names = Some(&passed);
        } else if let Some(nodes) = &args.nodes {
            let keep: std::collections::HashSet<&str> = passed.iter().copied().collect();
            let passing = |node: &&RawValue| {
                RawNodeList::node_name(node).is_some_and(|name| keep.contains(name.as_ref()))
            };
            reply.nodes = Some(RawNodeList {
                metadata: nodes.metadata,
                items: Some(
                    nodes
                        .items
                        .iter()
                        .flatten()
                        .copied()
                        .filter(passing)
                        .collect(),
                ),
            });
        }
        let capacity =
            64 + 24 * passed.len() + 256 * (verdicts.failed.len() + verdicts.unresolvable.len());
        Reply::json_sized(200, &reply, capacity)
    }

    /// Which candidates fit; remembers their loads for the prioritize call
    /// that follows, and the pod (its JSON `pod_bytes` long) for the bind.
    fn filter_verdicts<'a>(
        &self,
        pod: &Pod,
        names: Vec<&'a str>,
        pod_bytes: usize,
    ) -> Result<NodeVerdicts<'a>, FilterError> {
        self.check_leading()?;
        let request = self
            .rules
            .parse(pod)
            .inspect_err(|error| tracing::info!(error = %with_causes(error), "filter"))?;
        if request.is_empty() {
            return Ok(NodeVerdicts {
                fits: names
                    .into_iter()
                    .map(|node| crate::placement::filter::Fit {
                        node,
                        load: 0.0,
                        matching: 0,
                    })
                    .collect(),
                ..NodeVerdicts::default()
            });
        }
        if !self.state.read().synced() {
            return Err(FilterError::NotListed);
        }
        if let Some(refusal) = self.confinement_refusal(pod) {
            tracing::info!("filter: {refusal}");
            return Ok(NodeVerdicts::all_unresolvable(names, &refusal.to_string()));
        }
        let group = group_of(pod).map_err(|source| FilterError::GroupLabels {
            pod: pod_key(pod),
            source,
        })?;
        if let Some((key, labels)) = group {
            let gate = pass_gate(
                &self.state,
                &self.rules,
                pod,
                &request,
                (&key, &labels),
                now_unix_ms(),
            );
            if let Err(why) = gate {
                tracing::info!("filter {}: {why}", pod_key(pod));
                return Ok(NodeVerdicts::all_failed(names, &why.to_string()));
            }
        }
        let state = self.state.read();
        let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
        let placing = PodToPlace::of(&state, pod);
        let verdicts = filter_nodes(&snapshot, names, &placing, &request);
        drop(state);
        let key = pod_key(pod);
        if verdicts.fits.is_empty() {
            let example = verdicts
                .failed
                .iter()
                .chain(&verdicts.unresolvable)
                .next()
                .map(|(node, why)| format!(" (e.g. {node}: {why})"))
                .unwrap_or_default();
            tracing::info!("filter {key}: no node fits{example}");
        } else {
            tracing::debug!("filter {key}: {} node(s) fit", verdicts.fits.len());
            let uid = pod.metadata.uid.as_deref().unwrap_or("");
            if !uid.is_empty() {
                let loads = verdicts
                    .fits
                    .iter()
                    .map(|fit| (self.hasher.hash_one(fit.node), (fit.load, fit.matching)))
                    .collect();
                self.score_cache.remember(ScoreEntry {
                    uid: uid.to_string(),
                    version: pod.metadata.resource_version.clone().unwrap_or_default(),
                    at: Instant::now(),
                    loads,
                });
                if self.config.keep_filtered_pods {
                    self.filtered_pods.remember(pod, pod_bytes);
                }
            }
        }
        Ok(verdicts)
    }
}
