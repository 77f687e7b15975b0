//! A real Prometheus server (Debian's `prometheus` package) scrapes the
//! monitor, and PromQL queries through its HTTP API return the expected
//! series; `promtool check metrics` accepts the exposition. Both binaries
//! are required: `scripts/test` installs them.

use crate::common::prometheus_server::{promtool_check, require, PrometheusServer};
use crate::common::*;
use std::sync::atomic::Ordering;
use std::time::Duration;
use vgpu_node_contract::region::RegionLimits;
use vgpu_testkit::Sandbox;

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
