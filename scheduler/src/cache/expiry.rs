//! The end of an unbound decision's grace, kept by the clock.
//!
//! A decision whose pod is not bound holds its node's GPUs only for the
//! unbound grace ([`crate::cache::pods::PodRecord::unbound_fresh`]); no
//! watch event marks that moment, so a task looks for it every
//! [`SWEEP_PERIOD`] and takes the state's write lock only when a grace has
//! ended.

use crate::cache::clock::now_unix_ms;
use crate::cache::state::SharedState;
use std::sync::Arc;
use std::time::Duration;

/// How often the task looks: an expired decision is free this long after
/// its grace at the latest.
pub const SWEEP_PERIOD: Duration = Duration::from_secs(1);

/// Runs until the runtime stops: expires the unbound decisions whose
/// grace has ended ([`crate::cache::state::ClusterState::expire_unbound`]).
pub async fn expire_unbound_decisions(state: Arc<SharedState>) {
    let mut ticks = tokio::time::interval(SWEEP_PERIOD);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let now = now_unix_ms();
        let due = state
            .read()
            .next_unbound_deadline()
            .is_some_and(|deadline| deadline <= now);
        if due {
            state.update(|s| s.expire_unbound(now));
        }
    }
}
