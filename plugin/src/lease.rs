//! Renewing the node's Lease ([`vgpu_cluster::node_lease`]), by which the
//! scheduler extender knows this plugin is alive: at start, then every
//! quarter of the Lease's duration, until shutdown.

use crate::cluster::Cluster;
use crate::service::stopped;
use tokio::sync::watch;
use vgpu_cluster::node_lease::renew_interval;

/// Renews the Lease every quarter of `duration_seconds` until `shutdown`
/// becomes true. A failed renewal is retried at the next interval (the
/// Lease outlives three of them); a failure is logged once, and the
/// recovery after it.
pub async fn renew(cluster: Cluster, duration_seconds: u32, mut shutdown: watch::Receiver<bool>) {
    let interval = renew_interval(duration_seconds);
    let mut failing = false;
    loop {
        match cluster.renew_lease(duration_seconds).await {
            Ok(()) => {
                if failing {
                    tracing::info!("node Lease renewed again");
                } else {
                    tracing::trace!("node Lease renewed");
                }
                failing = false;
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "renewing the node Lease (retrying every {} ms; the extender places no new pods here once it runs out, {} s after the last renewal)",
                        interval.as_millis(),
                        duration_seconds
                    );
                }
                failing = true;
            }
        }
        tokio::select! {
            () = stopped(&mut shutdown) => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}
