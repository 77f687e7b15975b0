//! Command-line flags.

use crate::admission::mutate::AdmissionPolicy;
use crate::admission::reach::GuardedPaths;
use crate::api::ApiSource;
use crate::extender::config::{Limits, PlacementConfinement};
use crate::extender::Config;
use crate::leader::LeaderConfig;
use clap::Parser;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;
use thiserror::Error;
use vgpu_cluster::policy::{GpuPolicy, NodePolicy};
use vgpu_cluster::requests::priority::HighPriorityClasses;
use vgpu_cluster::requests::RequestDefaultFlags;
use vgpu_cluster::resources::ShareResourceFlags;

/// kube-scheduler HTTP extender of vgpu: places pods that ask for vGPUs on
/// nodes and GPUs, and binds them.
///
/// Configure kube-scheduler with an extender whose urlPrefix points here
/// (http://127.0.0.1:39999 from a kube-scheduler in the same pod, as the
/// chart runs it), filterVerb "filter", prioritizeVerb "prioritize",
/// bindVerb "bind", preemptVerb "preempt", nodeCacheCapable true (false
/// works too, with a larger --max-request-bytes), and the vGPU resources as
/// managedResources, ignoredByScheduler false for all but the priority
/// (kube-scheduler's preemption finds victims only among pods taking what
/// it counts). nvidia-gpu-scheduler's urlPrefix
/// (.../apis/nvidia-gpu-scheduler/v1/schedule) is answered too.
/// One replica, or several with --leader-elect: per-node locks are kept in
/// memory, so only the elected replica filters, prioritizes and binds (the
/// others answer that they stand by; the webhook is served by all).
///
/// Who reaches what: --port serves every endpoint (kube-scheduler's verbs,
/// which bind pods, /debug/state and the views, which show every vGPU pod,
/// the webhooks, probes and /metrics) on --address, loopback by default,
/// where only the pod's own containers reach it. --health-address (the
/// pod's IP) serves only /healthz, /readyz and /metrics on the same port,
/// for kubelet's probes and Prometheus. --secure-port serves only what the
/// API server calls (/webhook/mutate, /convert) and the probes, over HTTPS,
/// on --secure-address. A kube-scheduler elsewhere (the Elastic GPU
/// Scheduler's or nvidia-gpu-scheduler's stanza pointing at the Service)
/// needs --address 0.0.0.0, which lets every pod that reaches the port bind
/// any pending vGPU pod and read every vGPU pod: allow it only with a
/// NetworkPolicy that admits that kube-scheduler alone.
///
/// Bind refuses pods that ask for no vGPU resource. Every request is read
/// within limits: headers and body each within --read-timeout-seconds,
/// answers read by their clients without a pause of
/// --write-timeout-seconds, bodies of at most --max-request-bytes (a bind's: 64 KiB), a pod of at
/// most 10,000 JSON objects and 200,000 values, at most 15,000 nodes a
/// request, --max-connections per listener (--max-connections-per-client
/// of them from one address) and --max-watches in all.
///
/// Pod annotations: nvidia.com/use-gputype, nvidia.com/nouse-gputype
/// (comma lists, matched as case-insensitive substrings of the GPU model),
/// nvidia.com/use-gpuuuid, nvidia.com/nouse-gpuuuid, and the policies
/// vgpu.io/gpu-scheduler-policy, vgpu.io/node-scheduler-policy (or HAMi's
/// hami.io/gpu-scheduler-policy, hami.io/node-scheduler-policy), and
/// vgpu.io/gpucores-burst (percent up to which the pod's capped vGPUs may
/// borrow idle capacity).
///
/// The Elastic GPU Scheduler's extender stanza works unchanged (with
/// --address 0.0.0.0, see above): urlPrefix
/// http://<service>:39999/scheduler, prioritizeVerb "priorities", its
/// Elastic GPU resources as managedResources without ignoredByScheduler
/// (the device plugin publishes their capacity in the node's status).
///
/// With --tls-cert/--tls-key it can also serve as a mutating admission
/// webhook (POST /webhook/mutate) that gives new vGPU pods naming no
/// scheduler the --scheduler-name, adds the GPU count to containers
/// that ask only for Elastic GPU resources, and turns KubeShare's
/// sharedgpu/ labels into vGPU requests (pods naming --scheduler-alias get
/// --scheduler-name; opportunistic ones --opportunistic-priority-class). The API server calls webhooks
/// over HTTPS only: with --secure-port, HTTPS is served there and --port
/// stays plain HTTP for kube-scheduler; without it, --port serves HTTPS
/// (every endpoint, on --address).
#[derive(Debug, Parser)]
#[command(name = "vgpu-scheduler", version, about, long_about)]
pub struct Cli {
    /// Address --port listens on, serving every endpoint: loopback, for
    /// the kube-scheduler in the same pod. 0.0.0.0 exposes kube-scheduler's
    /// verbs (which bind pods), /debug/state and the views to every client
    /// that reaches the port: only for a kube-scheduler elsewhere, behind a
    /// NetworkPolicy. Beyond loopback, a bind reads its pod from the API
    /// server rather than use the copy its filter call sent.
    #[arg(long, default_value = "127.0.0.1", value_name = "IP")]
    pub address: IpAddr,

    /// Port to listen on: plain HTTP, or HTTPS with --tls-cert/--tls-key
    /// and no --secure-port.
    #[arg(long, default_value_t = 39999)]
    pub port: u16,

    /// Also listen on this address (the pod's IP: POD_IP, as the chart
    /// sets it) at --port, serving only /healthz, /readyz and /metrics, for
    /// kubelet's probes and Prometheus. Not used when --address already
    /// covers it (0.0.0.0, ::).
    #[arg(long, env = "POD_IP", value_name = "IP")]
    pub health_address: Option<IpAddr>,

    /// A second port, serving HTTPS with --tls-cert/--tls-key (which it
    /// needs), while --port serves plain HTTP. It serves only what the API
    /// server calls (/webhook/mutate, /convert) and /healthz, /readyz.
    #[arg(long, value_name = "PORT", requires = "tls_cert")]
    pub secure_port: Option<u16>,

    /// Address --secure-port listens on (the API server reaches it through
    /// the Service).
    #[arg(long, default_value = "0.0.0.0", value_name = "IP")]
    pub secure_address: IpAddr,

    /// The largest request body of filter, prioritize, preempt and the
    /// webhooks (a bind's is at most 64 KiB). The default, 8 MiB, is what a
    /// 5,000-node cluster needs with nodeCacheCapable: a pod (at most
    /// 3 MiB) and 5,000 node names (1.22 MiB), or a preemption's victims
    /// on 500 nodes (2.56 MiB). Without nodeCacheCapable kube-scheduler
    /// sends whole Node objects (5-20 kB each): raise it to match. Each
    /// listener holds at most the larger of 32 MiB and this in bodies at
    /// once.
    #[arg(long, default_value_t = crate::extender::config::DEFAULT_MAX_BODY_BYTES as u64, value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_request_bytes: u64,

    /// How long a new connection may send nothing, how long a request's
    /// headers may take from their first byte, and then how long its body
    /// may take. A slower client's connection is closed (its body answered
    /// 408).
    #[arg(long, default_value_t = 10, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub read_timeout_seconds: u64,

    /// How long a kept-alive connection may stay idle between requests
    /// before it is closed. Keep it above how long the clients keep an idle
    /// connection (90 s for the API server and kube-scheduler), so that
    /// they close it first: a request sent on a connection the extender is
    /// closing fails, and neither retries a webhook or extender call.
    #[arg(long, default_value_t = 120, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub idle_timeout_seconds: u64,

    /// How long an answer (a watch's events too) may wait for its client
    /// to read on: a client that asks and then reads nothing is cut off
    /// after this long, and its connection closed.
    #[arg(long, default_value_t = 10, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub write_timeout_seconds: u64,

    /// Connections open at once on each listener; one more is closed as
    /// soon as it is accepted, unless its client holds fewer than the
    /// client holding the most: it then takes the place of that one's
    /// oldest connection, so pods of many addresses cannot starve the API
    /// server's calls.
    #[arg(long, default_value_t = 1024, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_connections: u32,

    /// Connections open at once on each listener from one client address
    /// (at most --max-connections): a pod that reaches the webhook port
    /// cannot hold every connection while the API server's calls wait.
    /// kube-scheduler's calls all come from one address (loopback in the
    /// chart), as do the API server's: leave them room for their bursts.
    #[arg(long, default_value_t = 256, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_connections_per_client: u32,

    /// Watches of nvidia-gpu-scheduler's views open at once; one more is
    /// answered 429.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub max_watches: u32,

    /// How long a connection is kept: then its next answer says
    /// `connection: close` (the client connects again; an idle one is
    /// closed after --idle-timeout-seconds), so a client that keeps sending
    /// requests cannot hold its connection for ever.
    #[arg(long, default_value_t = 300, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub max_connection_age_seconds: u64,

    /// PEM CA certificates whose client certificates may call
    /// kube-scheduler's verbs, /debug/state and the views on --secure-port
    /// (which needs them): a kube-scheduler elsewhere configured with such
    /// a certificate (its extender's tlsConfig certFile and keyFile)
    /// reaches them over HTTPS, any other client gets 403 (the webhooks
    /// and probes answer everyone, as without it). A client certificate
    /// none of these CAs signed fails the handshake: not for clusters whose
    /// API server presents one to webhooks.
    #[arg(long, value_name = "PATH", requires = "secure_port")]
    pub client_ca: Option<PathBuf>,

    /// PEM certificate (chain) for HTTPS; needs --tls-key. Without both,
    /// plain HTTP. Both files are read again every 30 s: a renewed pair
    /// (a Secret's volume updated in place) is served from the next
    /// handshake, without a restart.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key (PKCS#8, PKCS#1 or SEC1) for HTTPS; needs --tls-cert.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Warn in the log this many days before the served certificate
    /// expires (and every day after, until a renewed one is served); its
    /// end is on /metrics too, as
    /// vgpu_extender_certificate_expiry_timestamp_seconds.
    #[arg(long, default_value_t = 30, value_name = "DAYS",
          value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub tls_expiry_warning_days: u32,

    /// Kubeconfig file to reach the API server. Default: the pod's service
    /// account, else $KUBECONFIG or ~/.kube/config.
    #[arg(long, value_name = "PATH", conflicts_with = "api_server")]
    pub kubeconfig: Option<PathBuf>,

    /// API server URL to use without authentication (e.g. `kubectl proxy` at
    /// http://127.0.0.1:8001).
    #[arg(long, value_name = "URL")]
    pub api_server: Option<String>,

    /// How a container's GPUs are chosen on a node: fewest-tasks (the GPUs
    /// running the fewest containers), binpack (the fullest GPUs that fit),
    /// spread (the emptiest), random, or load-aware (the least busy as the
    /// node agent measures them). Per pod: annotation
    /// vgpu.io/gpu-scheduler-policy.
    #[arg(long, default_value = "fewest-tasks", value_name = "POLICY")]
    pub gpu_policy: GpuPolicy,

    /// How nodes are scored: binpack (fullest first), spread (emptiest
    /// first), random, or load-aware (the GPUs measured least busy first).
    /// Per pod: annotation vgpu.io/node-scheduler-policy.
    #[arg(long, default_value = "binpack", value_name = "POLICY")]
    pub node_policy: NodePolicy,

    /// What containers get that name no memory or compute share (the
    /// device plugins must be given the same: they check decisions
    /// against it).
    #[command(flatten)]
    pub request_defaults: RequestDefaultFlags,

    /// How long a bind waits for the node's previous vGPU pod to be admitted
    /// by its device plugin before giving up (kube-scheduler then retries).
    /// Keep it below kube-scheduler's extender httpTimeout (default 5 s).
    #[arg(long, default_value_t = 3000, value_name = "MS")]
    pub bind_wait_ms: u64,

    /// How long after its date a decision whose pod is not bound yet (a
    /// bind in flight or interrupted) holds its GPUs and keeps its node
    /// from taking another vGPU pod.
    #[arg(long, default_value_t = 30, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub unbound_grace_seconds: u64,

    /// Seconds beyond its duration that a node's device plugin Lease
    /// (kube-node-lease/vgpu-<node>) may go unrenewed before the node gets
    /// no new vGPU pods. The Lease is timed by this extender's clock, from
    /// when it saw the Lease renewed.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub node_lease_grace_seconds: u64,

    /// Resource name: number of vGPUs per container.
    #[arg(long, default_value = vgpu_cluster::resources::GPU_COUNT, value_name = "NAME")]
    pub resource_gpu: String,

    #[command(flatten)]
    pub share_resources: ShareResourceFlags,

    /// The schedulerName the admission webhook (`POST /webhook/mutate`)
    /// gives pods that ask for vGPUs and name no scheduler; it must be the
    /// name of the kube-scheduler profile that calls this extender.
    #[arg(long, default_value = crate::extender::config::DEFAULT_SCHEDULER_NAME, value_name = "NAME")]
    pub scheduler_name: String,

    /// Let the admission webhook admit privileged containers that ask for
    /// vGPUs. By default they are refused: a privileged container sees
    /// every GPU of its node and bypasses the shim's cap and share.
    #[arg(long)]
    pub allow_privileged_vgpu: bool,

    /// A PriorityClass whose pods may run vGPU containers above the default
    /// priority (nvidia.com/priority 0), which pauses other pods' vGPUs on
    /// the same GPU while they run; repeatable. Any other pod that asks
    /// for it runs at the default priority, told so by a Warning Event.
    /// None by default: a pod's own word is not enough.
    #[arg(long = "high-priority-class", value_name = "NAME")]
    pub high_priority_classes: Vec<String>,

    /// vgpu's folder on the nodes (the chart's hostDir). Admission (and
    /// placement, with --confine-at-placement) refuses a pod given vGPUs
    /// whose hostPath volume mounts it, anything in it or a folder holding
    /// it, or the node's /proc: from there it could rewrite other
    /// containers' regions and grants or the shim.
    #[arg(long, default_value = crate::admission::reach::DEFAULT_HOST_DIR, value_name = "PATH",
          value_parser = absolute_path)]
    pub node_host_dir: String,

    /// Check again at placement what admission enforces on vGPU
    /// containers, and place no pod that never went through it (created
    /// before vgpu's admission was in force: before the install, in the
    /// second after it, while the webhook was off): one whose vGPU
    /// container is privileged, runs seccomp Unconfined or names no
    /// seccomp profile. Pods in the namespaces admission skips
    /// (--admission-skipped-namespace, and those labelled
    /// vgpu.io/webhook=ignore, which the extender then watches) are
    /// placed as before. Without --allow-privileged-vgpu only; the chart
    /// sets it with its webhook on.
    #[arg(long, conflicts_with = "allow_privileged_vgpu")]
    pub confine_at_placement: bool,

    /// A namespace admission skips whatever its labels (the chart's
    /// scheduler.webhook.ignoreNamespaces); repeatable.
    #[arg(
        long = "admission-skipped-namespace",
        value_name = "NAMESPACE",
        requires = "confine_at_placement"
    )]
    pub admission_skipped_namespaces: Vec<String>,

    /// A second schedulerName the admission webhook treats as its own
    /// (pods naming it get --scheduler-name), so KubeShare pod specs
    /// (`schedulerName: kubeshare-scheduler`) run unchanged; empty: none.
    #[arg(long, default_value = "kubeshare-scheduler", value_name = "NAME")]
    pub scheduler_alias: String,

    /// The PriorityClass the admission webhook gives opportunistic pods
    /// (KubeShare's `sharedgpu/priority: 0`, its default) that name none,
    /// as NAME=VALUE, VALUE its `value` in the cluster (the chart creates
    /// it with preemptionPolicy Never). kube-scheduler then evicts them
    /// first to place a guaranteed pod. Empty: no class is given.
    #[arg(long, default_value = "", value_name = "NAME=VALUE", value_parser = parse_priority_class)]
    pub opportunistic_priority_class: PriorityClassFlag,

    /// Run as one of several replicas: elect the one that filters,
    /// prioritizes and binds on a coordination.k8s.io Lease of the
    /// extender's own (--leader-elect-lease in --leader-elect-namespace).
    #[arg(long)]
    pub leader_elect: bool,

    /// Name of the extender's Lease.
    #[arg(long, default_value = "vgpu-scheduler-extender", value_name = "NAME")]
    pub leader_elect_lease: String,

    /// Namespace of the Lease (the pod's own: POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub leader_elect_namespace: Option<String>,

    /// This replica's name in the Lease (the pod's name: POD_NAME).
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pub leader_elect_identity: Option<String>,

    /// kube-scheduler's Lease (same namespace): stand for election only
    /// while the kube-scheduler in this pod (identity "<pod name>_...")
    /// holds it, so the serving extender is the one the scheduling
    /// kube-scheduler calls.
    #[arg(long, value_name = "NAME", requires = "leader_elect")]
    pub follow_scheduler_lease: Option<String>,

    /// Log level: error, warn, info, debug or trace (logs go to stderr).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: tracing::Level,
}

impl Cli {
    /// The extender configuration the flags describe.
    pub fn config(&self) -> Config {
        Config {
            resources: self.share_resources.names(&self.resource_gpu),
            defaults: self.request_defaults.defaults(),
            gpu_policy: self.gpu_policy,
            node_policy: self.node_policy,
            bind_wait: Duration::from_millis(self.bind_wait_ms),
            unbound_grace: Duration::from_secs(self.unbound_grace_seconds),
            node_lease_grace: Duration::from_secs(self.node_lease_grace_seconds),
            scheduler_name: self.scheduler_name.clone(),
            admission: AdmissionPolicy {
                allow_privileged: self.allow_privileged_vgpu,
                scheduler_alias: Some(self.scheduler_alias.trim().to_string())
                    .filter(|alias| !alias.is_empty()),
                opportunistic_class: self.opportunistic_priority_class.0.clone(),
                guarded_paths: GuardedPaths::new(&self.node_host_dir),
                high_priority_classes: HighPriorityClasses::new(
                    self.high_priority_classes.iter().cloned(),
                ),
            },
            limits: self.limits(),
            // The verbs on loopback reach kube-scheduler in the pod only
            // (over --client-ca, certified callers only).
            keep_filtered_pods: self.address.is_loopback(),
            placement_confinement: self.confine_at_placement.then(|| PlacementConfinement {
                skipped_namespaces: self.admission_skipped_namespaces.clone(),
            }),
        }
    }

    /// What the servers take from each client.
    pub fn limits(&self) -> Limits {
        let read_timeout = Duration::from_secs(self.read_timeout_seconds);
        Limits {
            max_body_bytes: usize::try_from(self.max_request_bytes).unwrap_or(usize::MAX),
            header_timeout: read_timeout,
            idle_timeout: Duration::from_secs(self.idle_timeout_seconds),
            body_timeout: read_timeout,
            write_timeout: Duration::from_secs(self.write_timeout_seconds),
            max_connections: self.max_connections as usize,
            max_connections_per_client: self.max_connections_per_client.min(self.max_connections)
                as usize,
            max_watches: self.max_watches as usize,
            max_connection_age: Duration::from_secs(self.max_connection_age_seconds),
        }
    }

    /// Where --port serves only the probes and metrics besides --address,
    /// if anywhere: not where --address already listens.
    pub fn health_listener(&self) -> Option<IpAddr> {
        self.health_address
            .filter(|health| !self.address.is_unspecified() && *health != self.address)
    }

    /// The leader election the flags ask for, or why they are incomplete.
    pub fn leader_config(&self) -> Result<Option<LeaderConfig>, LeaderFlagsError> {
        if !self.leader_elect {
            return Ok(None);
        }
        let namespace = self
            .leader_elect_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(LeaderFlagsError::NoNamespace)?;
        let identity = self
            .leader_elect_identity
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(LeaderFlagsError::NoIdentity)?;
        let mut config = LeaderConfig::new(self.leader_elect_lease.clone(), namespace, identity);
        config.follow = self.follow_scheduler_lease.clone();
        Ok(Some(config))
    }

    /// Where the API server is.
    pub fn api_source(&self) -> ApiSource {
        match (&self.api_server, &self.kubeconfig) {
            (Some(url), _) => ApiSource::Url(url.clone()),
            (None, Some(path)) => ApiSource::Kubeconfig(path.clone()),
            (None, None) => ApiSource::Infer,
        }
    }
}

/// `--leader-elect` without what an election needs.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum LeaderFlagsError {
    #[error(
        "--leader-elect needs --leader-elect-namespace (or POD_NAMESPACE): where the Lease lives"
    )]
    NoNamespace,
    #[error("--leader-elect needs --leader-elect-identity (or POD_NAME): this replica's name")]
    NoIdentity,
}

/// An `--opportunistic-priority-class` that is not `NAME=VALUE`.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PriorityClassError {
    #[error("{0:?} is not NAME=VALUE (e.g. vgpu-opportunistic=-100)")]
    NotNameValue(String),
    #[error("{0:?} names no PriorityClass")]
    NoName(String),
    #[error("{text:?}: the value {value:?} is not a whole number (a 32-bit integer)")]
    BadValue { text: String, value: String },
}

/// `--opportunistic-priority-class`: a PriorityClass's name and value, or
/// none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PriorityClassFlag(pub Option<(String, i32)>);

fn parse_priority_class(text: &str) -> Result<PriorityClassFlag, PriorityClassError> {
    if text.trim().is_empty() {
        return Ok(PriorityClassFlag(None));
    }
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| PriorityClassError::NotNameValue(text.to_string()))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(PriorityClassError::NoName(text.to_string()));
    }
    let value = value
        .trim()
        .parse::<i32>()
        .map_err(|_| PriorityClassError::BadValue {
            text: text.to_string(),
            value: value.to_string(),
        })?;
    Ok(PriorityClassFlag(Some((name.to_string(), value))))
}

/// A `--node-host-dir` that is not an absolute path.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{0:?} is not an absolute path (the chart's hostDir, e.g. /usr/local/vgpu)")]
pub struct NotAbsolute(String);

fn absolute_path(text: &str) -> Result<String, NotAbsolute> {
    if text.starts_with('/') {
        Ok(text.to_string())
    } else {
        Err(NotAbsolute(text.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn flags_parse_and_help_explains_every_flag() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "vgpu-scheduler",
            "--port",
            "8443",
            "--gpu-policy",
            "binpack",
            "--node-policy",
            "spread",
            "--api-server",
            "http://127.0.0.1:8001",
            "--resource-gpu",
            "example.com/vgpu",
        ])
        .expect("parse");
        let config = cli.config();
        assert_eq!(cli.port, 8443);
        // kube-scheduler's verbs on loopback unless asked otherwise.
        assert_eq!(cli.address, IpAddr::from([127, 0, 0, 1]));
        assert_eq!(cli.secure_address, IpAddr::from([0, 0, 0, 0]));
        assert!(config.keep_filtered_pods, "filter's callers are trusted");
        let exposed =
            Cli::try_parse_from(["vgpu-scheduler", "--address", "0.0.0.0"]).expect("parse");
        assert!(
            !exposed.config().keep_filtered_pods,
            "any pod may call filter: binds read the pod"
        );
        assert_eq!(config.limits, Limits::default());
        assert_eq!(cli.health_listener(), None);
        assert_eq!(config.gpu_policy, GpuPolicy::Binpack);
        assert_eq!(config.node_policy, NodePolicy::Spread);
        assert_eq!(config.resources.gpu, "example.com/vgpu");
        assert_eq!(
            cli.api_source(),
            ApiSource::Url("http://127.0.0.1:8001".into())
        );
        assert!(Cli::try_parse_from(["vgpu-scheduler", "--tls-cert", "c.pem"]).is_err());
        assert!(
            Cli::try_parse_from(["vgpu-scheduler", "--secure-port", "39443"]).is_err(),
            "a secure port needs a certificate"
        );
        assert!(Cli::try_parse_from(["vgpu-scheduler", "--gpu-policy", "busiest"]).is_err());
        assert!(Cli::try_parse_from(["vgpu-scheduler", "--default-cores", "101"]).is_err());
        assert_eq!(
            config.admission.scheduler_alias.as_deref(),
            Some("kubeshare-scheduler")
        );
        assert_eq!(config.admission.opportunistic_class, None);
        let classed = Cli::try_parse_from([
            "vgpu-scheduler",
            "--opportunistic-priority-class",
            "vgpu-opportunistic=-100",
            "--scheduler-alias",
            "",
        ])
        .expect("parse")
        .config();
        assert_eq!(
            classed.admission.opportunistic_class,
            Some(("vgpu-opportunistic".into(), -100))
        );
        assert_eq!(classed.admission.scheduler_alias, None);
        for bad in ["vgpu-opportunistic", "=5", "low=high", "x=99999999999"] {
            assert!(
                Cli::try_parse_from(["vgpu-scheduler", "--opportunistic-priority-class", bad])
                    .is_err(),
                "{bad}"
            );
        }
        let exposed = Cli::try_parse_from([
            "vgpu-scheduler",
            "--address",
            "0.0.0.0",
            "--health-address",
            "10.0.0.7",
            "--max-request-bytes",
            "134217728",
            "--read-timeout-seconds",
            "3",
            "--idle-timeout-seconds",
            "100",
            "--write-timeout-seconds",
            "4",
            "--max-connections",
            "10",
            "--max-connections-per-client",
            "40",
            "--max-watches",
            "2",
            "--max-connection-age-seconds",
            "60",
        ])
        .expect("parse");
        assert_eq!(exposed.health_listener(), None, "0.0.0.0 covers it");
        assert_eq!(
            exposed.config().limits,
            Limits {
                max_body_bytes: 128 << 20,
                header_timeout: Duration::from_secs(3),
                idle_timeout: Duration::from_secs(100),
                body_timeout: Duration::from_secs(3),
                write_timeout: Duration::from_secs(4),
                max_connections: 10,
                max_connections_per_client: 10,
                max_watches: 2,
                max_connection_age: Duration::from_secs(60),
            },
            "a client's limit is at most the listener's"
        );
        let probed =
            Cli::try_parse_from(["vgpu-scheduler", "--health-address", "10.0.0.7"]).expect("parse");
        assert_eq!(probed.health_listener(), Some(IpAddr::from([10, 0, 0, 7])));
        for bad in [
            ["--max-request-bytes", "0"],
            ["--read-timeout-seconds", "0"],
            ["--idle-timeout-seconds", "0"],
            ["--write-timeout-seconds", "0"],
            ["--max-connections", "0"],
            ["--max-connections-per-client", "0"],
            ["--max-connection-age-seconds", "0"],
        ] {
            assert!(
                Cli::try_parse_from(["vgpu-scheduler", bad[0], bad[1]]).is_err(),
                "{bad:?}"
            );
        }
        let help = Cli::command().render_long_help().to_string();
        for argument in Cli::command().get_arguments() {
            let long = argument.get_long().expect("every flag is long");
            assert!(help.contains(&format!("--{long}")), "{long}");
            assert!(
                argument.get_help().is_some() || long == "help" || long == "version",
                "{long} has no help"
            );
        }
    }
}
