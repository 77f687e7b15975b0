//! The kube-scheduler extender's verbs over HTTP, with the API writes a
//! bind makes: each verb reads its request, takes a snapshot of the cache
//! and asks [`crate::placement`], then answers (and, for a bind, records
//! the decision and binds).
//!
//! - [`wire`]: kube-scheduler's extender v1 JSON types.
//! - [`config`]: the extender's configuration.
//! - [`scheduler`]: what the verbs share ([`Scheduler`]).
//! - [`filter`], [`prioritize`], [`preempt`], [`bind`]: the verbs.
//! - [`claim_slice`]: a claim's slice placed for the claim controller.
//! - [`resize`]: running pods' resize requests answered with new
//!   decisions.
//! - [`reply`], [`score_cache`], [`filtered_pods`]: their answers, the
//!   loads filter keeps for prioritize and the pods it keeps for bind.

pub mod bind;
pub mod claim_slice;
pub mod config;
pub mod filter;
pub mod filtered_pods;
pub mod preempt;
pub mod prioritize;
pub mod reply;
pub mod resize;
pub mod scheduler;
pub mod score_cache;
pub mod wire;

pub use config::Config;
pub use scheduler::Scheduler;
