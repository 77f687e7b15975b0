//! The compute backstop, end to end: two containers the node set up
//! (region, grant and mounts from the node agent's own plan) on one
//! simulated GPU, a hog granted 30 % whose process has the shim loaded but
//! launches through entry points it read from the driver's own symbol
//! table (`WORKLOAD_DRIVER=elf`: the shim sees none of its work, nothing
//! holds it to its share but the monitor) and a neighbour granted 50 %
//! under the shim. Shares are the simulated driver's own record of
//! device time over 10 s, once the backstop has had 4 s to take hold (a
//! process first seen has 2 s of device time in hand before it owes any).
//!
//! With the monitor pausing the hog until it has paid its time back, the
//! hog is held to its share and the backstop's tolerance (5 points),
//! whether it launches short kernels, 30 ms kernels or graphs. With the
//! monitor only reporting, the hog takes the whole device and the
//! neighbour next to nothing: the attack works on the simulated GPU alone.
//!
//! What the neighbour keeps depends on how the GPU orders two processes'
//! work. The simulated GPU runs kernels in launch order on one timeline, so
//! everything the hog queued in one go runs before the neighbour's next
//! kernel: the harshest model for the neighbour. A real GPU time-slices
//! between processes, so the neighbour would get its slices while the
//! hog's queue runs (the GPU suite measures that). Here, beside the short
//! kernels, the neighbour keeps at least [`KEPT_BESIDE_SHORT`]; beside a
//! burst of 32 30 ms kernels (1 s queued at once) or 100 ms graphs, it
//! waits out each burst, and keeps at least [`KEPT_BESIDE_BURSTS`].

mod common;

use common::{value, wait_for, HostDir, MonitorProcess};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use vgpu_testkit::compute::{process_share, BusyMeter, Workload};
use vgpu_testkit::node_container::NodeContainer;
use vgpu_testkit::{programs_dir, Sandbox};

const HOG_POD: &str = "0a1b2c3d-1111-4c6d-8e9f-0a1b2c3d4e5f";
const NEIGHBOUR_POD: &str = "0a1b2c3d-2222-4c6d-8e9f-0a1b2c3d4e5f";
/// The neighbour's share is measured over this long, once the backstop
/// has had this long to take hold.
const WINDOW: Duration = Duration::from_secs(10);
const SETTLE: Duration = Duration::from_secs(4);
/// What the 50 % neighbour keeps beside short kernels: 45.6 to 48.7 %
/// over 25 runs (49.7 % beside the same hog held by its shim); the hog's
/// tolerance and the bursts it queues each time it is resumed, each run
/// before the neighbour's next kernel, take the rest.
const KEPT_BESIDE_SHORT: f64 = 40.0;
/// What it keeps beside bursts of 100 ms to 1 s queued at once: 32.1 and
/// 34.3 % measured (49.9 and 42.9 % beside the same hogs held by their
/// shims, which meter each launch instead of pausing whole processes).
const KEPT_BESIDE_BURSTS: f64 = 25.0;
/// The most the 30 % hog may take: its share, the backstop's tolerance
/// (5 points) and 5 points for the window's edges.
const HOG_HELD: f64 = 40.0;

/// The cases take the machine in turns: a neighbour short of CPU falls
/// short of its share whatever the hog does.
static MACHINE: Mutex<()> = Mutex::new(());

/// How the hog runs.
#[derive(Clone, Copy, Debug)]
enum Hog {
    /// The node's preload given, every entry point read from the driver's
    /// symbol table.
    PastTheShim,
    /// As the node gives it: held by the shim.
    UnderShim,
}

struct Outcome {
    neighbour: f64,
    hog: f64,
    monitor: MonitorProcess,
    hog_process: Workload,
    /// Kept while the monitor is read: its containers' directories.
    _host: HostDir,
    _sandbox: Sandbox,
}

/// The hog (`pattern` of `kernel`s, past the shim) and the neighbour
/// (`sync k1ms` under the shim) side by side under a monitor with `args`;
/// their shares of the device over [`WINDOW`] after [`SETTLE`].
fn hog_beside_neighbour(
    name: &str,
    hog: Hog,
    pattern: &str,
    kernel: &str,
    args: &[&str],
) -> Outcome {
    let sandbox = Sandbox::new(name, 1, "8Gi");
    let uuid = sandbox.gpu_uuid();
    let host = HostDir::new(name);
    let hog_container = NodeContainer::prepare(&host.root, HOG_POD, "hog", &[(&uuid, 1 << 30, 30)]);
    let neighbour = NodeContainer::prepare(
        &host.root,
        NEIGHBOUR_POD,
        "neighbour",
        &[(&uuid, 1 << 30, 50)],
    );
    let mut all = vec!["--no-kubernetes"];
    all.extend_from_slice(args);
    let monitor = MonitorProcess::on_simulated_gpu(&sandbox, &host, &all);
    let seconds = (SETTLE + WINDOW).as_secs_f64() + 5.0;
    let workload = programs_dir().join("workload");
    let mut hog_command = sandbox.command(&workload);
    hog_container.give_env(&mut hog_command);
    if let Hog::PastTheShim = hog {
        hog_command.env("WORKLOAD_DRIVER", "elf");
    }
    hog_command.args(Workload::args(pattern, kernel, seconds, 1));
    let hog_process = Workload::spawn(&mut hog_container.wrap(&hog_command));
    let mut neighbour_command = sandbox.command(&workload);
    neighbour_command.args(Workload::args("sync", "k1ms", seconds, 1));
    neighbour.give_env(&mut neighbour_command);
    let neighbour_process = Workload::spawn(&mut neighbour.wrap(&neighbour_command));
    let mut meter = BusyMeter::new(&sandbox);
    std::thread::sleep(SETTLE);
    let (hog_from, neighbour_from) = (
        meter.read(0, hog_process.child.id()),
        meter.read(0, neighbour_process.child.id()),
    );
    std::thread::sleep(WINDOW);
    let (hog_to, neighbour_to) = (
        meter.read(0, hog_process.child.id()),
        meter.read(0, neighbour_process.child.id()),
    );
    drop(neighbour_process);
    Outcome {
        neighbour: process_share(neighbour_from, neighbour_to),
        hog: process_share(hog_from, hog_to),
        monitor,
        hog_process,
        _host: host,
        _sandbox: sandbox,
    }
}

/// The hog past the shim, held by the monitor, beside the neighbour:
/// the hog is held to its share and tolerance, the neighbour keeps
/// `neighbour_keeps`, and only the hog was paused.
fn the_hog_is_held_to_its_share(name: &str, pattern: &str, kernel: &str, neighbour_keeps: f64) {
    let _turn = MACHINE.lock().unwrap_or_else(PoisonError::into_inner);
    // What the neighbour keeps beside the same hog held by its shim, for
    // the record (`VGPU_COMPARE_SHIM=1 ... -- --nocapture`).
    let beside_shim = std::env::var_os("VGPU_COMPARE_SHIM")
        .map(|_| hog_beside_neighbour(name, Hog::UnderShim, pattern, kernel, &[]).neighbour);
    let outcome = hog_beside_neighbour(name, Hog::PastTheShim, pattern, kernel, &[]);
    if let Some(beside_shim) = beside_shim {
        eprintln!(
            "{pattern} {kernel}: the neighbour beside the hog held by its shim: {beside_shim:.1} %"
        );
    }
    eprintln!(
        "{pattern} {kernel}: beside the hog past the shim, the neighbour {:.1} %, the hog {:.1} %",
        outcome.neighbour, outcome.hog
    );
    let log = outcome.monitor.log();
    assert!(
        outcome.hog <= HOG_HELD && outcome.neighbour >= neighbour_keeps,
        "the 30 % hog took {:.1} %, the 50 % neighbour kept {:.1} %:\n{log}",
        outcome.hog,
        outcome.neighbour
    );
    assert!(
        log.contains("paused until it has paid the time back"),
        "{log}"
    );
    let hog = [("pod", HOG_POD), ("container", "hog")];
    outcome
        .monitor
        .wait_for_metrics(Duration::from_secs(10), |samples| {
            (value(samples, "vgpu_container_over_share_total", &hog) >= Some(1.0)).then_some(())
        });
    let neighbour = [("pod", NEIGHBOUR_POD), ("container", "neighbour")];
    let samples = outcome.monitor.scrape();
    assert_eq!(
        value(&samples, "vgpu_container_over_share_total", &neighbour),
        Some(0.0),
        "the neighbour, within its share, is never held:\n{log}"
    );
}

#[test]
fn a_hog_of_short_kernels_is_held_to_its_share() {
    the_hog_is_held_to_its_share("compute-hog-k20us", "burst", "k20us", KEPT_BESIDE_SHORT);
}

#[test]
fn a_hog_of_30ms_kernels_is_held_to_its_share() {
    the_hog_is_held_to_its_share("compute-hog-k30ms", "burst", "k30ms", KEPT_BESIDE_BURSTS);
}

#[test]
fn a_hog_of_graphs_is_held_to_its_share() {
    the_hog_is_held_to_its_share("compute-hog-graph", "graph", "k1ms", KEPT_BESIDE_BURSTS);
}

#[test]
fn with_action_report_the_hog_takes_the_neighbours_time_and_is_reported() {
    let _turn = MACHINE.lock().unwrap_or_else(PoisonError::into_inner);
    let mut outcome = hog_beside_neighbour(
        "compute-hog-report",
        Hog::PastTheShim,
        "burst",
        "k30ms",
        &["--over-cap-action", "report"],
    );
    eprintln!(
        "report only: neighbour {:.1} %, hog {:.1} %",
        outcome.neighbour, outcome.hog
    );
    assert!(
        outcome.hog > 90.0 && outcome.neighbour < 10.0,
        "the hog should have taken the neighbour's time: hog {:.1} %, neighbour {:.1} %",
        outcome.hog,
        outcome.neighbour
    );
    wait_for(Duration::from_secs(10), || {
        outcome
            .monitor
            .log()
            .contains("reported only")
            .then_some(())
    })
    .unwrap_or_else(|| panic!("not reported:\n{}", outcome.monitor.log()));
    assert!(
        outcome
            .hog_process
            .child
            .try_wait()
            .expect("wait")
            .is_none(),
        "left running"
    );
}

/// A monitor killed while it had a process paused leaves it stopped; the
/// next one resumes it when it first sees it.
#[test]
fn a_process_left_paused_by_a_monitor_before_is_resumed() {
    let _turn = MACHINE.lock().unwrap_or_else(PoisonError::into_inner);
    let name = "compute-leftover";
    let sandbox = Sandbox::new(name, 1, "8Gi");
    let uuid = sandbox.gpu_uuid();
    let host = HostDir::new(name);
    let container = NodeContainer::prepare(&host.root, HOG_POD, "hog", &[(&uuid, 1 << 30, 30)]);
    let mut command = sandbox.command(&programs_dir().join("workload"));
    command.args(Workload::args("sync", "k1ms", 30.0, 1));
    container.give_env(&mut command);
    let process = Workload::spawn(&mut container.wrap(&command));
    let pid = process.child.id();
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                let state = stat[stat.rfind(')')? + 1..].trim_start().chars().next()?;
                Some(state == 'T')
            })
            .unwrap_or(false)
    };
    // SAFETY: a child of this test, alive (it printed ready).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    wait_for(Duration::from_secs(5), || stopped().then_some(())).expect("the process stopped");
    let monitor = MonitorProcess::on_simulated_gpu(&sandbox, &host, &["--no-kubernetes"]);
    wait_for(Duration::from_secs(15), || (!stopped()).then_some(()))
        .unwrap_or_else(|| panic!("still stopped:\n{}", monitor.log()));
    assert!(monitor.log().contains("found stopped"), "{}", monitor.log());
}
