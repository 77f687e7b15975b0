//! `vgpu doctor` on the simulated GPU: the facts it shows are the ones the
//! simulated GPU is configured with, its probe finds the cap holding, and
//! what is missing (the shim, the driver, the monitor, a GPU that answers
//! nothing) is a failure finding with a hint, not a crash. One test runs
//! the real node monitor (`vgpu-monitor`, from the same cargo target
//! directory) over a region and checks doctor lists that region's figures.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use vgpu_node_contract::region::Region;
use vgpu_testkit::*;

const GIB: u64 = 1 << 30;

/// `vgpu ARGS...` with `sandbox`'s simulated GPU and the shim under test.
fn vgpu(sandbox: &Sandbox, args: &[&str]) -> Command {
    let mut command = sandbox.command_without_shim(Path::new(env!("CARGO_BIN_EXE_vgpu")));
    command
        .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE")
        .env("VGPU_LIBRARY", shim_library())
        .env("NODE_NAME", "doctor-node")
        .args(args);
    command
}

/// Runs `command`; its status, stdout and stderr.
fn output(command: &mut Command) -> (Option<i32>, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = command.stdin(Stdio::null()).output().expect("run vgpu");
    (
        status.code(),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// The findings of `section` in a `--json` report.
fn findings<'a>(report: &'a serde_json::Value, section: &str) -> Vec<&'a serde_json::Value> {
    report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["section"] == section)
        .collect()
}

/// A loopback metrics URL where nothing listens.
fn unreachable_monitor() -> String {
    format!("http://127.0.0.1:{}/metrics", free_port())
}

/// `GET /metrics` of a monitor; the body when it answers 200.
fn scrape(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// The node monitor over `containers`, on `sandbox`'s simulated GPU.
struct Monitor {
    child: Child,
    port: u16,
}

impl Monitor {
    fn start(sandbox: &Sandbox, containers: &Path) -> Self {
        let binary = target_dir().join("vgpu-monitor");
        assert!(
            binary.is_file(),
            "{} is missing: build the workspace first (`cargo build --workspace --release`)",
            binary.display()
        );
        let port = free_port();
        let child = sandbox
            .command_without_shim(&binary)
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--containers-dir")
            .arg(containers)
            .arg("--nvml-library")
            .arg(sandbox.lib_dir.join("libnvidia-ml.so.1"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start vgpu-monitor");
        Self { child, port }
    }

    /// Scrapes until `check` accepts the exposition: the monitor has no
    /// signal for "this region read", so its answer is polled (it reads
    /// regions every 100 ms), with a deadline.
    fn wait_for(&mut self, what: &str, check: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("vgpu-monitor exited with {status}");
            }
            match scrape(self.port) {
                Some(body) if check(&body) => return,
                last => assert!(
                    Instant::now() < deadline,
                    "the monitor never showed {what}; last scrape: {last:?}"
                ),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn doctor_shows_the_simulated_node_as_its_agents_and_monitor_see_it() {
    let mut sandbox = Sandbox::new("doctor-facts", 2, "12Gi");
    sandbox
        .set("SIMGPU_MEMORY_1", "8Gi")
        .set("SIMGPU_NUMA", "0,1")
        .set("SIMGPU_NVLINK", "0,1")
        .set("SIMGPU_NAME", "vgpu Doctor GPU")
        .set("SIMGPU_NVML_DRIVER_VERSION", "575.57.08")
        .set("SIMGPU_DRIVER_VERSION", "12090");
    let containers = sandbox.dir.join("containers");
    std::fs::create_dir_all(&containers).expect("containers dir");

    // A region the monitor reads: 512 MiB held under a 2 GiB cap and 30 %.
    let mut holder = spawn_until_ready(
        vgpu(
            &sandbox,
            &["--root", containers.to_str().expect("utf8"), "run"],
        )
        .args(["--name", "held", "--memory", "2g", "--cores", "30", "--"])
        .arg(programs_dir().join("probe"))
        .args(["dlsym", "hold", "536870912"]),
    );
    // The shim's record of GPU 0's UUID, read through CUDA: a path of its
    // own to the simulated GPU's identity, apart from NVML.
    let region =
        Region::open_existing(&containers.join("local-held/region.cache")).expect("region");
    let uuid0 = region.device_uuid(0).expect("the shim records the UUID");

    let mut monitor = Monitor::start(&sandbox, &containers);
    monitor.wait_for("the region's memory", |body| {
        body.lines().any(|line| {
            line.starts_with("vgpu_container_memory_used_bytes{")
                && line.contains("local-held")
                && line.ends_with(" 536870912")
        })
    });
    let url = format!("http://127.0.0.1:{}/metrics", monitor.port);

    let (code, stdout, stderr) = output(&mut vgpu(
        &sandbox,
        &["doctor", "--json", "--monitor", &url],
    ));
    let report: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|error| panic!("not JSON ({error}): {stdout}\nstderr: {stderr}"));
    assert_eq!(code, Some(0), "{stdout}\nstderr: {stderr}");
    assert_eq!(report["summary"]["ok"], true);
    assert_eq!(report["summary"]["failed"], 0);
    assert_eq!(report["summary"]["warnings"], 0, "{:#}", report["findings"]);
    // Progress on the slow step goes to stderr, never into the JSON.
    assert!(stderr.contains("CUDA program"), "{stderr}");

    // 1. The driver.
    let driver = &report["driver"];
    assert_eq!(driver["driver_version"], "575.57.08");
    assert_eq!(driver["cuda_driver_version"], "12.9");
    assert_eq!(driver["cuda_driver_version_number"], 12090);
    assert_eq!(driver["nvml_library"], "libnvidia-ml.so.1");
    assert_eq!(
        driver["nvml_library_path"],
        sandbox
            .lib_dir
            .join("libnvidia-ml.so.1")
            .display()
            .to_string()
    );
    assert_eq!(
        driver["nvml_library_file"],
        std::fs::canonicalize(simulated_gpu_library())
            .expect("canonical")
            .display()
            .to_string()
    );

    // 2. The GPUs, as configured.
    let gpus = report["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 2, "{gpus:?}");
    assert_eq!(gpus[0]["uuid"], uuid0.as_str());
    assert_ne!(gpus[1]["uuid"], gpus[0]["uuid"]);
    for (i, (gpu, mib)) in gpus.iter().zip([12288u64, 8192]).enumerate() {
        assert_eq!(gpu["index"], i);
        assert_eq!(gpu["name"], "vgpu Doctor GPU");
        assert_eq!(gpu["memory_total_mib"], mib);
        assert_eq!(gpu["memory_total_bytes"], mib << 20);
        assert_eq!(gpu["numa_node"], i);
        assert_eq!(gpu["nvlink_island"], 0);
        assert_eq!(gpu["nvlink_peers"], serde_json::json!([1 - i]));
        assert_eq!(gpu["pci_bus_id"], format!("00000000:{:02X}:00.0", i + 1));
        assert_eq!(gpu["compute_capability"], "9.0");
        assert_eq!(gpu["healthy"], true);
    }

    // 3. The DRA slice: one device per GPU, with the GPU's figures.
    let slice = &report["resource_slice"];
    assert_eq!(slice["metadata"]["name"], "vgpu.io-doctor-node");
    assert_eq!(slice["spec"]["driver"], "vgpu.io");
    assert_eq!(slice["spec"]["pool"]["name"], "doctor-node");
    let devices = slice["spec"]["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2);
    for (device, gpu) in devices.iter().zip(gpus) {
        let i = gpu["index"].as_u64().expect("index");
        assert_eq!(device["name"], format!("gpu-{i}"));
        let attributes = &device["attributes"];
        assert_eq!(attributes["uuid"]["string"], gpu["uuid"]);
        assert_eq!(attributes["numaNode"]["int"], gpu["numa_node"]);
        assert_eq!(attributes["driverVersion"]["string"], "575.57.08");
        let memory = gpu["memory_total_bytes"].as_u64().expect("bytes");
        assert_eq!(device["capacity"]["memory"]["value"], memory.to_string());
        assert_eq!(device["capacity"]["cores"]["value"], "100");
    }

    // 4. The probe: the shim loaded, and the 1 GiB cap held.
    let probe = &report["probe"];
    assert_eq!(probe["library"], shim_library().display().to_string());
    assert_eq!(probe["shim_loaded"], true, "{probe}");
    assert_eq!(probe["cap_bytes"], GIB);
    assert_eq!(probe["mem_total_bytes"], GIB);
    assert_eq!(probe["under_cap_result"], 0);
    assert_eq!(probe["past_cap_result"], 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert!(probe["past_cap_bytes"].as_u64().expect("past") > 0);
    assert_eq!(probe["cap_held"], true);

    // 5. The monitor lists the region's figures.
    let monitor_report = &report["monitor"];
    assert_eq!(monitor_report["reachable"], true);
    assert_eq!(monitor_report["regions"], 1);
    assert_eq!(monitor_report["gpus"].as_array().map(Vec::len), Some(2));
    // One entry per GPU of the region (the run's limits are on every GPU;
    // its program holds memory on GPU 0).
    let held: Vec<&serde_json::Value> = monitor_report["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .filter(|c| c["container"] == "local-held")
        .collect();
    assert_eq!(held.len(), 2, "{monitor_report}");
    for (entry, gpu) in held.iter().zip(gpus) {
        assert_eq!(entry["device_index"], gpu["index"]);
        assert_eq!(entry["device_uuid"], gpu["uuid"]);
        assert_eq!(entry["memory_limit_bytes"], 2 * GIB);
        assert_eq!(entry["compute_share_ratio"], 0.3);
    }
    assert_eq!(held[0]["memory_used_bytes"], 512u64 << 20);
    assert_eq!(held[1]["memory_used_bytes"], 0);
    assert_eq!(monitor_report["gpus"][0]["memory_used_bytes"], 512u64 << 20);

    // The text report says the same, one marked line per finding.
    let (code, text, _) = output(&mut vgpu(&sandbox, &["doctor", "--monitor", &url]));
    assert_eq!(code, Some(0), "{text}");
    for line in [
        "  ok    driver 575.57.08, CUDA 12.9",
        &format!("  ok    GPU 0  {uuid0}  vgpu Doctor GPU  12288 MiB  132 SMs  NUMA 0  NVLink island 0 (peers [1])  PCI 00000000:01:00.0  healthy"),
        "        capacity memory 8589934592 (8192 MiB)",
        "  ok    cuMemGetInfo: total 1024 MiB (the cap)",
        "MiB (1 MiB more than is left of the cap) refused with CUDA_ERROR_OUT_OF_MEMORY",
        "  ok    local-held on GPU 0: 512 MiB used, cap 2048 MiB; share 30 %",
    ] {
        assert!(text.contains(line), "{line:?} missing from:\n{text}");
    }
    assert!(
        text.trim_end().ends_with("0 warnings, 0 failures."),
        "{text}"
    );

    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());
}

#[test]
fn a_missing_shim_a_lost_gpu_and_no_monitor_are_failures_with_hints() {
    let mut sandbox = Sandbox::new("doctor-missing", 2, "8Gi");
    sandbox.set("SIMGPU_LOST_DEVICES", "1");
    let url = unreachable_monitor();
    let (code, text, stderr) = output(&mut vgpu(
        &sandbox,
        &[
            "doctor",
            "--library",
            "/nonexistent/libvgpu.so",
            "--monitor",
            &url,
        ],
    ));
    assert_eq!(code, Some(1), "{text}\nstderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let after = |start: &str| {
        let at = text
            .find(start)
            .unwrap_or_else(|| panic!("{start:?} missing from:\n{text}"));
        &text[at..]
    };
    // NVML loads; the lost GPU stops the plugin's description of the GPUs.
    assert!(
        text.contains("  ok    NVML libnvidia-ml.so.1 loaded: "),
        "{text}"
    );
    let gpus = after("  fail  the GPUs cannot be described: ");
    assert!(
        gpus.lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("        hint: ")),
        "{text}"
    );
    let shim =
        after("  fail  the shim is missing: --library /nonexistent/libvgpu.so: no such file");
    assert!(
        shim.lines()
            .nth(1)
            .is_some_and(|l| l.contains("cargo build --release -p vgpu-shim")),
        "{text}"
    );
    let monitor = after(&format!("Node monitor ({url})\n  fail  not reachable: "));
    assert!(
        monitor
            .lines()
            .nth(2)
            .is_some_and(|l| l.contains("Is vgpu-monitor running")),
        "{text}"
    );
    assert!(text.trim_end().ends_with("3 failures."), "{text}");
    // No probe ran, so no progress line.
    assert!(!stderr.contains("CUDA program"), "{stderr}");
}

#[test]
fn without_a_driver_each_part_says_what_is_missing() {
    let sandbox = Sandbox::new("doctor-nodriver", 1, "8Gi");
    // Libraries by the driver's names that do not load: the loader stops
    // at them, even on a machine with NVIDIA's driver installed.
    let broken = sandbox.dir.join("broken");
    std::fs::create_dir_all(&broken).expect("mkdir");
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::fs::write(broken.join(name), b"").expect("write");
    }
    let url = unreachable_monitor();
    let (code, stdout, stderr) = output(
        vgpu(&sandbox, &["doctor", "--json", "--monitor", &url]).env("LD_LIBRARY_PATH", &broken),
    );
    assert_eq!(code, Some(1), "{stdout}\nstderr: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(report["summary"]["ok"], false);
    assert_eq!(report["driver"]["nvml_loaded"], false);
    assert_eq!(report["gpus"], serde_json::json!([]));
    assert_eq!(report["resource_slice"], serde_json::Value::Null);
    let driver = findings(&report, "driver");
    assert_eq!(driver.len(), 1);
    assert_eq!(driver[0]["status"], "fail");
    assert!(
        driver[0]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("nvidia-smi")),
        "{driver:?}"
    );

    // The shim loads; the driver library it wraps does not.
    let probe = &report["probe"];
    assert_eq!(probe["shim_loaded"], true, "{probe}");
    assert_eq!(probe["failed_step"], "dlopen libcuda.so.1");
    assert!(
        probe["error"]
            .as_str()
            .is_some_and(|e| e.contains("libcuda.so.1")),
        "{probe}"
    );
    assert_eq!(probe["cap_held"], false);
    let shim = findings(&report, "shim");
    let failed: Vec<_> = shim.iter().filter(|f| f["status"] == "fail").collect();
    assert_eq!(failed.len(), 1, "{shim:?}");
    assert!(failed[0]["hint"]
        .as_str()
        .is_some_and(|h| h.contains("LD_LIBRARY_PATH")));

    let monitor = &report["monitor"];
    assert_eq!(monitor["reachable"], false);
    assert_eq!(monitor["url"], url.as_str());
    assert!(monitor["error"].as_str().is_some_and(|e| !e.is_empty()));
    assert_eq!(findings(&report, "monitor")[0]["status"], "fail");
}

#[test]
fn help_names_every_section_and_bad_options_exit_2() {
    let sandbox = Sandbox::new("doctor-usage", 1, "8Gi");
    let (code, help, _) = output(&mut vgpu(&sandbox, &["doctor", "--help"]));
    assert_eq!(code, Some(0));
    for section in [
        "Driver",
        "GPUs",
        "DRA",
        "Shim",
        "Monitor",
        "--json",
        "Exit status",
    ] {
        assert!(help.contains(section), "{section} missing from:\n{help}");
    }
    let (code, top_help, _) = output(&mut vgpu(&sandbox, &["--help"]));
    assert_eq!(code, Some(0));
    assert!(!top_help.contains("doctor-probe"));
    let (code, stdout, stderr) = output(&mut vgpu(
        &sandbox,
        &["doctor", "--monitor", "https://node:31992/metrics"],
    ));
    assert_eq!(code, Some(2), "{stdout}");
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("plain HTTP"), "{stderr}");
}
