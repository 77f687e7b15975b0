//! A real Prometheus server (Debian's `prometheus` package) scrapes the
//! monitor, and PromQL queries through its HTTP API return the expected
//! series; `promtool check metrics` accepts the exposition. Both binaries
//! are required: `scripts/test` installs them.

mod common;

use common::*;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_node_contract::region::RegionLimits;
use vgpu_testkit::Sandbox;

fn require(tool: &str) -> std::path::PathBuf {
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

fn promtool_check(promtool: &Path, exposition: &str) {
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

struct PrometheusServer {
    child: Child,
    addr: std::net::SocketAddr,
    dir: std::path::PathBuf,
}

impl PrometheusServer {
    fn start(binary: &Path, target: std::net::SocketAddr) -> Self {
        let dir = std::env::temp_dir().join(format!("vgpu-prometheus-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: vgpu-monitor\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("config");
        let addr: std::net::SocketAddr =
            format!("127.0.0.1:{}", free_port()).parse().expect("addr");
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

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// An instant PromQL query: the result vector as (labels, value).
    fn query(&self, promql: &str) -> Vec<(serde_json::Map<String, serde_json::Value>, f64)> {
        let encoded: String = promql
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                other => format!("%{other:02X}"),
            })
            .collect();
        let (status, body) =
            http_get(self.addr, &format!("/api/v1/query?query={encoded}")).expect("query");
        assert_eq!(status, 200, "{promql}: {body}");
        let json: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(json["status"], "success", "{body}");
        json["data"]["result"]
            .as_array()
            .expect("vector")
            .iter()
            .map(|r| {
                let labels = r["metric"].as_object().cloned().unwrap_or_default();
                let value = r["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .expect("value");
                (labels, value)
            })
            .collect()
    }

    /// Queries until `check` accepts the result.
    fn wait_query(
        &self,
        promql: &str,
        check: impl Fn(&[(serde_json::Map<String, serde_json::Value>, f64)]) -> bool,
    ) -> Vec<(serde_json::Map<String, serde_json::Value>, f64)> {
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

#[test]
fn a_real_prometheus_scrapes_the_monitor() {
    let prometheus = require("prometheus");
    let promtool = require("promtool");

    let host = HostDir::new("prometheus");
    let sandbox = Sandbox::new("monitor-prometheus", 1, "16Gi");
    let monitor = MonitorProcess::on_simulated_gpu(
        &sandbox,
        &host,
        &["--no-kubernetes", "--hami-metric-names"],
    );
    // The simulated GPU's UUID, as the shim would record it.
    let uuid = monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        s.iter()
            .find(|s| s.name == "vgpu_gpu_memory_total_bytes")
            .map(|s| s.labels["device_uuid"].clone())
    });
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = 4 * GIB;
    limits.sm_limit[0] = 30;
    let trainer = host.create_region("u-trainer_main", &limits);
    trainer.set_device_uuid(0, &uuid);
    let _slot = charge(&trainer, 0, 256 * MIB, 4 * MIB, 700 * MIB);
    trainer.layout().devices[0]
        .compute
        .launches
        .store(1234, Ordering::Relaxed);
    let other = host.create_region("u-infer_server", &RegionLimits::default());
    other.set_device_uuid(0, &uuid);
    let _other_slot = charge(&other, 0, 0, 0, 5 * MIB);
    monitor.wait_for_metrics(Duration::from_secs(10), |s| {
        value(s, "vgpu_gpu_containers", &[("device_index", "0")])
            .filter(|n| *n == 2.0)
            .map(|_| ())
    });
    promtool_check(&promtool, &monitor.scrape_text());

    let server = PrometheusServer::start(&prometheus, monitor.addr);
    server.wait_query("up{job=\"vgpu-monitor\"}", |r| {
        r.len() == 1 && r[0].1 == 1.0
    });
    let used = server.wait_query(
        "vgpu_container_memory_used_bytes{pod=\"u-trainer\",container=\"main\"}",
        |r| r.len() == 1,
    );
    assert_eq!(used[0].1, (960 * MIB) as f64);
    assert_eq!(used[0].0["device_uuid"], uuid.as_str());
    assert_eq!(used[0].0["device_index"], "0");
    let total = server.query("sum(vgpu_container_memory_used_bytes)");
    assert_eq!(total[0].1, (965 * MIB) as f64);
    let ratio =
        server.query("vgpu_container_memory_used_bytes / (vgpu_container_memory_limit_bytes > 0)");
    assert_eq!(ratio.len(), 1, "only the capped container has a ratio");
    assert!((ratio[0].1 - 960.0 / 4096.0).abs() < 1e-9);
    let launches = server.query("vgpu_container_kernel_launches_total{container=\"main\"}");
    assert_eq!(launches[0].1, 1234.0);
    let share = server.query("vgpu_container_compute_share_ratio{pod=\"u-trainer\"}");
    assert_eq!(share[0].1, 0.3);
    let containers = server.query("vgpu_gpu_containers");
    assert_eq!(containers.len(), 1);
    assert_eq!(containers[0].1, 2.0);
    let gpu_total = server.query("vgpu_gpu_memory_total_bytes");
    assert_eq!(gpu_total[0].1, (16 * GIB) as f64);
    // HAMi's names, for existing dashboards.
    let hami = server.query("hami_vgpu_memory_used_bytes{pod=\"u-trainer\",zone=\"vGPU\"}");
    assert_eq!(hami.len(), 1);
    assert_eq!(hami[0].1, (960 * MIB) as f64);
    assert_eq!(hami[0].0["vdevice_index"], "0");
    assert_eq!(
        server.query("count(hami_host_gpu_memory_used_bytes)")[0].1,
        1.0
    );
}
