//! The cluster as placement reads it.

use crate::cache::state::ClusterState;
use crate::placement::rules::Rules;

/// The state at one instant under the rules: every placement function is
/// pure over it, so each can be tested on a state built from objects,
/// without an API server.
#[derive(Clone, Copy, Debug)]
pub struct Snapshot<'a> {
    pub state: &'a ClusterState,
    pub rules: &'a Rules,
    /// The instant, in milliseconds since the Unix epoch.
    pub now_unix_ms: u64,
}

impl<'a> Snapshot<'a> {
    pub fn new(state: &'a ClusterState, rules: &'a Rules, now_unix_ms: u64) -> Self {
        Self {
            state,
            rules,
            now_unix_ms,
        }
    }
}
