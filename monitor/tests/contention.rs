//! Contention (arbitration rule 5), measured: two containers at 30 and 70 %
//! run the same kernel loop under the shim on one simulated GPU in wall
//! timing, where every switch between the two processes costs device time
//! that no container is given (`SIMGPU_SWITCH_COST`), as on a real GPU (an
//! H200 ran such a pair's kernels 97 to 98 % of the time).
//!
//! Without the monitor the 30 waits for tokens and gets its 30, and the 70,
//! which never waits, bears the whole loss. With a real `vgpu-monitor`
//! arbitrating beside them (reading the simulated GPU's NVML), the loss is
//! shared in proportion to the shares. Shares are the simulated driver's
//! own record of device time.

mod common;

use common::{wait_for, HostDir, MonitorProcess};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use vgpu_node_contract::region::Region;
use vgpu_testkit::compute::{process_share, wait_until, BusyMeter, Reading, Workload};
use vgpu_testkit::Sandbox;

/// Device time each switch between the two processes costs. The 30's
/// kernels come between the 70's, so the device switches hundreds of times
/// a second, and 35 us loses about 2 % of it (98.0 % together measured),
/// as the H200 did (97.8 to 98.1 %). The two cases bound the loss from
/// both sides: more than 1.5 points for the 70 to fall that short alone,
/// less than 2.9 for 70 % of it to keep the 70 within 2 points of 70.
const SWITCH_COST: &str = "35us";
/// The simulated GPU: kernels run in wall time and switching costs.
const GPU: [(&str, &str); 2] = [
    ("SIMGPU_TIMING", "wall"),
    ("SIMGPU_SWITCH_COST", SWITCH_COST),
];
/// The containers' shares, in percent.
const SHARES: [f64; 2] = [30.0, 70.0];
/// Each share is measured over this long.
const WINDOW: Duration = Duration::from_secs(4);

/// The two cases take the machine in turns: in wall timing a container
/// short of CPU falls short of its share, which would read as contention.
static MACHINE: Mutex<()> = Mutex::new(());

/// The 30 and the 70 running on one simulated GPU, each in its own
/// container directory under `host` (as the device plugin lays them out).
struct Pair {
    /// Holds the simulated GPU's state file and driver libraries.
    base: Sandbox,
    host: HostDir,
    regions: Vec<std::path::PathBuf>,
    meter: BusyMeter,
    workloads: Vec<(Sandbox, Workload)>,
}

impl Pair {
    fn start(name: &str) -> Self {
        let host = HostDir::new(name);
        let mut base = Sandbox::new(name, 1, "16Gi");
        for (key, value) in GPU {
            base.set(key, value);
        }
        let meter = BusyMeter::new(&base);
        let mut regions = Vec::new();
        let workloads = SHARES
            .iter()
            .enumerate()
            .map(|(index, share)| {
                let region = host.region_path(&format!("uid-{index}_main{index}"));
                let mut sandbox = Sandbox::new("tenant", 1, "16Gi");
                for (key, value) in GPU {
                    sandbox.set(key, value);
                }
                sandbox
                    .set("SIMGPU_STATE", &base.sim_state.display().to_string())
                    .set("LD_LIBRARY_PATH", &base.lib_dir.display().to_string())
                    .set(
                        "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                        &region.display().to_string(),
                    )
                    .set("CUDA_DEVICE_SM_LIMIT", &share.to_string());
                regions.push(region);
                // Runs well past every window; dropped (killed) at the end.
                let workload = Workload::start(&sandbox, "burst", "k1ms", 60.0, 1);
                (sandbox, workload)
            })
            .collect();
        Self {
            base,
            host,
            regions,
            meter,
            workloads,
        }
    }

    fn read(&mut self) -> Vec<Reading> {
        let pids: Vec<u32> = self.workloads.iter().map(|(_, w)| w.pid()).collect();
        pids.iter().map(|pid| self.meter.read(0, *pid)).collect()
    }

    /// Each container's share of the device over `WINDOW` from now.
    fn measure(&mut self) -> Vec<f64> {
        let from = self.read();
        wait_until(from[0].at_ns + WINDOW.as_nanos() as u64);
        let to = self.read();
        from.iter()
            .zip(&to)
            .map(|(from, to)| process_share(*from, *to))
            .collect()
    }

    /// The effective share (basis points) in container `index`'s region.
    fn effective(&self, index: usize) -> u32 {
        let region = Region::open_existing(&self.regions[index]).expect("region");
        region.layout().limits.devices[0]
            .sm_effective
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

#[test]
fn without_the_monitor_the_container_that_never_waits_bears_the_switching_loss() {
    let _machine = MACHINE.lock().unwrap_or_else(PoisonError::into_inner);
    let mut pair = Pair::start("contention-alone");
    let start = pair.read();
    wait_until(start[0].at_ns + 1_000_000_000);
    let shares = pair.measure();
    let total: f64 = shares.iter().sum();
    eprintln!(
        "contention without the monitor: {:.1} % and {:.1} % (shares 30 and 70), {total:.1} % together",
        shares[0], shares[1]
    );
    // The loss is real in the simulation: the device runs kernels less than
    // all the time, and the 70 falls short by about what is lost.
    assert!(total < 98.5, "switching lost {:.1} points", 100.0 - total);
    assert!(
        SHARES[1] - shares[1] > 1.5,
        "the 70 is short by more than 1.5 points: {:.1} %",
        shares[1]
    );
    assert!(
        (shares[0] - SHARES[0]).abs() <= 1.5,
        "the 30 waits for tokens and gets its share: {:.1} %",
        shares[0]
    );
}

#[test]
fn with_the_monitor_both_containers_share_the_switching_loss_in_proportion() {
    let _machine = MACHINE.lock().unwrap_or_else(PoisonError::into_inner);
    let mut pair = Pair::start("contention-arbitrated");
    let monitor = MonitorProcess::on_simulated_gpu(&pair.base, &pair.host, &["--no-kubernetes"]);
    // The monitor sees the 70 short of its share while the 30 waits, on a
    // saturated GPU, and scales the 30's share down.
    let scaled = wait_for(Duration::from_secs(20), || {
        let effective = pair.effective(0);
        (effective < 3_000).then_some(effective)
    });
    let Some(scaled) = scaled else {
        panic!(
            "the monitor never scaled the 30 (effective {} bp):\n{}",
            pair.effective(0),
            monitor.log()
        );
    };
    // One second for the 30's token bucket to run at its new share.
    let settle = pair.read();
    wait_until(settle[0].at_ns + 1_000_000_000);
    let shares = pair.measure();
    let total: f64 = shares.iter().sum();
    let effective = [pair.effective(0), pair.effective(1)];
    // What the rule took for the GPU's busy time: the simulated NVML's
    // utilization, which counts kernels, not switches.
    let busy = common::value(
        &monitor.scrape(),
        "vgpu_gpu_utilization_ratio",
        &[("device_index", "0")],
    );
    eprintln!(
        "contention with the monitor: {:.1} % and {:.1} % (shares 30 and 70), {total:.1} % together; effective shares {effective:?} bp (first scaled to {scaled}); NVML busy {busy:?}",
        shares[0], shares[1]
    );
    assert!(
        busy.is_some_and(|busy| (0.9..1.0).contains(&busy)),
        "the monitor reads the GPU saturated, short of whole, from NVML: {busy:?}"
    );
    for (share, achieved) in SHARES.iter().zip(&shares) {
        let fair = share * total / 100.0;
        assert!(
            (achieved - fair).abs() <= 1.5,
            "the container at {share} gets {achieved:.1} %, its part of the {total:.1} % achieved is {fair:.1} %"
        );
    }
    // No figure of its own for the 70: what it reaches is its part of what
    // the device achieved (above), and how much that is depends on the
    // machine (beside two CPU hogs the device ran 97.2 %, and the 70 its
    // part of it, 67.9 %).
    assert_eq!(
        effective[1], 7_000,
        "the container that never waits keeps its share"
    );
    drop(monitor);
}
