//! A real Prometheus server (Debian's `prometheus` package) scraping the
//! monitor, queried through its HTTP API, and `promtool`. Both binaries are
//! required: `scripts/test` installs them.

use super::{http_get, wait_for};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The labels and the value of one series of an instant vector.
pub type Series = (serde_json::Map<String, serde_json::Value>, f64);

/// How often the server scrapes its target (and evaluates).
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(1);

/// The installed `tool`, or a panic that says how to install it.
pub fn require(tool: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(tool))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "`{tool}` is not installed: this test needs a real Prometheus server and promtool \
             (Debian: `apt-get install -y prometheus`, which scripts/test runs)"
        )
    })
}

/// `promtool check metrics` accepts `exposition`.
pub fn promtool_check(promtool: &Path, exposition: &str) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn promtool");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(exposition.as_bytes())
        .expect("feed promtool");
    let output = child.wait_with_output().expect("promtool");
    assert!(
        output.status.success(),
        "promtool check metrics rejected the exposition:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// A Prometheus server scraping one target every [`SCRAPE_INTERVAL`],
/// stopped and its data removed on drop.
pub struct PrometheusServer {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl PrometheusServer {
    /// Scrapes `target` as job `vgpu-monitor`.
    pub fn start(binary: &Path, target: SocketAddr) -> Self {
        Self::start_with_labels(binary, target, &[])
    }

    /// Scrapes `target` as job `vgpu-monitor`, adding `labels` to every
    /// series (as a Kubernetes service discovery's relabelling adds the
    /// node's name).
    pub fn start_with_labels(binary: &Path, target: SocketAddr, labels: &[(&str, &str)]) -> Self {
        let dir = vgpu_testkit::unique_temp_dir("prometheus");
        std::fs::create_dir_all(dir.join("data")).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        let interval = SCRAPE_INTERVAL.as_secs();
        let mut text = format!(
            "global:\n  scrape_interval: {interval}s\n  evaluation_interval: {interval}s\n\
             scrape_configs:\n  - job_name: vgpu-monitor\n    static_configs:\n      - targets: ['{target}']\n"
        );
        if !labels.is_empty() {
            text.push_str("        labels:\n");
            for (name, value) in labels {
                text.push_str(&format!("          {name}: '{value}'\n"));
            }
        }
        std::fs::write(&config, text).expect("config");
        let addr: SocketAddr = format!("127.0.0.1:{}", super::free_port())
            .parse()
            .expect("addr");
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus");
        let server = Self { child, addr, dir };
        let ready = wait_for(Duration::from_secs(30), || {
            http_get(server.addr, "/-/ready")
                .ok()
                .filter(|(status, _)| *status == 200)
        });
        assert!(
            ready.is_some(),
            "prometheus did not start:\n{}",
            server.log()
        );
        server
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// An instant query at `time` (Unix seconds; `None`: now): the result
    /// vector, or Prometheus' error (a query it cannot parse, a result that
    /// is no instant vector).
    pub fn try_query(&self, promql: &str, time: Option<f64>) -> Result<Vec<Series>, String> {
        let mut path = format!("/api/v1/query?query={}", encode(promql));
        if let Some(time) = time {
            path.push_str(&format!("&time={time:.3}"));
        }
        let (status, body) = http_get(self.addr, &path)?;
        let json: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || json["status"] != "success" {
            return Err(format!("HTTP {status}: {body}"));
        }
        if json["data"]["resultType"] != "vector" {
            return Err(format!("not an instant vector: {body}"));
        }
        json["data"]["result"]
            .as_array()
            .ok_or_else(|| format!("no result: {body}"))?
            .iter()
            .map(|r| {
                let labels = r["metric"].as_object().cloned().unwrap_or_default();
                let value = r["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("no value in {r}"))?;
                Ok((labels, value))
            })
            .collect()
    }

    /// The values of `label` over the series `selector` matches (what
    /// Grafana's `label_values(selector, label)` offers), sorted.
    pub fn label_values(&self, label: &str, selector: &str) -> Result<Vec<String>, String> {
        let path = format!(
            "/api/v1/label/{label}/values?{}={}",
            encode("match[]"),
            encode(selector)
        );
        let (status, body) = http_get(self.addr, &path)?;
        let json: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || json["status"] != "success" {
            return Err(format!("HTTP {status}: {body}"));
        }
        let mut values: Vec<String> = json["data"]
            .as_array()
            .ok_or_else(|| format!("no values: {body}"))?
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        values.sort();
        Ok(values)
    }

    /// An instant query now: the result vector as (labels, value).
    pub fn query(&self, promql: &str) -> Vec<Series> {
        self.try_query(promql, None)
            .unwrap_or_else(|error| panic!("{promql}: {error}"))
    }

    /// Queries until `check` accepts the result.
    pub fn wait_query(&self, promql: &str, check: impl Fn(&[Series]) -> bool) -> Vec<Series> {
        let mut last = Vec::new();
        let matched = wait_for(Duration::from_secs(30), || {
            last = self.query(promql);
            check(&last).then_some(())
        });
        assert!(
            matched.is_some(),
            "{promql} never gave the expected result; last: {last:?}\nprometheus log:\n{}",
            self.log()
        );
        last
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
