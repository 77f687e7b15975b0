//! Leader election for running more than one extender replica.
//!
//! The extender keeps in memory what makes its binds safe (one lock per
//! node, decisions recorded before the API server has echoed them), so
//! only one replica may filter, prioritize and bind at a time. Replicas
//! elect that one on a `coordination.k8s.io/v1` Lease of their own (the
//! extender's, not kube-scheduler's). With `follow`, a replica stands for
//! election only while the kube-scheduler beside it (in the same pod, so
//! its identity starts with our pod name and `_`) holds kube-scheduler's
//! Lease, and gives its own Lease up when that scheduler loses its: the
//! extender that serves is always the one the scheduling kube-scheduler
//! calls.
//!
//! Timing follows kube-scheduler's defaults: a Lease lasts 15 s, the holder
//! renews every 2 s and stops serving when it has not renewed for 10 s, so
//! it has stopped before anyone else may take the Lease over. A replica
//! judges a Lease expired by its own clock: when the Lease has not changed
//! for its duration since this replica first saw it (clocks of different
//! machines need not agree).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What and how to elect.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub lease_name: String,
    pub namespace: String,
    /// This replica's name (its pod's name).
    pub identity: String,
    /// kube-scheduler's Lease, in the same namespace, to follow.
    pub follow: Option<String>,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaderConfig {
    /// kube-scheduler's default timing.
    pub fn new(lease_name: String, namespace: String, identity: String) -> Self {
        Self {
            lease_name,
            namespace,
            identity,
            follow: None,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Whether this replica may serve now, shared by the election loop and the
/// verbs.
#[derive(Debug)]
pub struct Leadership {
    origin: Instant,
    /// Serving until this many milliseconds after `origin` (0: not).
    serving_until_ms: AtomicU64,
    /// The holder last seen, for messages.
    holder: Mutex<String>,
    /// Counts the times this replica started to serve (what was done
    /// while another led must be looked at again).
    terms: tokio::sync::watch::Sender<u64>,
}

impl Default for Leadership {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            serving_until_ms: AtomicU64::new(0),
            holder: Mutex::new(String::new()),
            terms: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Leadership {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Whether this replica holds the Lease and renewed it recently enough.
    pub fn serving(&self) -> bool {
        self.now_ms() < self.serving_until_ms.load(Ordering::Acquire)
    }

    /// Why this replica does not serve, in words for kube-scheduler's events.
    pub fn standing_by(&self) -> String {
        let holder = self.holder.lock().map(|h| h.clone()).unwrap_or_default();
        if holder.is_empty() {
            "this vgpu-scheduler replica is not the leader (no replica leads yet); kube-scheduler will retry".into()
        } else {
            format!("this vgpu-scheduler replica is not the leader ({holder} is); kube-scheduler will retry")
        }
    }

    /// A receiver that sees every later start of a term.
    pub fn terms(&self) -> tokio::sync::watch::Receiver<u64> {
        self.terms.subscribe()
    }

    fn renewed(&self, at: Instant, deadline: Duration) {
        let was_serving = self.serving();
        let until = match at.checked_duration_since(self.origin) {
            Some(since) => since + deadline,
            None => deadline.saturating_sub(self.origin - at),
        };
        let until = until.as_millis() as u64;
        self.serving_until_ms.store(until, Ordering::Release);
        if !was_serving && self.serving() {
            self.terms.send_modify(|terms| *terms += 1);
        }
    }

    fn stop(&self) {
        self.serving_until_ms.store(0, Ordering::Release);
    }

    fn saw_holder(&self, holder: &str) {
        if let Ok(mut seen) = self.holder.lock() {
            if seen.as_str() != holder {
                *seen = holder.to_string();
            }
        }
    }
}

/// The Lease as last seen, to judge expiry by this replica's clock.
struct Observed {
    holder: String,
    renew: Option<String>,
    since: Instant,
}

/// The election loop: runs until the task is dropped. Call [`release_lease`] on
/// shutdown.
pub async fn run(client: Client, config: LeaderConfig, leadership: Arc<Leadership>) {
    let leases: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut observed: Option<Observed> = None;
    let mut leading = false;
    loop {
        let started = Instant::now();
        let eligible = match &config.follow {
            None => true,
            Some(name) => match leases.get_opt(name).await {
                Ok(lease) => {
                    let holder = lease
                        .and_then(|l| l.spec)
                        .and_then(|s| s.holder_identity)
                        .unwrap_or_default();
                    holder.starts_with(&format!("{}_", config.identity))
                }
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "reading kube-scheduler's Lease {name}"
                    );
                    leading // keep what we had until the renew deadline decides
                }
            },
        };
        if eligible {
            match try_acquire_or_renew(&leases, &config, &mut observed).await {
                Ok(holder) => {
                    leadership.saw_holder(&holder);
                    let now_leading = holder == config.identity;
                    if now_leading {
                        leadership.renewed(started, config.renew_deadline);
                    }
                    if now_leading != leading {
                        if now_leading {
                            tracing::info!(lease = %config.lease_name, "this replica leads: it filters, prioritizes and binds");
                        } else {
                            leadership.stop();
                            tracing::info!(lease = %config.lease_name, %holder, "this replica lost the lead and stands by");
                        }
                        leading = now_leading;
                    }
                }
                Err(error) => {
                    // Serving stops by itself at the renew deadline.
                    tracing::warn!(error = &error as &dyn std::error::Error, lease = %config.lease_name, "leader election: the Lease could not be read or written");
                }
            }
        } else if leading {
            tracing::info!(lease = %config.lease_name, "the kube-scheduler beside this replica no longer leads: giving up the extender's Lease");
            leadership.stop();
            leading = false;
            release(&leases, &config).await;
        }
        tokio::time::sleep(config.retry_period.saturating_sub(started.elapsed())).await;
    }
}

fn now_micro() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Takes or renews the Lease when it is ours, free or expired; answers its
/// holder afterwards.
async fn try_acquire_or_renew(
    leases: &Api<Lease>,
    config: &LeaderConfig,
    observed: &mut Option<Observed>,
) -> Result<String, kube::Error> {
    let duration_seconds = config.lease_duration.as_secs().max(1) as i32;
    let Some(mut lease) = leases.get_opt(&config.lease_name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(config.lease_name.clone()),
                namespace: Some(config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(config.identity.clone()),
                lease_duration_seconds: Some(duration_seconds),
                acquire_time: Some(now_micro()),
                renew_time: Some(now_micro()),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(config.identity.clone()),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(String::new()),
            Err(error) => Err(error),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let renew = spec.renew_time.as_ref().map(|t| t.0.to_string());
    let changed = observed
        .as_ref()
        .is_none_or(|o| o.holder != holder || o.renew != renew);
    if changed {
        *observed = Some(Observed {
            holder: holder.clone(),
            renew: renew.clone(),
            since: Instant::now(),
        });
    }
    let held_for = Duration::from_secs(
        spec.lease_duration_seconds
            .unwrap_or(duration_seconds)
            .max(1) as u64,
    );
    let expired = observed
        .as_ref()
        .is_some_and(|o| o.since.elapsed() >= held_for);
    let ours = holder == config.identity;
    if !(ours || holder.is_empty() || expired) {
        return Ok(holder);
    }
    if !ours {
        spec.acquire_time = Some(now_micro());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.holder_identity = Some(config.identity.clone());
    spec.lease_duration_seconds = Some(duration_seconds);
    spec.renew_time = Some(now_micro());
    // The resourceVersion read above makes this a compare-and-swap: of two
    // replicas taking an expired Lease, one wins.
    match leases
        .replace(&config.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => Ok(config.identity.clone()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(holder),
        Err(error) => Err(error),
    }
}

/// Gives the Lease up if this replica holds it, so another may take it at
/// once instead of waiting for it to expire.
pub async fn release_lease(client: Client, config: &LeaderConfig) {
    let leases: Api<Lease> = Api::namespaced(client, &config.namespace);
    release(&leases, config).await;
}

async fn release(leases: &Api<Lease>, config: &LeaderConfig) {
    let Ok(Some(mut lease)) = leases.get_opt(&config.lease_name).await else {
        return;
    };
    let Some(spec) = lease.spec.as_mut() else {
        return;
    };
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(now_micro());
    match leases
        .replace(&config.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => tracing::info!(lease = %config.lease_name, "gave the extender's Lease up"),
        Err(error) => tracing::warn!(
            error = &error as &dyn std::error::Error,
            "giving the Lease up failed; it expires by itself"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_ends_at_the_renew_deadline() {
        let leadership = Leadership::default();
        assert!(!leadership.serving());
        leadership.renewed(Instant::now(), Duration::from_secs(10));
        assert!(leadership.serving());
        leadership.renewed(
            Instant::now() - Duration::from_secs(11),
            Duration::from_secs(10),
        );
        assert!(!leadership.serving());
        leadership.renewed(Instant::now(), Duration::from_secs(10));
        leadership.stop();
        assert!(!leadership.serving());
    }

    #[test]
    fn a_term_starts_each_time_serving_starts() {
        let leadership = Leadership::default();
        let terms = leadership.terms();
        leadership.renewed(Instant::now(), Duration::from_secs(10));
        leadership.renewed(Instant::now(), Duration::from_secs(10));
        assert_eq!(*terms.borrow(), 1, "a renewal while serving starts none");
        leadership.stop();
        leadership.renewed(Instant::now(), Duration::from_secs(10));
        assert_eq!(*terms.borrow(), 2);
    }

    #[test]
    fn standing_by_names_the_leader() {
        let leadership = Leadership::default();
        assert!(leadership.standing_by().contains("no replica leads yet"));
        leadership.saw_holder("vgpu-scheduler-abc");
        assert!(leadership.standing_by().contains("vgpu-scheduler-abc is"));
    }
}
