//! The extender's own figures, served at `GET /metrics` in Prometheus text
//! form: how long each verb takes from the request's arrival to its reply.
//! kube-scheduler has no per-extender latency metric of its own (its
//! `framework_extension_point_duration_seconds` covers its plugins only), so
//! this is where an operator sees what the extender adds to each pod.
//! Beside them, what each namespace with a quota on vGPU resources holds
//! and may hold ([`crate::placement::quota`]), and when the certificate
//! served over HTTPS ends.

use crate::placement::quota::NamespaceQuotaUse;
use crate::server::tls::CertificateFiles;
use prometheus::{Encoder, Histogram, HistogramOpts, HistogramVec, Registry, TextEncoder};
use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use thiserror::Error;

/// The histogram's name.
pub const REQUEST_DURATION: &str = "vgpu_extender_request_duration_seconds";

/// The gauge of when the served certificate ends.
pub const CERTIFICATE_EXPIRY: &str = "vgpu_extender_certificate_expiry_timestamp_seconds";

/// Upper bounds of the buckets, in seconds: fine below a millisecond, where
/// filter and prioritize answer, and up to kube-scheduler's default extender
/// timeout, where a slow bind (an API write) would show.
const BUCKETS: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
];

#[derive(Debug, Error)]
#[error("the extender's metrics")]
pub struct MetricsError(#[source] prometheus::Error);

/// What a request asked the extender to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Filter,
    Prioritize,
    Bind,
    Preempt,
    Mutate,
    Convert,
}

impl Verb {
    /// The `verb` label's value.
    pub fn label(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
            Verb::Preempt => "preempt",
            Verb::Mutate => "mutate",
            Verb::Convert => "convert",
        }
    }
}

/// The extender's request-duration histograms, one per verb.
pub struct ServerMetrics {
    registry: Registry,
    // One handle per verb, looked up once here, so an observation is a few
    // atomic adds and no label lookup.
    filter: Histogram,
    prioritize: Histogram,
    bind: Histogram,
    preempt: Histogram,
    mutate: Histogram,
    convert: Histogram,
    /// The certificate served over HTTPS, once there is one.
    certificate: OnceLock<Arc<CertificateFiles>>,
}

impl ServerMetrics {
    pub fn new() -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let durations = HistogramVec::new(
            HistogramOpts::new(
                REQUEST_DURATION,
                "Time the extender took to answer a request, from its arrival to the reply, by verb \
                 (filter, prioritize, bind, preempt, mutate for the admission webhook, convert for Elastic GPU's \
                 conversion webhook).",
            )
            .buckets(BUCKETS.to_vec()),
            &["verb"],
        )
        .map_err(MetricsError)?;
        registry
            .register(Box::new(durations.clone()))
            .map_err(MetricsError)?;
        let handle = |verb: Verb| {
            durations
                .get_metric_with_label_values(&[verb.label()])
                .map_err(MetricsError)
        };
        Ok(Self {
            filter: handle(Verb::Filter)?,
            prioritize: handle(Verb::Prioritize)?,
            bind: handle(Verb::Bind)?,
            preempt: handle(Verb::Preempt)?,
            mutate: handle(Verb::Mutate)?,
            convert: handle(Verb::Convert)?,
            registry,
            certificate: OnceLock::new(),
        })
    }

    /// Shows when the certificate in `files` ends (the one served at the
    /// time of each scrape). The first one given stays.
    pub fn report_certificate(&self, files: Arc<CertificateFiles>) {
        let _ = self.certificate.set(files);
    }

    /// Records one answered request.
    pub fn observe(&self, verb: Verb, elapsed: Duration) {
        let histogram = match verb {
            Verb::Filter => &self.filter,
            Verb::Prioritize => &self.prioritize,
            Verb::Bind => &self.bind,
            Verb::Preempt => &self.preempt,
            Verb::Mutate => &self.mutate,
            Verb::Convert => &self.convert,
        };
        histogram.observe(elapsed.as_secs_f64());
    }

    /// The text exposition, with the namespaces' `quotas`.
    pub fn render(&self, quotas: &[NamespaceQuotaUse]) -> Result<Vec<u8>, MetricsError> {
        let mut buffer = Vec::with_capacity(4096);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .map_err(MetricsError)?;
        buffer.extend_from_slice(render_quotas(quotas).as_bytes());
        if let Some(not_after) = self
            .certificate
            .get()
            .and_then(|files| files.not_after_unix())
        {
            buffer.extend_from_slice(
                format!(
                    "# HELP {CERTIFICATE_EXPIRY} When the certificate the extender serves over HTTPS (--tls-cert, \
                     as last read) expires, in seconds since the Unix epoch.\n\
                     # TYPE {CERTIFICATE_EXPIRY} gauge\n{CERTIFICATE_EXPIRY} {not_after}\n"
                )
                .as_bytes(),
            );
        }
        Ok(buffer)
    }
}

/// The quota gauges' names.
pub const NAMESPACE_MEMORY: &str = "vgpu_namespace_gpu_memory_bytes";
pub const NAMESPACE_MEMORY_QUOTA: &str = "vgpu_namespace_gpu_memory_quota_bytes";
pub const NAMESPACE_CORES: &str = "vgpu_namespace_gpu_cores";
pub const NAMESPACE_CORES_QUOTA: &str = "vgpu_namespace_gpu_cores_quota";

/// The gauges of what quota'd namespaces hold and may hold (one series
/// per namespace, only for namespaces with such a quota).
fn render_quotas(quotas: &[NamespaceQuotaUse]) -> String {
    let mut text = String::new();
    if quotas.is_empty() {
        return text;
    }
    type Value = fn(&NamespaceQuotaUse) -> Option<u64>;
    let gauges: [(&str, &str, Value); 4] = [
        (
            NAMESPACE_MEMORY,
            "GPU memory the namespace's vGPU pods hold (what their decisions grant), bytes, for namespaces whose ResourceQuota limits the vGPU memory resource or cores.",
            |q| Some(q.held.memory_bytes),
        ),
        (
            NAMESPACE_MEMORY_QUOTA,
            "The smallest limit the namespace's ResourceQuotas set on the vGPU memory resource, bytes.",
            |q| q.memory.as_ref().map(|limit| limit.value.saturating_mul(1 << 20)),
        ),
        (
            NAMESPACE_CORES,
            "GPU compute the namespace's vGPU pods hold, in hundredths of a GPU.",
            |q| Some(u64::from(q.held.cores)),
        ),
        (
            NAMESPACE_CORES_QUOTA,
            "The smallest limit the namespace's ResourceQuotas set on the vGPU cores resource, hundredths of a GPU.",
            |q| q.cores.as_ref().map(|limit| limit.value),
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} gauge");
        for quota in quotas {
            if let Some(value) = value(quota) {
                let namespace = quota
                    .namespace
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = writeln!(text, "{name}{{namespace=\"{namespace}\"}} {value}");
            }
        }
    }
    text
}

/// The `Content-Type` of [`ServerMetrics::render`]'s output.
pub fn content_type() -> &'static str {
    prometheus::TEXT_FORMAT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, name: &str) -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    #[test]
    fn each_verb_counts_on_its_own_series() {
        let metrics = ServerMetrics::new().expect("metrics");
        metrics.observe(Verb::Filter, Duration::from_micros(300));
        metrics.observe(Verb::Filter, Duration::from_millis(3));
        metrics.observe(Verb::Bind, Duration::from_millis(20));
        let text = String::from_utf8(metrics.render(&[]).expect("render")).expect("utf-8");
        let count = |verb: &str| {
            sample(
                &text,
                &format!("{REQUEST_DURATION}_count{{verb=\"{verb}\"}}"),
            )
        };
        assert_eq!(count("filter"), 2.0);
        assert_eq!(count("bind"), 1.0);
        assert_eq!(count("prioritize"), 0.0);
        assert_eq!(count("mutate"), 0.0);
        // 300 µs falls in the 0.5 ms bucket, 3 ms does not.
        let at = |le: &str| {
            sample(
                &text,
                &format!("{REQUEST_DURATION}_bucket{{verb=\"filter\",le=\"{le}\"}}"),
            )
        };
        assert_eq!(at("0.00025"), 0.0);
        assert_eq!(at("0.0005"), 1.0);
        assert_eq!(at("0.005"), 2.0);
        let sum = sample(&text, &format!("{REQUEST_DURATION}_sum{{verb=\"filter\"}}"));
        assert!((sum - 0.0033).abs() < 1e-9, "sum {sum}");
        assert!(text.contains(&format!("# TYPE {REQUEST_DURATION} histogram")));
        assert!(!text.contains(NAMESPACE_MEMORY), "no quota, no gauge");
    }

    #[test]
    fn each_quotad_namespace_has_its_gauges() {
        use crate::cache::quotas::Limit;
        let metrics = ServerMetrics::new().expect("metrics");
        let quotas = [
            NamespaceQuotaUse {
                namespace: "team-a".into(),
                held: crate::cache::gpus::Usage {
                    memory_bytes: 3 << 30,
                    cores: 60,
                    ..Default::default()
                },
                memory: Some(Limit {
                    value: 4096,
                    quota: "q".into(),
                }),
                cores: None,
            },
            NamespaceQuotaUse {
                namespace: "team-b".into(),
                held: Default::default(),
                memory: None,
                cores: Some(Limit {
                    value: 200,
                    quota: "q".into(),
                }),
            },
        ];
        let text = String::from_utf8(metrics.render(&quotas).expect("render")).expect("utf-8");
        assert_eq!(
            sample(
                &text,
                &format!("{NAMESPACE_MEMORY}{{namespace=\"team-a\"}}")
            ),
            3221225472.0
        );
        assert_eq!(
            sample(
                &text,
                &format!("{NAMESPACE_MEMORY_QUOTA}{{namespace=\"team-a\"}}")
            ),
            4294967296.0
        );
        assert_eq!(
            sample(&text, &format!("{NAMESPACE_CORES}{{namespace=\"team-a\"}}")),
            60.0
        );
        assert_eq!(
            sample(
                &text,
                &format!("{NAMESPACE_CORES_QUOTA}{{namespace=\"team-b\"}}")
            ),
            200.0
        );
        assert!(!text.contains(&format!("{NAMESPACE_MEMORY_QUOTA}{{namespace=\"team-b\"}}")));
        assert!(!text.contains(&format!("{NAMESPACE_CORES_QUOTA}{{namespace=\"team-a\"}}")));
    }
}
