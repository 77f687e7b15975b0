//! `vgpu-monitor-bench`: how long `/metrics` takes to render and serve with
//! many containers and GPUs, how long one monitor pass takes, and how much
//! memory the monitor holds.
//!
//! ```sh
//! cargo build --release --workspace
//! cargo run --release -p vgpu-monitor --bin vgpu-monitor-bench -- [CONTAINERS] [GPUS]
//! ```
//!
//! Defaults: 100 containers x 8 GPUs. Regions are real region files in a
//! temporary host directory, each with a live process slot charging memory
//! on every GPU. When the simulated GPU (`libsimgpu.so`) sits next to this
//! binary, NVML figures come from it (8 simulated GPUs), and one real
//! process per container holds 64 MiB on one of them, so NVML lists a GPU
//! process per container for the monitor to find an owner for and hold to
//! its grant (`--no-gpu-processes` leaves them out); otherwise host GPU
//! figures are left out.

use anyhow::Context;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vgpu_monitor::daemon::{Monitor, MonitorConfig};
use vgpu_monitor::names::PodDirectory;
use vgpu_node_contract::region::{MemoryKind, Region, RegionLimits};

const USAGE: &str = "usage: vgpu-monitor-bench [CONTAINERS] [GPUS] [--no-gpu-processes]

How long one vgpu-monitor pass takes, how long /metrics takes to render
and serve, and how much memory the monitor holds, with CONTAINERS
containers (default 100) of GPUS GPUs each (default 8, at most 16). With
the simulated GPU next to this binary, one process per container holds
memory on a GPU, so that NVML lists it (--no-gpu-processes: none).";

fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let with_processes = !std::env::args().any(|a| a == "--no-gpu-processes");
    let mut args = std::env::args()
        .skip(1)
        .filter(|a| a != "--no-gpu-processes");
    let count = |name: &str, given: Option<String>, default: usize| -> anyhow::Result<usize> {
        given.map_or(Ok(default), |text| {
            text.parse()
                .with_context(|| format!("{name} must be a whole number, not {text:?}\n\n{USAGE}"))
        })
    };
    let containers = count("CONTAINERS", args.next(), 100)?;
    let gpus = count("GPUS", args.next(), 8)?;
    anyhow::ensure!(args.next().is_none(), "too many arguments\n\n{USAGE}");
    anyhow::ensure!(gpus <= 16, "at most 16 GPUs per container");

    let root = std::env::temp_dir().join(format!("vgpu-monitor-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let hosts = root.join("containers");
    std::fs::create_dir_all(&hosts).context("bench directory")?;
    let result = run(&root, &hosts, containers, gpus, with_processes);
    let _ = std::fs::remove_dir_all(&root);
    result
}

/// Points NVML at the simulated GPU when it is next to this binary.
fn simulated_nvml(root: &Path, gpus: usize) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let library = exe.parent()?.join("libsimgpu.so");
    if !library.exists() {
        return None;
    }
    let lib_dir = root.join("lib");
    std::fs::create_dir_all(&lib_dir).ok()?;
    let alias = lib_dir.join("libnvidia-ml.so.1");
    std::os::unix::fs::symlink(&library, &alias).ok()?;
    // Single-threaded still: nothing reads the environment concurrently.
    std::env::set_var("SIMGPU_DEVICES", gpus.to_string());
    std::env::set_var("SIMGPU_MEMORY", "80Gi");
    std::env::set_var("SIMGPU_STATE", root.join("simgpu.state"));
    Some(alias)
}

/// One process per container, each holding 64 MiB on one simulated GPU
/// (the containers' GPUs in turn), ready when this returns.
fn gpu_processes(root: &Path, containers: usize, gpus: usize) -> anyhow::Result<Vec<Child>> {
    let probe = vgpu_testkit::programs_dir().join("probe");
    let lib_dir = root.join("lib");
    let library = std::env::current_exe()?
        .parent()
        .context("the bench's folder")?
        .join("libsimgpu.so");
    let cuda = lib_dir.join("libcuda.so.1");
    if !cuda.exists() {
        std::os::unix::fs::symlink(&library, &cuda)?;
    }
    let mut children = Vec::with_capacity(containers);
    for index in 0..containers {
        let mut child = Command::new(&probe)
            .args(["dlsym", "hold", &(64u64 << 20).to_string()])
            .env_clear()
            .env("LD_LIBRARY_PATH", &lib_dir)
            .env("SIMGPU_DEVICES", gpus.to_string())
            .env("SIMGPU_MEMORY", "80Gi")
            .env("SIMGPU_STATE", root.join("simgpu.state"))
            .env("SIMGPU_VISIBLE_DEVICES", (index % gpus).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", probe.display()))?;
        let stdout = child.stdout.take().context("the process's output")?;
        let ready = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "ready");
        anyhow::ensure!(ready, "GPU process {index} never held its memory");
        children.push(child);
    }
    Ok(children)
}

fn run(
    root: &Path,
    hosts: &Path,
    containers: usize,
    gpus: usize,
    with_processes: bool,
) -> anyhow::Result<()> {
    let nvml = simulated_nvml(root, gpus);
    let mut config = MonitorConfig::for_root(hosts.to_path_buf());
    config.nvml = nvml.clone().map(Some);
    config.hami_names = true;
    config.cleanup_grace = None;
    let mut monitor = Monitor::new(config, PodDirectory::disabled());
    monitor.tick();
    let mut uuids: Vec<String> = monitor
        .shared()
        .snapshot()
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .collect();
    if uuids.len() < gpus {
        uuids = (0..gpus).map(|i| format!("GPU-bench-{i:04}")).collect();
    }

    // The containers: one region each, a live slot charging every GPU.
    let mut regions = Vec::with_capacity(containers);
    for index in 0..containers {
        let dir = hosts.join(format!(
            "{:08x}-0000-4000-8000-{:012x}_worker",
            index, index
        ));
        std::fs::create_dir_all(&dir)?;
        let mut limits = RegionLimits::default();
        for device in 0..gpus {
            limits.memory_limit[device] = 8 << 30;
            limits.sm_limit[device] = 10;
            limits.sm_burst[device] = 30;
        }
        limits.priority = (index % 3) as i32;
        let region = Region::open_or_create(&dir.join("region.cache"), &limits)?;
        let slot = region.claim_slot(index as u32 + 1, 0)?;
        for (device, uuid) in uuids.iter().enumerate().take(gpus) {
            region.set_device_uuid(device, uuid);
            for (kind, bytes) in [
                (MemoryKind::Context, 256u64 << 20),
                (MemoryKind::Module, 4 << 20),
                (MemoryKind::Data, (index as u64 + 1) << 24),
            ] {
                let _ = region.reserve(slot, device, kind, bytes)?;
            }
            let bucket = &region.layout().devices[device].compute;
            bucket
                .launches
                .store(index as u64 * 1000, Ordering::Relaxed);
            bucket
                .throttled_ns
                .store(index as u64 * 1_000_000, Ordering::Relaxed);
        }
        regions.push(region);
    }

    let mut processes = if with_processes && nvml.is_some() {
        gpu_processes(root, containers, gpus)?
    } else {
        Vec::new()
    };
    // The first passes find an owner for every GPU process (16 a pass):
    // timed apart, as what a burst of new pods costs, from the passes of a
    // node whose processes are known.
    let mut first_times = Vec::new();
    for _ in 0..FIRST_PASSES {
        let started = Instant::now();
        monitor.tick();
        first_times.push(started.elapsed());
    }
    let mut tick_times = Vec::new();
    for _ in 0..100 {
        let started = Instant::now();
        monitor.tick();
        tick_times.push(started.elapsed());
    }
    let shared = monitor.shared();
    let snapshot = shared.snapshot();
    anyhow::ensure!(
        snapshot.devices.len() == containers * gpus,
        "expected {} container devices, read {}",
        containers * gpus,
        snapshot.devices.len()
    );

    let mut render_plain = Vec::new();
    let mut render_hami = Vec::new();
    for _ in 0..200 {
        let started = Instant::now();
        let text = vgpu_monitor::metrics::render(&snapshot, false);
        render_plain.push(started.elapsed());
        let started = Instant::now();
        let _ = vgpu_monitor::metrics::render(&snapshot, true);
        render_hami.push(started.elapsed());
        drop(text);
    }
    let plain_text = vgpu_monitor::metrics::render(&snapshot, false);
    let hami_text = vgpu_monitor::metrics::render(&snapshot, true);
    let series = |text: &[u8]| {
        String::from_utf8_lossy(text)
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count()
    };
    drop(monitor);

    // The real daemon, as a child process over the same directory.
    let plain = serve_figures(hosts, nvml.as_deref(), false, containers)?;
    let hami = serve_figures(hosts, nvml.as_deref(), true, containers)?;

    println!(
        "vgpu-monitor: {containers} containers x {gpus} GPUs ({} container devices; NVML: {}; {} GPU processes in NVML's lists)",
        containers * gpus,
        if nvml.is_some() {
            "simulated GPU"
        } else {
            "none"
        },
        processes.len()
    );
    println!(
        "exposition: {} series / {} KiB by default, {} series / {} KiB with --hami-metric-names",
        series(&plain_text),
        plain_text.len() / 1024,
        series(&hami_text),
        hami_text.len() / 1024
    );
    println!();
    println!("| measurement | p50 | p99 |");
    println!("|---|---:|---:|");
    row(
        "monitor pass (rescan, read all regions and NVML, hold the grants, arbitrate, publish)",
        &mut tick_times,
    );
    row(
        &format!(
            "monitor pass, the first {FIRST_PASSES} (the regions and {} GPU processes appearing)",
            processes.len()
        ),
        &mut first_times,
    );
    row("render /metrics", &mut render_plain);
    row(
        "render /metrics, with --hami-metric-names",
        &mut render_hami,
    );
    for (label, figures) in [("", &plain), (", with --hami-metric-names", &hami)] {
        row(
            &format!(
                "GET /metrics from the daemon, a new pass since the last scrape (renders){label}"
            ),
            &mut figures.fresh.clone(),
        );
        row(
            &format!("GET /metrics from the daemon, back to back (rendered once per pass){label}"),
            &mut figures.cached.clone(),
        );
    }
    println!();
    println!(
        "daemon resident memory (VmRSS, after the scrapes): {:.1} MB; {:.1} MB with --hami-metric-names",
        plain.rss_kib as f64 / 1024.0,
        hami.rss_kib as f64 / 1024.0
    );
    drop(regions);
    for child in &mut processes {
        drop(child.stdin.take());
        let _ = child.wait();
    }
    Ok(())
}

struct Served {
    fresh: Vec<Duration>,
    cached: Vec<Duration>,
    rss_kib: u64,
}

/// Starts the `vgpu-monitor` binary next to this one over `hosts`, times
/// scrapes, and reads its resident memory.
fn serve_figures(
    hosts: &Path,
    nvml: Option<&Path>,
    hami: bool,
    containers: usize,
) -> anyhow::Result<Served> {
    let exe = std::env::current_exe()?
        .parent()
        .context("bench binary directory")?
        .join("vgpu-monitor");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut command = std::process::Command::new(&exe);
    command
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--containers-dir")
        .arg(hosts)
        .args(["--no-kubernetes", "--no-cleanup", "--log-level", "warn"]);
    match nvml {
        Some(path) => command.arg("--nvml-library").arg(path),
        None => command.arg("--no-nvml"),
    };
    if hami {
        command.arg("--hami-metric-names");
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let result = (|| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let wanted = format!("vgpu_monitor_regions {containers}");
        loop {
            if let Ok(body) = get(addr) {
                if String::from_utf8_lossy(&body).contains(&wanted) {
                    break;
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the daemon never read every region"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut fresh = Vec::new();
        for _ in 0..100 {
            // The daemon passes every 100 ms: each scrape finds a new pass.
            std::thread::sleep(Duration::from_millis(110));
            let started = Instant::now();
            get(addr)?;
            fresh.push(started.elapsed());
        }
        let mut cached = Vec::new();
        for _ in 0..200 {
            let started = Instant::now();
            get(addr)?;
            cached.push(started.elapsed());
        }
        let rss_kib = vm_rss_kib(child.id()).context("reading the daemon's VmRSS")?;
        Ok(Served {
            fresh,
            cached,
            rss_kib,
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Passes timed apart at the start: enough for the owners of 100 GPU
/// processes, looked up 16 a pass, to be found.
const FIRST_PASSES: usize = 10;

fn row(what: &str, times: &mut [Duration]) {
    times.sort();
    let at = |q: f64| {
        let index = ((times.len() as f64 - 1.0) * q).round() as usize;
        times[index.min(times.len() - 1)].as_secs_f64() * 1e3
    };
    println!("| {what} | {:.2} ms | {:.2} ms |", at(0.5), at(0.99));
}

/// `GET /metrics`; the whole response, as bytes (a client that reads it
/// into a buffer sized for it).
fn get(addr: SocketAddr) -> anyhow::Result<Vec<u8>> {
    let mut stream = TcpStream::connect(addr)?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut body = Vec::with_capacity(8 << 20);
    stream.read_to_end(&mut body)?;
    anyhow::ensure!(body.starts_with(b"HTTP/1.1 200"), "bad response");
    Ok(body)
}

fn vm_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
