//! A claim's GPU slice placed for the claim controller, under the chosen
//! node's lock so that no bind there races it.

use crate::api::ApiError;
use crate::cache::clock::now_unix_ms;
use crate::extender::scheduler::Scheduler;
use crate::placement::claim_slice::{
    choose_slice_node, place_slice_on, slice_request, SliceRefusal,
};
use crate::placement::snapshot::Snapshot;
use crate::vocabulary::claims::ClaimShare;
use crate::vocabulary::elastic::ElasticGpu;
use vgpu_cluster::decision::Decision;

impl Scheduler {
    /// Places the GPU slice of Elastic GPU claim `claim` (`namespace/name`)
    /// asking for `share`, as a pod holding it would be placed (the
    /// configured GPU and node policies), and has `record` write it (the
    /// ElasticGPU, answered as written), under the chosen node's lock so
    /// that no bind there races it. The outer error is the API's; the inner
    /// says why no node has room now.
    pub async fn place_slice<F, Fut>(
        &self,
        claim: &str,
        share: &ClaimShare,
        record: F,
    ) -> Result<Result<(), SliceRefusal>, ApiError>
    where
        F: FnOnce(Decision) -> Fut,
        Fut: std::future::Future<Output = Result<ElasticGpu, ApiError>>,
    {
        let request = match slice_request(&self.rules, claim, share) {
            Ok(request) => request,
            Err(why) => return Ok(Err(why)),
        };
        let chosen = {
            let state = self.state.read();
            let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
            match choose_slice_node(&snapshot, claim, &request, |node| self.random(claim, node)) {
                Ok(chosen) => chosen,
                Err(why) => return Ok(Err(why)),
            }
        };
        let lock = self.node_lock(&chosen);
        let _guard = lock.lock().await;
        let decision = {
            let state = self.state.read();
            let snapshot = Snapshot::new(&state, &self.rules, now_unix_ms());
            match place_slice_on(&snapshot, &chosen, claim, &request) {
                Ok(decision) => decision,
                Err(why) => return Ok(Err(why)),
            }
        };
        let written = record(decision).await?;
        self.state.update(|s| s.apply_reservation(&written, true));
        Ok(Ok(()))
    }
}
