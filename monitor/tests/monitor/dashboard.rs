//! The Grafana dashboard the chart ships (`deploy/helm/vgpu/dashboards/
//! vgpu.json`) against a real Prometheus scraping the monitor of a known
//! workload.
//!
//! On one node (`NODE`, the label a Kubernetes scrape configuration adds)
//! with two simulated GPUs, GPU 1 lost (NVML answers `GPU_IS_LOST`):
//!
//! - `ml/trainer-0/main`: a 4 GiB cap and a 30 % share; holds 1 GiB, fills
//!   its cap once (one allocation refused: an out-of-memory event) and runs
//!   1 ms kernels back to back (held at 30 %);
//! - `research/notebook-0/main`: uncapped, holds 256 MiB under the shim,
//!   and one more of its processes holds 512 MiB without the shim.
//!
//! Every target of every panel has its template variables, `$__interval`,
//! `$__rate_interval` and `$__range` expanded as Grafana would, is
//! evaluated through Prometheus' query API at one instant, and must return
//! exactly the series that workload gives, each with its value (within a
//! stated tolerance where it is measured). A panel or target without an
//! expectation, an expectation without its panel, a query that is left
//! unexpanded, fails to parse or returns nothing fails the test. A second
//! pass selects the trainer and its GPU and checks that every panel shows
//! only them. The variables' own queries give the label values expected.

use crate::common::prometheus_server::{require, PrometheusServer, Series, SCRAPE_INTERVAL};
use crate::common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use vgpu_testkit::compute::Workload;
use vgpu_testkit::namespaces::{forked_child, in_new_pid_namespace, in_pid_namespace_of};
use vgpu_testkit::{key_values, number, programs_dir, run_ok, spawn_until_ready, Sandbox};

/// The dashboard, as the chart reads it with `.Files.Get`.
const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/helm/vgpu/dashboards/vgpu.json"
);

const NODE: &str = "gpu-node-1";
/// GPUs of the simulated machine; the last one is lost.
const GPUS: u32 = 2;
const GPU_MEMORY: u64 = 16 * GIB;
const LOST_GPU: &str = "1";

const TRAINER_CAP: u64 = 4 * GIB;
const TRAINER_SHARE: f64 = 0.30;
const TRAINER_HELD: u64 = GIB;
const FILL_CHUNK: u64 = 512 * MIB;
const NOTEBOOK_HELD: u64 = 256 * MIB;
const UNENFORCED_HELD: u64 = 512 * MIB;

/// Allowed error of an achieved share, in fractions of the device: the
/// compute-share tests' 4 points (`tests/arbitration.rs`).
const SHARE_TOLERANCE: f64 = 0.04;
/// NVML reports a GPU's utilization in whole percent over its own sample
/// period: one point more.
const NVML_TOLERANCE: f64 = 0.05;
/// The simulated kernel's duration: a container held at a share launches
/// share / duration of them per second.
const KERNEL_SECONDS: f64 = 0.001;

/// Grafana's `$__interval` for this test: the scrape interval (its floor
/// when the data source says how often Prometheus scrapes).
const INTERVAL: Duration = SCRAPE_INTERVAL;

/// Grafana's `$__rate_interval`: max(`$__interval` + scrape interval,
/// 4 × scrape interval).
fn rate_interval() -> Duration {
    (INTERVAL + SCRAPE_INTERVAL).max(4 * SCRAPE_INTERVAL)
}

fn seconds(duration: Duration) -> String {
    format!("{}s", duration.as_secs())
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// One query of a panel.
#[derive(Debug)]
struct Target {
    ref_id: String,
    expr: String,
}

/// One panel that queries (rows left out).
#[derive(Debug)]
struct Panel {
    title: String,
    targets: Vec<Target>,
}

fn text<'a>(value: &'a serde_json::Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is no string: {value}"))
}

/// Reads the dashboard and checks its structure: a Grafana dashboard with
/// a uid, the data-source variable on every panel and query, unique panel
/// ids and titles, unique refIds within a panel, every panel inside the 24
/// columns and none overlapping another.
fn load_dashboard() -> (serde_json::Value, Vec<Panel>) {
    let source = std::fs::read_to_string(DASHBOARD).expect("the dashboard file");
    let dashboard: serde_json::Value = serde_json::from_str(&source)
        .unwrap_or_else(|error| panic!("{DASHBOARD} is not valid JSON: {error}"));
    assert!(!text(&dashboard["uid"], "uid").is_empty());
    assert!(!text(&dashboard["title"], "title").is_empty());
    assert!(
        dashboard["schemaVersion"].as_u64().is_some(),
        "schemaVersion"
    );

    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("template variables");
    let datasource = variables
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a data-source variable");
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    for variable in variables.iter().filter(|v| v["type"] == "query") {
        assert_eq!(variable["datasource"]["uid"], "${datasource}", "{variable}");
    }

    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    let mut boxes: Vec<(String, [u64; 4])> = Vec::new();
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = text(&panel["title"], "panel title").to_string();
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "{title}: id"
        );
        let grid = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| {
            grid[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{title}: gridPos.{k}"))
        });
        assert!(w > 0 && h > 0 && x + w <= 24, "{title}: {grid}");
        for (other, [ox, oy, ow, oh]) in &boxes {
            let apart = x + w <= *ox || *ox + ow <= x || y + h <= *oy || *oy + oh <= y;
            assert!(apart, "{title} overlaps {other}");
        }
        boxes.push((title.clone(), [x, y, w, h]));
        if panel["type"] == "row" {
            assert!(
                panel["panels"].as_array().is_some_and(Vec::is_empty),
                "{title}: rows are expanded, their panels at the top level"
            );
            continue;
        }
        assert!(titles.insert(title.clone()), "two panels titled {title}");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let mut ref_ids = BTreeSet::new();
        let targets: Vec<Target> = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{title}: targets"))
            .iter()
            .map(|target| {
                assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
                let ref_id = text(&target["refId"], "refId").to_string();
                assert!(ref_ids.insert(ref_id.clone()), "{title}: refId {ref_id}");
                let expr = text(&target["expr"], "expr").to_string();
                assert!(!expr.trim().is_empty(), "{title} {ref_id}: empty query");
                Target { ref_id, expr }
            })
            .collect();
        assert!(!targets.is_empty(), "{title}: no query");
        panels.push(Panel { title, targets });
    }
    (dashboard, panels)
}

/// What a template variable stands for in one evaluation.
#[derive(Clone, Debug)]
enum Choice {
    /// "All": the variable's `allValue`.
    All,
    /// One value, which Grafana regex-escapes for Prometheus.
    One(String),
}

/// Template variables, built-in and the dashboard's, as Grafana expands
/// them in Prometheus queries.
struct Expansion {
    values: BTreeMap<String, String>,
}

impl Expansion {
    fn new(dashboard: &serde_json::Value, choices: &[(&str, Choice)], range: Duration) -> Self {
        let mut values = BTreeMap::from([
            ("__interval".to_string(), seconds(INTERVAL)),
            ("__rate_interval".to_string(), seconds(rate_interval())),
            ("__range".to_string(), seconds(range)),
        ]);
        for variable in dashboard["templating"]["list"]
            .as_array()
            .expect("variables")
        {
            let name = text(&variable["name"], "variable name");
            if variable["type"] != "query" {
                continue;
            }
            let choice = choices
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, c)| c.clone())
                .unwrap_or_else(|| panic!("the test chooses no value for ${name}"));
            let value = match choice {
                Choice::All => text(&variable["allValue"], "allValue").to_string(),
                Choice::One(value) => regex_escape(&value),
            };
            values.insert(name.to_string(), value);
        }
        Self { values }
    }

    /// `text` with every `$name` and `${name}` replaced; a name that is no
    /// variable is an error.
    fn expand(&self, text: &str) -> Result<String, String> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            let (name, consumed) = if let Some(braced) = after.strip_prefix('{') {
                let end = braced
                    .find('}')
                    .ok_or_else(|| format!("unclosed ${{ in {text}"))?;
                (&braced[..end], end + 2)
            } else {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(after.len());
                (&after[..end], end)
            };
            let value = self
                .values
                .get(name)
                .ok_or_else(|| format!("${name} is no variable (in {text})"))?;
            out.push_str(value);
            rest = &after[consumed..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// A value as Grafana escapes it into a Prometheus regular expression.
fn regex_escape(value: &str) -> String {
    let mut out = String::new();
    for c in value.chars() {
        if "\\^$*+?.()|{}[]".contains(c) {
            out.push_str("\\\\");
        }
        out.push(c);
    }
    out
}

/// One series a query must return: labels it must have (a `None` value:
/// the label must be absent) and its value within a tolerance.
#[derive(Clone, Debug)]
struct Want {
    labels: Vec<(String, Option<String>)>,
    value: f64,
    tolerance: f64,
}

impl Want {
    /// A series with `labels` (among others) whose value is `value` ±
    /// `tolerance`.
    fn near(labels: &[(&str, &str)], value: f64, tolerance: f64) -> Self {
        Self {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string())))
                .collect(),
            value,
            tolerance,
        }
    }

    fn exactly(labels: &[(&str, &str)], value: f64) -> Self {
        Self::near(labels, value, 0.0)
    }

    /// A series whose value lies in `low..=high`.
    fn between(labels: &[(&str, &str)], low: f64, high: f64) -> Self {
        Self::near(labels, (low + high) / 2.0, (high - low) / 2.0)
    }

    /// The series must not have `label`.
    fn without(mut self, label: &str) -> Self {
        self.labels.push((label.to_string(), None));
        self
    }
}

fn matches(series: &Series, want: &Want) -> bool {
    want.labels.iter().all(|(name, value)| {
        let actual = series.0.get(name).and_then(|v| v.as_str());
        actual == value.as_deref()
    })
}

/// The result is exactly the wanted series: as many, each matched by one
/// and within its tolerance.
fn check(result: &[Series], wants: &[Want]) -> Result<(), String> {
    if result.is_empty() {
        return Err("no series".to_string());
    }
    if result.len() != wants.len() {
        return Err(format!(
            "{} series, {} wanted: {wants:?}",
            result.len(),
            wants.len()
        ));
    }
    for want in wants {
        let found: Vec<&Series> = result.iter().filter(|s| matches(s, want)).collect();
        let [series] = found.as_slice() else {
            return Err(format!("{} series match {:?}", found.len(), want.labels));
        };
        // A relative allowance for exact values read back through floats.
        let allowed = want.tolerance.max(want.value.abs() * 1e-12);
        if (series.1 - want.value).abs() > allowed {
            return Err(format!(
                "{:?}: {} where {} ± {} was wanted",
                want.labels, series.1, want.value, want.tolerance
            ));
        }
    }
    Ok(())
}

fn describe(result: &[Series]) -> String {
    result
        .iter()
        .map(|(labels, value)| {
            let labels: Vec<String> = labels
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "job" | "instance"))
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect();
            format!("{{{}}} {value}", labels.join(","))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A process under test that holds something until its stdin closes.
struct Held(Child);

impl Held {
    fn start(command: &mut std::process::Command) -> Self {
        Self(spawn_until_ready(command))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// A container of the machine: its region under `host`, seeing GPU 0 only
/// (as the NVIDIA runtime exposes a container's GPUs), on `base`'s
/// simulated GPUs.
fn container(base: &Sandbox, host: &HostDir, key: &str, env: &[(&str, &str)]) -> Sandbox {
    let mut sandbox = Sandbox::new("dashboard-container", GPUS, &GPU_MEMORY.to_string());
    sandbox
        .set("SIMGPU_STATE", &base.sim_state.display().to_string())
        .set("SIMGPU_VISIBLE_DEVICES", "0")
        .set(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            &host.region_path(key).display().to_string(),
        );
    for (name, value) in env {
        sandbox.set(name, value);
    }
    sandbox
}

#[test]
fn every_panel_shows_what_the_workload_does() {
    let prometheus = require("prometheus");
    let (dashboard, panels) = load_dashboard();

    let api = KubeApi::start();
    api.add_node(NODE);
    api.add_namespace("ml");
    api.add_namespace("research");
    let trainer_uid = api.add_bound_pod("ml", "trainer-0", NODE, Default::default());
    let notebook_uid = api.add_bound_pod("research", "notebook-0", NODE, Default::default());

    let host = HostDir::new("dashboard");
    let mut machine = Sandbox::new("dashboard", GPUS, &GPU_MEMORY.to_string());
    let cap = TRAINER_CAP.to_string();
    let share = format!("{}", (TRAINER_SHARE * 100.0).round());
    let trainer = container(
        &machine,
        &host,
        &format!("{trainer_uid}_main"),
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", &cap),
            ("CUDA_DEVICE_SM_LIMIT", &share),
        ],
    );
    let notebook = container(&machine, &host, &format!("{notebook_uid}_main"), &[]);

    let _trainer_memory =
        Held::start(&mut trainer.probe("dlsym", &["hold", &TRAINER_HELD.to_string()]));
    // The notebook's process under the shim, in a PID namespace of its own
    // as in a pod, and another one of its processes that skipped the shim.
    let notebook_memory = Held::start(&mut in_new_pid_namespace(
        &notebook.probe("linked", &["hold", &NOTEBOOK_HELD.to_string()]),
    ));
    let mut bare = notebook.command_without_shim(&programs_dir().join("probe_linked"));
    bare.args(["linked", "hold", &UNENFORCED_HELD.to_string()]);
    let _unenforced = Held::start(&mut in_pid_namespace_of(
        forked_child(notebook_memory.0.id()),
        &bare,
    ));

    // The monitor sees GPU 1 fall off the bus.
    machine.set("SIMGPU_LOST_DEVICES", LOST_GPU);
    let monitor = MonitorProcess::on_simulated_gpu(
        &machine,
        &host,
        &["--kubeconfig", api.kubeconfig(), "--node-name", NODE],
    );
    let uuid = monitor.wait_for_metrics(Duration::from_secs(15), |s| {
        let named = value(
            s,
            "vgpu_container_memory_used_bytes",
            &[("pod", "trainer-0")],
        )
        .is_some()
            && value(
                s,
                "vgpu_container_unenforced_processes",
                &[("pod", "notebook-0")],
            ) == Some(1.0);
        let uuid = s
            .iter()
            .find(|s| s.name == "vgpu_gpu_memory_total_bytes")
            .map(|s| s.labels["device_uuid"].clone());
        uuid.filter(|_| named)
    });

    let started = unix_now();
    let server = PrometheusServer::start_with_labels(&prometheus, monitor.addr, &[("node", NODE)]);
    // Scraped before the out-of-memory event, so the range sees it happen.
    server.wait_query("vgpu_container_oom_events_total{pod=\"trainer-0\"}", |r| {
        r.len() == 1 && r[0].1 == 0.0
    });
    let fill = key_values(&run_ok(
        &mut trainer.probe("dlsym", &["fill", &FILL_CHUNK.to_string()]),
    ));
    assert_eq!(
        number(&fill, "chunks") as u64,
        (TRAINER_CAP - TRAINER_HELD) / FILL_CHUNK,
        "the cap takes this many chunks beside what is held: {fill:?}"
    );
    assert_eq!(number(&fill, "refusal"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    server.wait_query("vgpu_container_oom_events_total{pod=\"trainer-0\"}", |r| {
        r.len() == 1 && r[0].1 == 1.0
    });

    let workload = Workload::start(&trainer, "burst", "k1ms", 600.0, 1);
    // Every sample Prometheus took of the trainer over the last six seconds
    // shows it running: the rate interval and the monitor's utilization
    // window lie within its steady state.
    server.wait_query(
        "min_over_time(vgpu_container_utilization_ratio{pod=\"trainer-0\"}[6s]) > 0 \
         and count_over_time(vgpu_container_utilization_ratio{pod=\"trainer-0\"}[6s]) >= 5",
        |r| r.len() == 1,
    );
    let at = unix_now();
    let range = Duration::from_secs((at - started).ceil() as u64);

    // Read back from the monitor: what the shim charged for the modules
    // and contexts the programs loaded (contexts cost 0 in the sandbox).
    let samples = monitor.scrape();
    let charged_beside_data = |pod: &str| -> u64 {
        [
            "vgpu_container_memory_context_bytes",
            "vgpu_container_memory_module_bytes",
        ]
        .iter()
        .map(|name| value(&samples, name, &[("pod", pod)]).expect(name) as u64)
        .sum()
    };
    let expected = expectations(
        &uuid,
        TRAINER_HELD + charged_beside_data("trainer-0"),
        NOTEBOOK_HELD + charged_beside_data("notebook-0"),
    );

    let mut failures = Vec::new();
    let all = Expansion::new(
        &dashboard,
        &[
            ("node", Choice::All),
            ("gpu", Choice::All),
            ("namespace", Choice::All),
            ("pod", Choice::All),
            ("container", Choice::All),
        ],
        range,
    );
    check_every_panel(&server, at, &panels, &all, &expected, &mut failures);
    let trainer_only = Expansion::new(
        &dashboard,
        &[
            ("node", Choice::One(NODE.to_string())),
            ("gpu", Choice::One(uuid.clone())),
            ("namespace", Choice::One("ml".to_string())),
            ("pod", Choice::One("trainer-0".to_string())),
            ("container", Choice::One("main".to_string())),
        ],
        range,
    );
    check_selection(&server, at, &panels, &trainer_only, &uuid, &mut failures);
    let offered: [(&str, &[&str]); 5] = [
        ("node", &[NODE]),
        ("gpu", &[uuid.as_str()]),
        ("namespace", &["ml", "research"]),
        ("pod", &["notebook-0", "trainer-0"]),
        ("container", &["main"]),
    ];
    check_variables(&server, &dashboard, &all, &offered, &mut failures);

    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}\nmonitor log:\n{}",
        failures.len(),
        failures.join("\n"),
        monitor.log()
    );
    drop(workload);
}

/// What the workload gives, per (panel, refId), with every variable at
/// "All": `trainer_used` and `notebook_used` are what the containers were
/// charged.
fn expectations(
    uuid: &str,
    trainer_used: u64,
    notebook_used: u64,
) -> BTreeMap<(&'static str, &'static str), Vec<Want>> {
    let trainer = [
        ("node", NODE),
        ("namespace", "ml"),
        ("pod", "trainer-0"),
        ("container", "main"),
        ("device_uuid", uuid),
        ("device_index", "0"),
    ];
    let notebook = [
        ("node", NODE),
        ("namespace", "research"),
        ("pod", "notebook-0"),
        ("container", "main"),
        ("device_uuid", uuid),
        ("device_index", "0"),
    ];
    let gpu0 = [("node", NODE), ("device_index", "0"), ("device_uuid", uuid)];
    // A lost GPU keeps its index; its UUID and model are unknown (empty
    // labels, which Prometheus drops).
    let lost = |value: f64| {
        Want::exactly(&[("node", NODE), ("device_index", LOST_GPU)], value).without("device_uuid")
    };
    let total = |value: f64| vec![Want::exactly(&[], value)];
    // Both containers' series: the trainer's and the notebook's wants.
    let both = |trainer_want: Want, notebook_want: Want| {
        vec![
            Want {
                labels: Want::exactly(&trainer, 0.0).labels,
                ..trainer_want
            },
            Want {
                labels: Want::exactly(&notebook, 0.0).labels,
                ..notebook_want
            },
        ]
    };
    let is = |value: f64| Want::exactly(&[], value);
    let cap = TRAINER_CAP as f64;
    let trainer_used = trainer_used as f64;
    let notebook_used = notebook_used as f64;
    let achieved = Want::near(&[], TRAINER_SHARE, SHARE_TOLERANCE);
    // A workload that always has work to launch waits for its share
    // whenever its kernels are not running: at least 1 - share of wall
    // time; one launching thread at most all of it (the tolerance covers
    // the counter's sample times against the scrapes').
    let throttled = Want::between(
        &[],
        1.0 - TRAINER_SHARE - SHARE_TOLERANCE,
        1.0 + SHARE_TOLERANCE,
    );
    let launches = Want::near(
        &[],
        TRAINER_SHARE / KERNEL_SECONDS,
        SHARE_TOLERANCE / KERNEL_SECONDS,
    );
    let unenforced_container = [
        ("node", NODE),
        ("namespace", "research"),
        ("pod", "notebook-0"),
        ("container", "main"),
    ];
    let unenforced = UNENFORCED_HELD as f64;

    BTreeMap::from([
        (("GPUs", "A"), total(2.0)),
        (("Unhealthy GPUs", "A"), total(1.0)),
        (("Containers on vGPUs", "A"), total(2.0)),
        (("Throttled containers", "A"), total(1.0)),
        (("Out-of-memory events in range", "A"), total(1.0)),
        (("Processes without the shim", "A"), total(1.0)),
        (
            ("Containers", "A"),
            both(is(trainer_used), is(notebook_used)),
        ),
        (("Containers", "B"), both(is(cap), is(0.0))),
        (("Containers", "C"), both(is(TRAINER_SHARE), is(1.0))),
        (("Containers", "D"), both(is(TRAINER_SHARE), is(1.0))),
        (("Containers", "E"), both(achieved.clone(), is(0.0))),
        (("Containers", "F"), both(throttled.clone(), is(0.0))),
        (("Containers", "G"), both(is(1.0), is(0.0))),
        (
            ("Device memory used against cap", "A"),
            both(is(trainer_used), is(notebook_used)),
        ),
        // The fill took the trainer to its cap exactly.
        (
            ("Device memory used against cap", "B"),
            both(is(cap), is(NOTEBOOK_HELD as f64)),
        ),
        (
            ("Device memory used against cap", "C"),
            vec![Want::exactly(&trainer, cap)],
        ),
        (
            ("Device memory used / cap", "A"),
            vec![Want::exactly(&trainer, trainer_used / cap)],
        ),
        (
            ("Out-of-memory events since start", "A"),
            both(is(1.0), is(0.0)),
        ),
        (
            ("GPU memory", "A"),
            vec![Want::exactly(
                &gpu0,
                trainer_used + notebook_used + unenforced,
            )],
        ),
        (
            ("GPU memory", "B"),
            vec![Want::exactly(&gpu0, GPU_MEMORY as f64)],
        ),
        (
            ("Compute share against achieved utilization", "A"),
            both(is(TRAINER_SHARE), is(1.0)),
        ),
        (
            ("Compute share against achieved utilization", "B"),
            both(is(TRAINER_SHARE), is(1.0)),
        ),
        (
            ("Compute share against achieved utilization", "C"),
            both(achieved, is(0.0)),
        ),
        (("Throttled time", "A"), both(throttled, is(0.0))),
        (("Kernel launches", "A"), both(launches, is(0.0))),
        (
            ("GPU utilization", "A"),
            vec![Want::near(&gpu0, TRAINER_SHARE, NVML_TOLERANCE)],
        ),
        (
            ("GPU utilization", "B"),
            vec![Want::near(
                &[("node", NODE), ("device_uuid", uuid)],
                TRAINER_SHARE,
                SHARE_TOLERANCE,
            )],
        ),
        (
            ("GPU health", "A"),
            vec![Want::exactly(&gpu0, 1.0), lost(0.0)],
        ),
        (
            ("Processes without the shim, per GPU", "A"),
            vec![Want::exactly(&gpu0, 1.0), lost(0.0)],
        ),
        (
            ("Processes without the shim, per GPU", "B"),
            vec![Want::exactly(&gpu0, unenforced), lost(0.0)],
        ),
        (
            ("Containers with processes without the shim", "A"),
            vec![Want::exactly(&unenforced_container, 1.0)],
        ),
        (
            ("Containers with processes without the shim", "B"),
            vec![Want::exactly(&unenforced_container, unenforced)],
        ),
        (
            ("Containers per GPU", "A"),
            vec![Want::exactly(&gpu0, 2.0), lost(0.0)],
        ),
        (
            ("Regions read", "A"),
            vec![Want::exactly(&[("node", NODE)], 2.0)],
        ),
        (
            ("Regions read", "B"),
            vec![Want::exactly(&[("node", NODE)], 1.0)],
        ),
        // A pass over two regions and two GPUs: above nothing, well below
        // a second.
        (
            ("Monitor pass duration", "A"),
            vec![Want::between(&[("node", NODE)], 1e-9, 1.0)],
        ),
    ])
}

/// Every target of every panel, expanded with `expansion` and evaluated
/// at `at`, returns what `expected` says; a target without an expectation
/// and an expectation without its target are failures too.
fn check_every_panel(
    server: &PrometheusServer,
    at: f64,
    panels: &[Panel],
    expansion: &Expansion,
    expected: &BTreeMap<(&'static str, &'static str), Vec<Want>>,
    failures: &mut Vec<String>,
) {
    let mut checked = BTreeSet::new();
    for panel in panels {
        for target in &panel.targets {
            let what = format!("{} {}", panel.title, target.ref_id);
            let promql = match expansion.expand(&target.expr) {
                Ok(promql) => promql,
                Err(error) => {
                    failures.push(format!("{what}: {error}"));
                    continue;
                }
            };
            let result = match server.try_query(&promql, Some(at)) {
                Ok(result) => result,
                Err(error) => {
                    failures.push(format!("{what}: {promql}: {error}"));
                    continue;
                }
            };
            eprintln!("{what}: {promql}\n    = {}", describe(&result));
            let key = (panel.title.as_str(), target.ref_id.as_str());
            let Some((&known, wants)) = expected.get_key_value(&key) else {
                failures.push(format!(
                    "{what}: no expectation (it returned {})",
                    describe(&result)
                ));
                continue;
            };
            checked.insert(known);
            if let Err(error) = check(&result, wants) {
                failures.push(format!(
                    "{what}: {promql}: {error}; returned {}",
                    describe(&result)
                ));
            }
        }
    }
    for key in expected.keys().filter(|k| !checked.contains(*k)) {
        failures.push(format!("{key:?} is expected but no panel queries it"));
    }
}

/// With the trainer and its GPU selected, every panel shows only them
/// (those about the other container show nothing), and the totals count
/// them alone.
fn check_selection(
    server: &PrometheusServer,
    at: f64,
    panels: &[Panel],
    expansion: &Expansion,
    uuid: &str,
    failures: &mut Vec<String>,
) {
    let about_others = ["Containers with processes without the shim"];
    let totals = [
        ("GPUs", 1.0),
        ("Containers on vGPUs", 1.0),
        ("Throttled containers", 1.0),
        ("Out-of-memory events in range", 1.0),
        ("Processes without the shim", 1.0),
        // Health is not filtered by GPU: a lost GPU has no UUID.
        ("Unhealthy GPUs", 1.0),
    ];
    for panel in panels {
        for target in &panel.targets {
            // Failures to expand or evaluate are reported by the first pass.
            let Ok(promql) = expansion.expand(&target.expr) else {
                continue;
            };
            let Ok(result) = server.try_query(&promql, Some(at)) else {
                continue;
            };
            let what = format!(
                "{} {} (trainer selected): {promql}",
                panel.title, target.ref_id
            );
            if about_others.contains(&panel.title.as_str()) {
                if !result.is_empty() {
                    failures.push(format!("{what}: {}", describe(&result)));
                }
                continue;
            }
            if result.is_empty() {
                failures.push(format!("{what}: no series"));
                continue;
            }
            if let Some((_, total)) = totals.iter().find(|(t, _)| *t == panel.title) {
                if let Err(error) = check(&result, &[Want::exactly(&[], *total)]) {
                    failures.push(format!("{what}: {error}"));
                }
            }
            let stray = result.iter().find(|(labels, _)| {
                let other_pod = labels.get("pod").is_some_and(|p| p != "trainer-0");
                let other_gpu = labels.get("device_uuid").is_some_and(|u| u != uuid);
                other_pod || other_gpu
            });
            if let Some(stray) = stray {
                failures.push(format!(
                    "{what}: shows {}",
                    describe(std::slice::from_ref(stray))
                ));
            }
        }
    }
}

/// Each query variable's `label_values(selector, label)` offers what
/// `offered` lists.
fn check_variables(
    server: &PrometheusServer,
    dashboard: &serde_json::Value,
    expansion: &Expansion,
    offered: &[(&str, &[&str])],
    failures: &mut Vec<String>,
) {
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .filter(|v| v["type"] == "query")
    {
        let name = text(&variable["name"], "name");
        let query = expansion
            .expand(text(&variable["query"], "variable query"))
            .unwrap_or_else(|error| panic!("${name}: {error}"));
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("${name}: {query} is no label_values(selector, label)"));
        let (selector, label) = inner.rsplit_once(',').expect("selector, label");
        let values = server
            .label_values(label.trim(), selector.trim())
            .unwrap_or_else(|error| panic!("${name}: {query}: {error}"));
        let (_, wanted) = offered
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no expected values for ${name}"));
        if values != *wanted {
            failures.push(format!(
                "${name}: {query} offers {values:?}, {wanted:?} wanted"
            ));
        }
    }
}
