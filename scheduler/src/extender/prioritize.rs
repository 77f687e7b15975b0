//! `POST /prioritize`: scores 0 to 10 for kube-scheduler's candidates.

use crate::cache::clock::now_unix_ms;
use crate::extender::filter::{candidates, FilterError};
use crate::extender::reply::{ErrorBody, Reply};
use crate::extender::scheduler::Scheduler;
use crate::extender::wire::{ExtenderArgs, MAX_EXTENDER_PRIORITY};
use crate::placement::pod_to_place::PodToPlace;
use crate::placement::scores::score_nodes;
use crate::placement::snapshot::Snapshot;
use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use std::hash::BuildHasher;
use vgpu_cluster::report::with_causes;

/// `HostPriority`, written from a borrowed name.
#[derive(Serialize)]
struct Score<'a> {
    #[serde(rename = "Host")]
    host: &'a str,
    #[serde(rename = "Score")]
    score: i64,
}

impl Scheduler {
    /// `POST /prioritize`.
    pub fn prioritize(&self, body: &[u8]) -> Reply {
        let (args, pod) = match ExtenderArgs::read(body) {
            Ok(read) => read,
            Err(error) => {
                return Reply::json(
                    error.status(),
                    &ErrorBody {
                        error: error.to_string(),
                    },
                )
            }
        };
        let refused = |error: FilterError| {
            Reply::json(
                400,
                &ErrorBody {
                    error: with_causes(&error),
                },
            )
        };
        let read = pod
            .as_ref()
            .ok_or(FilterError::NoPod)
            .and_then(|pod| Ok((pod, candidates(&args)?)));
        let (pod, names) = match read {
            Ok(read) => read,
            Err(error) => return refused(error),
        };
        let borrowed: Vec<&str> = names.iter().map(AsRef::as_ref).collect();
        match self.prioritize_scores(pod, &borrowed) {
            Ok(list) => Reply::json_sized(200, &list, 16 + 40 * list.len()),
            Err(error) => refused(error),
        }
    }

    /// Scores 0 to 10; nodes the pod does not fit get 0. The loads come
    /// from the filter call just before, when there was one for this pod
    /// version in the last seconds.
    fn prioritize_scores<'a>(
        &self,
        pod: &Pod,
        names: &[&'a str],
    ) -> Result<Vec<Score<'a>>, FilterError> {
        self.check_leading()?;
        let zero = |names: &[&'a str]| names.iter().map(|&host| Score { host, score: 0 }).collect();
        let request = match self.rules.parse(pod) {
            Ok(request) if !request.is_empty() => request,
            Ok(_) => return Ok(zero(names)),
            Err(error) => {
                tracing::info!(error = %with_causes(&error), "prioritize");
                return Ok(zero(names));
            }
        };
        let uid = pod.metadata.uid.as_deref().unwrap_or("");
        let version = pod.metadata.resource_version.as_deref().unwrap_or("");
        let cached = self.score_cache.recall(uid, version);
        let state = self.state.read();
        if !state.synced() {
            return Ok(zero(names));
        }
        let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
        let placing = PodToPlace::of(&state, pod);
        let known = |name: &str| {
            cached
                .as_ref()
                .and_then(|c| c.loads.get(&self.hasher.hash_one(name)).copied())
        };
        let scores = score_nodes(&snapshot, names, &placing, &request, known, |name| {
            self.random(uid, name)
        });
        drop(state);
        Ok(names
            .iter()
            .zip(scores)
            .map(|(&host, score)| Score {
                host,
                score: ((score * MAX_EXTENDER_PRIORITY as f64).round() as i64)
                    .clamp(0, MAX_EXTENDER_PRIORITY),
            })
            .collect())
    }
}
