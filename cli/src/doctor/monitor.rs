//! The node monitor's view: `GET /metrics` over plain HTTP/1.1, read as
//! the Prometheus text format, and the series of `monitor/src/metrics.rs`
//! that say what each region holds and whether each GPU is in order.

use super::findings::{mib, Findings, Section};
use crate::args::MonitorUrl;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const READ_TIMEOUT: Duration = Duration::from_secs(15);
/// The most of a response that is read (a node's full exposition is far
/// smaller).
const MAX_RESPONSE: u64 = 64 << 20;

/// What the monitor reports.
#[derive(Debug, Default, Serialize)]
pub struct MonitorReport {
    pub url: String,
    pub reachable: bool,
    pub error: Option<String>,
    /// `vgpu_monitor_regions`: the container regions it reads.
    pub regions: Option<u64>,
    pub gpus: Vec<MonitorGpu>,
    pub containers: Vec<MonitorContainer>,
}

/// One GPU's `vgpu_gpu_*` series.
#[derive(Debug, Default, Serialize)]
pub struct MonitorGpu {
    pub index: Option<u32>,
    pub uuid: String,
    pub model: String,
    pub healthy: Option<bool>,
    pub memory_total_bytes: Option<u64>,
    pub memory_used_bytes: Option<u64>,
    pub containers: Option<u64>,
    /// Processes on the GPU that no region accounts for (no shim).
    pub unenforced_processes: Option<u64>,
    pub unenforced_memory_bytes: Option<u64>,
}

/// One container's `vgpu_container_*` series on one GPU.
#[derive(Debug, Default, Serialize)]
pub struct MonitorContainer {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub device_index: Option<u32>,
    pub device_uuid: String,
    /// 0: uncapped.
    pub memory_limit_bytes: Option<u64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    pub memory_over_cap_bytes: Option<u64>,
    /// 1: uncapped.
    pub compute_share_ratio: Option<f64>,
    /// What the monitor grants now (0: paused, 1: unlimited).
    pub compute_effective_ratio: Option<f64>,
    pub utilization_ratio: Option<f64>,
    pub oom_events: Option<u64>,
}

/// One sample of the text format.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Why a scrape gave no metrics.
#[derive(Debug, PartialEq, Eq)]
enum ScrapeError {
    /// Nothing answered at the address.
    Unreachable(String),
    /// Something answered, but not with metrics.
    Bad(String),
}

/// Scrapes `url` and adds findings. An unreachable monitor is a warning at
/// the default address (machines without Kubernetes run none) and a
/// failure at one the user named. `nvml_uuids` are the GPUs NVML lists here.
pub fn check(
    url: &MonitorUrl,
    named: bool,
    nvml_uuids: &[&str],
    findings: &mut Findings,
) -> MonitorReport {
    let mut report = MonitorReport {
        url: url.text.clone(),
        ..MonitorReport::default()
    };
    let body = match get(url) {
        Ok(body) => body,
        Err(ScrapeError::Unreachable(why)) => {
            let message = format!("not reachable: {why}");
            let hint = "Is vgpu-monitor running on this node? With the chart it runs in the \
                        node agent's DaemonSet (`kubectl get pods -A -o wide \
                        --field-selector spec.nodeName=$(hostname)`; on nodes labelled \
                        vgpu.io/allocation=dra beside vgpu-dra) and listens on :31992 (its \
                        --listen); name another address with --monitor.";
            if named {
                findings.fail(Section::Monitor, message, hint);
            } else {
                findings.warn(Section::Monitor, message, hint);
            }
            report.error = Some(why);
            return report;
        }
        Err(ScrapeError::Bad(why)) => {
            findings.fail(
                Section::Monitor,
                format!("no metrics: {why}"),
                "Something else answers at this address, or the monitor is failing: see \
                 its log (`kubectl logs` of its pod).",
            );
            report.reachable = true;
            report.error = Some(why);
            return report;
        }
    };
    report.reachable = true;
    let samples = parse(&body);
    let regions = samples
        .iter()
        .find(|sample| sample.name == "vgpu_monitor_regions")
        .map(|sample| sample.value as u64);
    let Some(regions) = regions else {
        let why = "the answer has no vgpu_monitor_regions: not vgpu-monitor's metrics".to_string();
        findings.fail(
            Section::Monitor,
            why.clone(),
            "Point --monitor at vgpu-monitor's /metrics (port 31992 by default).",
        );
        report.error = Some(why);
        return report;
    };
    report.regions = Some(regions);
    report.gpus = gpus(&samples);
    report.containers = containers(&samples);
    findings.ok(
        Section::Monitor,
        format!(
            "reachable: it reads {regions} region(s) on {} GPU(s)",
            report.gpus.len()
        ),
    );
    gpu_findings(&report.gpus, nvml_uuids, findings);
    container_findings(&report.containers, findings);
    report
}

fn gpu_findings(gpus: &[MonitorGpu], nvml_uuids: &[&str], findings: &mut Findings) {
    for gpu in gpus {
        let name = format!(
            "GPU {} {}",
            gpu.index.map_or_else(|| "?".to_string(), |i| i.to_string()),
            gpu.uuid
        );
        if gpu.healthy == Some(false) {
            findings.fail(
                Section::Monitor,
                format!("{name}: the monitor finds it unhealthy (it does not answer NVML)"),
                "Check `nvidia-smi -q` and `dmesg` for XID errors; see the GPUs above.",
            );
            continue;
        }
        let unenforced = gpu.unenforced_processes.unwrap_or(0);
        if unenforced > 0 {
            findings.warn(
                Section::Monitor,
                format!(
                    "{name}: {unenforced} process(es) run without the shim, holding {} MiB",
                    mib(gpu.unenforced_memory_bytes.unwrap_or(0))
                ),
                "No limit applies to them: see the monitor's UnenforcedGPUProcess Events \
                 (`kubectl get events -A --field-selector reason=UnenforcedGPUProcess`) for \
                 which pod; a missing mount or an unset LD_PRELOAD is the usual cause.",
            );
            continue;
        }
        findings.ok(
            Section::Monitor,
            format!(
                "{name}: {} of {} MiB in use, {} container(s), no process without the shim",
                mib(gpu.memory_used_bytes.unwrap_or(0)),
                mib(gpu.memory_total_bytes.unwrap_or(0)),
                gpu.containers.unwrap_or(0)
            ),
        );
    }
    let seen: Vec<&str> = gpus.iter().map(|gpu| gpu.uuid.as_str()).collect();
    let missing: Vec<&str> = nvml_uuids
        .iter()
        .copied()
        .filter(|uuid| !seen.contains(uuid))
        .collect();
    if !missing.is_empty() {
        findings.warn(
            Section::Monitor,
            format!("the monitor does not report {}", missing.join(", ")),
            "It reads NVML through its own --nvml-library: is it this node's monitor, and \
             does its NVML see every GPU? Its log says how many GPUs it loaded.",
        );
    }
}

fn container_findings(containers: &[MonitorContainer], findings: &mut Findings) {
    if containers.is_empty() {
        findings.ok(Section::Monitor, "no container holds a region on a GPU now");
    }
    for container in containers {
        // Without the Kubernetes API the monitor labels a region by its
        // directory's name, as pod and container both: shown once.
        let mut parts: Vec<&str> = [&container.namespace, &container.pod, &container.container]
            .into_iter()
            .filter(|part| !part.is_empty())
            .map(String::as_str)
            .collect();
        parts.dedup();
        let who = parts.join("/");
        let limit = match container.memory_limit_bytes {
            Some(0) | None => "no cap".to_string(),
            Some(bytes) => format!("cap {} MiB", mib(bytes)),
        };
        let percent = |ratio: Option<f64>| {
            ratio.map_or_else(|| "?".to_string(), |r| format!("{:.0} %", r * 100.0))
        };
        let share = match container.compute_share_ratio {
            Some(ratio) if ratio >= 1.0 => "uncapped".to_string(),
            ratio => format!(
                "{} (now {})",
                percent(ratio),
                percent(container.compute_effective_ratio)
            ),
        };
        let utilization = container
            .utilization_ratio
            .map_or_else(String::new, |r| format!(", utilization {:.1} %", r * 100.0));
        let message = format!(
            "{who} on GPU {}: {} MiB used, {limit}; share {share}{utilization}",
            container
                .device_index
                .map_or_else(|| "?".to_string(), |i| i.to_string()),
            mib(container.memory_used_bytes.unwrap_or(0)),
        );
        let over = container.memory_over_cap_bytes.unwrap_or(0);
        if over > 0 {
            findings.warn(
                Section::Monitor,
                format!("{message}; {} MiB above its granted cap", mib(over)),
                "Its region's cap was raised from inside and put back; the memory taken \
                 meanwhile stays until the container frees it or restarts (Event \
                 MemoryOverCap).",
            );
        } else {
            findings.ok(Section::Monitor, message);
        }
    }
}

/// The samples named `name`.
fn family<'a>(samples: &'a [Sample], name: &'a str) -> impl Iterator<Item = &'a Sample> {
    samples.iter().filter(move |sample| sample.name == name)
}

fn label<'a>(sample: &'a Sample, key: &str) -> &'a str {
    sample.labels.get(key).map_or("", String::as_str)
}

fn bytes(value: f64) -> u64 {
    if value.is_finite() && value > 0.0 {
        value as u64
    } else {
        0
    }
}

fn gpus(samples: &[Sample]) -> Vec<MonitorGpu> {
    let mut by_uuid: BTreeMap<String, MonitorGpu> = BTreeMap::new();
    for sample in samples.iter().filter(|s| s.name.starts_with("vgpu_gpu_")) {
        let uuid = label(sample, "device_uuid");
        if uuid.is_empty() {
            continue;
        }
        let gpu = by_uuid
            .entry(uuid.to_string())
            .or_insert_with(|| MonitorGpu {
                uuid: uuid.to_string(),
                ..MonitorGpu::default()
            });
        if let Ok(index) = label(sample, "device_index").parse() {
            gpu.index = Some(index);
        }
        if gpu.model.is_empty() {
            gpu.model = label(sample, "model").to_string();
        }
        let value = sample.value;
        match sample.name.as_str() {
            "vgpu_gpu_healthy" => gpu.healthy = Some(value >= 1.0),
            "vgpu_gpu_memory_total_bytes" => gpu.memory_total_bytes = Some(bytes(value)),
            "vgpu_gpu_memory_used_bytes" => gpu.memory_used_bytes = Some(bytes(value)),
            "vgpu_gpu_containers" => gpu.containers = Some(bytes(value)),
            "vgpu_gpu_unenforced_processes" => gpu.unenforced_processes = Some(bytes(value)),
            "vgpu_gpu_unenforced_memory_bytes" => {
                gpu.unenforced_memory_bytes = Some(bytes(value));
            }
            _ => {}
        }
    }
    let mut list: Vec<MonitorGpu> = by_uuid.into_values().collect();
    list.sort_by_key(|gpu| (gpu.index, gpu.uuid.clone()));
    list
}

fn containers(samples: &[Sample]) -> Vec<MonitorContainer> {
    type Key = (String, String, String, String, String);
    let mut by_key: BTreeMap<Key, MonitorContainer> = BTreeMap::new();
    // Every per-container-and-GPU series carries the same labels; the
    // used-memory one is always there.
    for sample in family(samples, "vgpu_container_memory_used_bytes") {
        let key = key_of(sample);
        by_key.insert(
            key,
            MonitorContainer {
                namespace: label(sample, "namespace").to_string(),
                pod: label(sample, "pod").to_string(),
                container: label(sample, "container").to_string(),
                device_index: label(sample, "device_index").parse().ok(),
                device_uuid: label(sample, "device_uuid").to_string(),
                memory_used_bytes: Some(bytes(sample.value)),
                ..MonitorContainer::default()
            },
        );
    }
    for sample in samples
        .iter()
        .filter(|s| s.name.starts_with("vgpu_container_"))
    {
        let Some(container) = by_key.get_mut(&key_of(sample)) else {
            continue;
        };
        let value = sample.value;
        match sample.name.as_str() {
            "vgpu_container_memory_limit_bytes" => {
                container.memory_limit_bytes = Some(bytes(value))
            }
            "vgpu_container_memory_peak_bytes" => container.memory_peak_bytes = Some(bytes(value)),
            "vgpu_container_memory_over_cap_bytes" => {
                container.memory_over_cap_bytes = Some(bytes(value));
            }
            "vgpu_container_compute_share_ratio" => container.compute_share_ratio = Some(value),
            "vgpu_container_compute_effective_ratio" => {
                container.compute_effective_ratio = Some(value);
            }
            "vgpu_container_utilization_ratio" => container.utilization_ratio = Some(value),
            "vgpu_container_oom_events_total" => container.oom_events = Some(bytes(value)),
            _ => {}
        }
    }
    by_key.into_values().collect()
}

fn key_of(sample: &Sample) -> (String, String, String, String, String) {
    (
        label(sample, "namespace").to_string(),
        label(sample, "pod").to_string(),
        label(sample, "container").to_string(),
        label(sample, "device_index").to_string(),
        label(sample, "device_uuid").to_string(),
    )
}

/// `GET url`: the body of a 200 answer.
fn get(url: &MonitorUrl) -> Result<String, ScrapeError> {
    let addresses = url
        .authority
        .to_socket_addrs()
        .map_err(|error| ScrapeError::Unreachable(format!("{}: {error}", url.authority)))?;
    let mut failure = format!("{}: no address", url.authority);
    let mut connected = None;
    for address in addresses {
        match TcpStream::connect_timeout(&address, CONNECT_TIMEOUT) {
            Ok(stream) => {
                connected = Some(stream);
                break;
            }
            Err(error) => failure = format!("{address}: {error}"),
        }
    }
    let mut stream = connected.ok_or(ScrapeError::Unreachable(failure))?;
    let bad = |what: &str| {
        let what = what.to_string();
        move |error: std::io::Error| ScrapeError::Bad(format!("{what}: {error}"))
    };
    stream
        .set_read_timeout(Some(READ_TIMEOUT))
        .map_err(bad("setting a timeout"))?;
    stream
        .set_write_timeout(Some(READ_TIMEOUT))
        .map_err(bad("setting a timeout"))?;
    write!(
        stream,
        "GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n",
        url.path, url.host
    )
    .map_err(bad("sending the request"))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_RESPONSE)
        .read_to_end(&mut raw)
        .map_err(bad("reading the answer"))?;
    response_body(&raw)
}

/// The body of an HTTP/1.1 answer, when its status is 200.
fn response_body(raw: &[u8]) -> Result<String, ScrapeError> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| ScrapeError::Bad("not an HTTP answer".into()))?;
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| ScrapeError::Bad(format!("not an HTTP answer: {status_line:?}")))?;
    if status != 200 {
        return Err(ScrapeError::Bad(format!("HTTP {}", status_line.trim())));
    }
    let chunked = lines.any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    Ok(if chunked {
        dechunk(body)
    } else {
        body.to_string()
    })
}

/// A chunked body's data.
fn dechunk(mut body: &str) -> String {
    let mut data = String::new();
    while let Some((size_line, rest)) = body.split_once("\r\n") {
        let size = size_line.split(';').next().unwrap_or_default().trim();
        let Ok(size) = usize::from_str_radix(size, 16) else {
            break;
        };
        if size == 0 || rest.len() < size || !rest.is_char_boundary(size) {
            break;
        }
        data.push_str(&rest[..size]);
        body = rest[size..].strip_prefix("\r\n").unwrap_or(&rest[size..]);
    }
    data
}

/// The samples of a Prometheus text exposition; lines it cannot read are
/// skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inside) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inside)?;
        labels = parsed;
        rest = after;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// `key="value",...}` with the text format's escapes (`\\`, `\"`, `\n`);
/// the labels and what follows the closing brace.
fn parse_labels(mut text: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        text = text.trim_start_matches([' ', ',']);
        if let Some(after) = text.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, after) = text.split_once('=')?;
        let mut chars = after.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (at, '"') => break at,
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_string(), value);
        // `after` starts with the opening quote: skip it and the value.
        text = &after[1 + end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPOSITION: &str = r#"# HELP vgpu_container_memory_used_bytes Device memory charged to the container.
# TYPE vgpu_container_memory_used_bytes gauge
vgpu_container_memory_used_bytes{namespace="ml",pod="train-0",container="main",device_uuid="GPU-a",device_index="0"} 1073741824
vgpu_container_memory_limit_bytes{namespace="ml",pod="train-0",container="main",device_uuid="GPU-a",device_index="0"} 4294967296
vgpu_container_compute_share_ratio{namespace="ml",pod="train-0",container="main",device_uuid="GPU-a",device_index="0"} 0.3
vgpu_container_compute_effective_ratio{namespace="ml",pod="train-0",container="main",device_uuid="GPU-a",device_index="0"} 0.5
vgpu_container_memory_used_bytes{namespace="",pod="",container="we\"ird, {name}\\",device_uuid="GPU-a",device_index="0"} 0
vgpu_gpu_memory_total_bytes{device_index="0",device_uuid="GPU-a",model="H100"} 85899345920
vgpu_gpu_healthy{device_index="0",device_uuid="GPU-a",model="H100"} 1
vgpu_gpu_unenforced_processes{device_index="0",device_uuid="GPU-a",model="H100"} 2
vgpu_monitor_regions 2
vgpu_monitor_loop_duration_seconds NaN
"#;

    #[test]
    fn the_exposition_is_read_into_containers_and_gpus() {
        let samples = parse(EXPOSITION);
        assert_eq!(samples.len(), 10);
        let containers = containers(&samples);
        assert_eq!(containers.len(), 2);
        let train = containers
            .iter()
            .find(|c| c.pod == "train-0")
            .expect("train-0");
        assert_eq!(train.memory_used_bytes, Some(1 << 30));
        assert_eq!(train.memory_limit_bytes, Some(4 << 30));
        assert_eq!(train.compute_share_ratio, Some(0.3));
        assert_eq!(train.compute_effective_ratio, Some(0.5));
        assert_eq!(train.device_index, Some(0));
        let weird = containers.iter().find(|c| c.pod.is_empty()).expect("weird");
        assert_eq!(weird.container, "we\"ird, {name}\\");
        let gpus = gpus(&samples);
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].healthy, Some(true));
        assert_eq!(gpus[0].unenforced_processes, Some(2));
        assert_eq!(gpus[0].model, "H100");
    }

    #[test]
    fn findings_follow_the_figures() {
        let samples = parse(EXPOSITION);
        let mut findings = Findings::default();
        gpu_findings(&gpus(&samples), &["GPU-a", "GPU-b"], &mut findings);
        container_findings(&containers(&samples), &mut findings);
        let lines: Vec<(crate::doctor::findings::Status, &str)> = findings
            .0
            .iter()
            .map(|f| (f.status, f.message.as_str()))
            .collect();
        use crate::doctor::findings::Status::{Ok, Warn};
        assert_eq!(lines[0].0, Warn, "{lines:?}");
        assert!(lines[0].1.contains("2 process(es) run without the shim"));
        assert_eq!(lines[1], (Warn, "the monitor does not report GPU-b"));
        assert!(
            lines.contains(&(
                Ok,
                "ml/train-0/main on GPU 0: 1024 MiB used, cap 4096 MiB; share 30 % (now 50 %)"
            )),
            "{lines:?}"
        );
    }

    #[test]
    fn answers_are_read_plain_or_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nx 1\n\n";
        assert_eq!(response_body(plain), Ok("x 1\n\n".to_string()));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nx 1\n\r\n4\r\ny 2\n\r\n0\r\n\r\n";
        assert_eq!(response_body(chunked), Ok("x 1\ny 2\n".to_string()));
        assert!(matches!(
            response_body(b"HTTP/1.1 404 Not Found\r\n\r\n"),
            Err(ScrapeError::Bad(why)) if why.contains("404")
        ));
        assert!(matches!(
            response_body(b"SSH-2.0"),
            Err(ScrapeError::Bad(_))
        ));
    }

    #[test]
    fn nothing_listening_is_unreachable() {
        // A port bound and closed again: nothing listens there now.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a port")
            .port();
        let url = crate::args::MonitorUrl {
            text: format!("http://127.0.0.1:{port}/metrics"),
            authority: format!("127.0.0.1:{port}"),
            host: format!("127.0.0.1:{port}"),
            path: "/metrics".into(),
        };
        assert!(matches!(get(&url), Err(ScrapeError::Unreachable(_))));
    }
}
