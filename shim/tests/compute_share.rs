//! Compute shares on the simulated GPU, measured by the simulated driver's
//! own record of device time. This is the representative subset; the full
//! sweep (every limit, pattern and kernel size over 10 s) is
//! `vgpu-accuracy`.

use std::sync::atomic::Ordering;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;
use vgpu_node_contract::region::Region;
use vgpu_testkit::compute::*;
use vgpu_testkit::Sandbox;

/// The tests that hold shares to within a point, in wall timing or with
/// kernels that vary, take the machine to themselves (`alone`): in wall
/// timing every launch spends 4 us of host time and every process runs a
/// device thread, and on 2 CPUs shared with a dozen other workloads a
/// container falls behind its share for want of CPU, not of tokens. The
/// others run side by side, as before (`among_others`).
static MACHINE: RwLock<()> = RwLock::new(());

fn alone() -> RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(PoisonError::into_inner)
}

fn among_others() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// Allowed error, in percentage points of the device.
const TOLERANCE: f64 = 2.0;
/// Allowed error where the simulated GPU runs kernels in wall-clock time,
/// and kernels whose time varies.
const TIGHT_TOLERANCE: f64 = 1.0;

/// A share under a cap of `limit` %, judged against what the same program
/// reached uncapped beside it (`vgpu_testkit::compute::assert_share`).
fn assert_near(what: &str, achieved: f64, limit: f64, uncapped: f64) {
    assert_share(what, achieved, limit, uncapped, TOLERANCE);
}

/// The simulated GPU in wall timing (kernels run by a device thread in
/// wall-clock time, launches cost 4 us of host time), with kernels that vary
/// by 5 % either way from run to run as a GPU's do.
const WALL_TIMING: [(&str, &str); 2] = [("SIMGPU_TIMING", "wall"), ("SIMGPU_KERNEL_JITTER", "5%")];

/// Wall timing with the workload's 1 ms kernel running 200 us.
const WALL_TIMING_200US: [(&str, &str); 3] = [
    WALL_TIMING[0],
    WALL_TIMING[1],
    ("SIMGPU_KERNELS", "k1ms=200us"),
];

#[test]
fn one_container_holds_its_share_in_every_pattern() {
    let _machine = among_others();
    // Runs in parallel: each case has its own simulated device, and the
    // workloads mostly sleep.
    let cases = [
        (5, "sync", "k1ms"),
        (10, "burst", "k30ms"),
        (25, "sync", "k20us"),
        (50, "streams", "k1ms"),
        (75, "graph", "k20us"),
        (90, "burst", "k20us"),
    ];
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = cases
            .iter()
            .map(|&(limit, pattern, kernel)| {
                scope.spawn(move || {
                    (
                        limit,
                        pattern,
                        kernel,
                        measure_single(limit, pattern, kernel, Duration::from_secs(4)),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("case"))
            .collect()
    });
    for (limit, pattern, kernel, result) in results {
        let what = format!("limit {limit}, {pattern}, {kernel}");
        eprintln!(
            "{what}: {:.2} % (uncapped beside it {:.2} %)",
            result.steady, result.uncapped
        );
        assert_near(&what, result.steady, limit as f64, result.uncapped);
        // Reached within the first second: no start-up burst far over it.
        assert!(
            result.first_second <= limit as f64 + 10.0,
            "{what}: first second at {:.1} %",
            result.first_second
        );
    }
}

#[test]
fn without_the_shim_the_same_workload_takes_the_whole_device() {
    let _machine = among_others();
    let mut sandbox = Sandbox::new("uncapped", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_SM_LIMIT", "25");
    let mut meter = BusyMeter::new(&sandbox);
    let mut reference = Reference::start(&[], "burst", "k1ms", 2.5, 1);
    let mut child = sandbox
        .command_without_shim(&vgpu_testkit::programs_dir().join("workload"))
        .args(["burst", "k1ms", "2.5", "1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")),
        &mut line,
    )
    .expect("ready");
    let start = meter.read(0, child.id());
    let reference_start = reference.read(0);
    wait_until(start.at_ns + 2_000_000_000);
    let end = meter.read(0, child.id());
    let reference_end = reference.read(0);
    assert!(child.wait().expect("exit").success());
    reference.finish();
    assert_not_held(
        "without the shim",
        process_share(start, end),
        25.0,
        process_share(reference_start, reference_end),
    );
}

/// What containers sharing one device got, and what the same program
/// reached uncapped beside them (on a device of its own) over the same
/// window.
struct Tenants {
    shares: Vec<f64>,
    uncapped: f64,
}

/// Judges a program that its configured `limit` % must not hold: it reaches
/// about what the same program under the shim with no cap reached beside it
/// (within `SIDE_BY_SIDE_SPREAD` of it: two uncapped programs on a busy
/// machine differ by a few points over two seconds), and, where the machine
/// lets it, clearly more than the limit.
fn assert_not_held(what: &str, share: f64, limit: f64, uncapped: f64) {
    eprintln!("{what}: {share:.2} % (uncapped beside it {uncapped:.2} %)");
    assert!(
        share >= (1.0 - SIDE_BY_SIDE_SPREAD) * uncapped,
        "{what}: {share:.2} %, while uncapped beside it reached {uncapped:.2} %"
    );
    if uncapped > limit + 4.0 * TOLERANCE {
        assert!(
            share > limit + 2.0 * TOLERANCE,
            "{what}: held at {share:.2} % by a {limit} % it should not apply"
        );
    }
}

/// Runs several containers on one device at once, each at its own limit and
/// all saturating it, and returns each one's steady share.
fn run_tenants(limits: &[u32], window: Duration) -> Tenants {
    run_tenants_in(&[], limits, window)
}

/// Like `run_tenants`, with `env` set for the simulated GPU.
fn run_tenants_in(env: &[(&str, &str)], limits: &[u32], window: Duration) -> Tenants {
    let mut base = Sandbox::new("tenants", 1, "16Gi");
    for (key, value) in env {
        base.set(key, value);
    }
    let mut meter = BusyMeter::new(&base);
    let seconds = 1.0 + window.as_secs_f64() + 0.5;
    let mut reference = Reference::start(env, "burst", "k1ms", seconds, 1);
    let workloads: Vec<(Sandbox, Workload)> = limits
        .iter()
        .enumerate()
        .map(|(index, limit)| {
            // Same simulated device, separate containers (regions).
            let mut sandbox = Sandbox::new("tenant", 1, "16Gi");
            for (key, value) in env {
                sandbox.set(key, value);
            }
            sandbox
                .set("SIMGPU_STATE", &base.sim_state.display().to_string())
                .set("LD_LIBRARY_PATH", &base.lib_dir.display().to_string())
                .set(
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
                    &base
                        .dir
                        .join(format!("region-{index}"))
                        .display()
                        .to_string(),
                )
                .set("CUDA_DEVICE_SM_LIMIT", &limit.to_string());
            let workload = Workload::start(&sandbox, "burst", "k1ms", seconds, 1);
            (sandbox, workload)
        })
        .collect();
    let start = meter.read(0, 0);
    wait_until(start.at_ns + 1_000_000_000);
    let settled: Vec<Reading> = workloads
        .iter()
        .map(|(_, w)| meter.read(0, w.pid()))
        .collect();
    let reference_settled = reference.read(0);
    wait_until(settled[0].at_ns + window.as_nanos() as u64);
    let end: Vec<Reading> = workloads
        .iter()
        .map(|(_, w)| meter.read(0, w.pid()))
        .collect();
    let reference_end = reference.read(0);
    let shares = settled
        .iter()
        .zip(&end)
        .map(|(from, to)| process_share(*from, *to))
        .collect();
    for (_, workload) in workloads {
        workload.finish();
    }
    reference.finish();
    Tenants {
        shares,
        uncapped: process_share(reference_settled, reference_end),
    }
}

/// Judges each tenant's share against its limit.
fn assert_tenants(tenants: &Tenants, limits: &[u32], tolerance: f64) {
    for (index, (share, limit)) in tenants.shares.iter().zip(limits).enumerate() {
        let what = format!("container {index} at {limit}");
        eprintln!(
            "{what}: {share:.2} % (uncapped beside it {:.2} %)",
            tenants.uncapped
        );
        assert_share(
            &what,
            *share,
            f64::from(*limit),
            tenants.uncapped,
            tolerance,
        );
    }
}

#[test]
fn two_containers_at_30_and_70_each_get_their_share() {
    let _machine = among_others();
    let tenants = run_tenants(&[30, 70], Duration::from_secs(4));
    assert_tenants(&tenants, &[30, 70], TOLERANCE);
}

#[test]
fn four_containers_at_25_each_get_a_quarter() {
    let _machine = among_others();
    let tenants = run_tenants(&[25, 25, 25, 25], Duration::from_secs(4));
    assert_tenants(&tenants, &[25, 25, 25, 25], TOLERANCE);
}

/// The over-share the issue reported: a container at 50 % running 200 us
/// kernels, synchronised after each, on a GPU whose kernels take real wall
/// time and vary from run to run. Charged the smallest of its recent
/// timings, it got 52.8 % of the device.
#[test]
fn in_wall_timing_half_the_device_for_200us_kernels_synchronised_holds_within_a_point() {
    let _machine = alone();
    let result = measure_single_in(
        &WALL_TIMING_200US,
        50,
        "sync",
        "k1ms",
        Duration::from_secs(4),
    );
    assert_share(
        "50 %, sync, 200 us kernels, wall timing",
        result.steady,
        50.0,
        result.uncapped,
        TIGHT_TOLERANCE,
    );
}

/// Limit, pattern, kernel, and the simulated GPU's environment.
type Case<'a> = (u32, &'a str, &'a str, &'a [(&'a str, &'a str)]);

/// Kernels that vary from run to run (5 % either way) are charged what they
/// used on average, in every pattern and on the timeline too: charging their
/// fastest runs gave 52.4 % at 50 %.
/// A launch call whose thread is held up after its kernel reached the
/// device (preempted on a busy host) returns after the kernel ended. Early
/// in a process, before the fastest launch call is known, taking such a
/// call's time off its timing priced a 1 ms kernel at about a microsecond,
/// and the container ran uncapped for the rest of its window (seen as
/// 93.8 % under a 75 % cap on a loaded two-core machine).
#[test]
fn launch_calls_held_up_after_their_kernel_left_do_not_make_it_look_free() {
    let _machine = alone();
    let env = [
        WALL_TIMING[0],
        WALL_TIMING[1],
        ("SIMGPU_LATE_RETURNS", "3ms@2-12"),
    ];
    let result = measure_single_in(&env, 50, "sync", "k1ms", Duration::from_secs(3));
    eprintln!(
        "late returns: {:.2} % (uncapped beside it {:.2} %)",
        result.steady, result.uncapped
    );
    assert_share(
        "limit 50, sync, k1ms, launch calls 2 to 12 returning 3 ms late",
        result.steady,
        50.0,
        result.uncapped,
        TIGHT_TOLERANCE,
    );
}

/// Launches that return only once their work has finished, as every launch
/// does under `CUDA_LAUNCH_BLOCKING=1` (the simulated GPU honours it as the
/// driver does). Their calls hold their kernels' whole run, and the fastest
/// "call" taken off every timing was a whole kernel: a loop of 1 ms kernels
/// got 99 % of the device at a 30 % share. (A blocking launch is charged
/// its call's host time as well as its kernel, over and never under: what
/// that costs a container of 20 us kernels is in `vgpu-accuracy
/// --launch-blocking`'s grid.)
#[test]
fn launches_that_finish_inside_their_call_are_charged_their_kernels() {
    let _machine = among_others();
    const BLOCKING: [(&str, &str); 1] = [("CUDA_LAUNCH_BLOCKING", "1")];
    let cases: [Case; 4] = [
        (30, "burst", "k1ms", &BLOCKING),
        (30, "sync", "k1ms", &BLOCKING),
        (30, "graph", "k1ms", &BLOCKING),
        (60, "streams", "k30ms", &BLOCKING),
    ];
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = cases
            .iter()
            .map(|(limit, pattern, kernel, env)| {
                scope.spawn(move || {
                    measure_single_in(env, *limit, pattern, kernel, Duration::from_secs(3))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("case thread"))
            .collect()
    });
    for ((limit, pattern, kernel, _), result) in cases.iter().zip(results) {
        let what = format!("limit {limit}, {pattern}, {kernel}, CUDA_LAUNCH_BLOCKING=1");
        eprintln!(
            "{what}: {:.2} % (uncapped beside it {:.2} %)",
            result.steady, result.uncapped
        );
        assert_near(&what, result.steady, f64::from(*limit), result.uncapped);
    }
}

#[test]
fn kernels_whose_time_varies_are_charged_their_mean_in_every_pattern() {
    let _machine = alone();
    let cases: [Case; 6] = [
        (50, "sync", "k1ms", &[("SIMGPU_KERNEL_JITTER", "5%")]),
        (25, "burst", "k1ms", &[("SIMGPU_KERNEL_JITTER", "5%")]),
        (75, "streams", "k1ms", &WALL_TIMING_200US),
        (50, "graph", "k20us", &WALL_TIMING),
        (25, "burst", "k1ms", &WALL_TIMING),
        (75, "sync", "k1ms", &WALL_TIMING),
    ];
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = cases
            .iter()
            .map(|&(limit, pattern, kernel, env)| {
                scope.spawn(move || {
                    measure_single_in(env, limit, pattern, kernel, Duration::from_secs(4))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("case"))
            .collect()
    });
    for ((limit, pattern, kernel, env), result) in cases.iter().zip(results) {
        let what = format!("limit {limit}, {pattern}, {kernel}, {env:?}");
        eprintln!(
            "{what}: {:.2} % (uncapped beside it {:.2} %)",
            result.steady, result.uncapped
        );
        assert_share(
            &what,
            result.steady,
            f64::from(*limit),
            result.uncapped,
            TIGHT_TOLERANCE,
        );
    }
}

#[test]
fn in_wall_timing_two_containers_at_30_and_70_each_get_their_share_within_a_point() {
    let _machine = alone();
    let tenants = run_tenants_in(&WALL_TIMING, &[30, 70], Duration::from_secs(4));
    assert_tenants(&tenants, &[30, 70], TIGHT_TOLERANCE);
}

#[test]
fn in_wall_timing_four_containers_at_25_each_get_a_quarter_within_a_point() {
    let _machine = alone();
    let tenants = run_tenants_in(&WALL_TIMING, &[25, 25, 25, 25], Duration::from_secs(4));
    assert_tenants(&tenants, &[25, 25, 25, 25], TIGHT_TOLERANCE);
}

#[test]
fn each_device_of_a_two_device_container_is_held_independently() {
    let _machine = among_others();
    let mut sandbox = Sandbox::new("twodev", 2, "16Gi");
    sandbox
        .set("CUDA_DEVICE_SM_LIMIT_0", "30")
        .set("CUDA_DEVICE_SM_LIMIT_1", "60");
    let mut meter = BusyMeter::new(&sandbox);
    let mut reference = Reference::start(&[], "burst", "k1ms", 5.5, 2);
    let workload = Workload::start(&sandbox, "burst", "k1ms", 5.5, 2);
    let pid = workload.pid();
    let start = [meter.read(0, pid), meter.read(1, pid)];
    wait_until(start[0].at_ns + 1_000_000_000);
    let settled = [meter.read(0, pid), meter.read(1, pid)];
    let reference_settled = [reference.read(0), reference.read(1)];
    wait_until(settled[0].at_ns + 4_000_000_000);
    let end = [meter.read(0, pid), meter.read(1, pid)];
    let reference_end = [reference.read(0), reference.read(1)];
    workload.finish();
    reference.finish();
    for (device, limit) in [(0, 30.0), (1, 60.0)] {
        assert_near(
            &format!("device {device}"),
            process_share(settled[device], end[device]),
            limit,
            process_share(reference_settled[device], reference_end[device]),
        );
    }
}

#[test]
fn a_new_effective_share_takes_hold_within_a_second() {
    let _machine = among_others();
    let mut sandbox = Sandbox::new("retarget", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_SM_LIMIT", "50");
    let mut meter = BusyMeter::new(&sandbox);
    let mut reference = Reference::start(&[], "burst", "k1ms", 6.0, 1);
    let workload = Workload::start(&sandbox, "burst", "k1ms", 6.0, 1);
    let pid = workload.pid();
    let start = meter.read(0, pid);
    wait_until(start.at_ns + 1_000_000_000);
    let before = meter.read(0, pid);
    let reference_before = reference.read(0);
    wait_until(before.at_ns + 2_000_000_000);
    let changed = meter.read(0, pid);
    let reference_changed = reference.read(0);
    // What the node monitor does: write a new effective share (basis points).
    let region = Region::open_existing(&sandbox.region).expect("region");
    region.layout().limits.devices[0]
        .sm_effective
        .store(2_000, Ordering::Release);
    wait_until(changed.at_ns + 1_000_000_000);
    let one_second_later = meter.read(0, pid);
    let reference_one_second_later = reference.read(0);
    wait_until(one_second_later.at_ns + 1_500_000_000);
    let end = meter.read(0, pid);
    let reference_end = reference.read(0);
    workload.finish();
    reference.finish();
    assert_near(
        "before the change",
        process_share(before, changed),
        50.0,
        process_share(reference_before, reference_changed),
    );
    assert_near(
        "from one second after the change",
        process_share(one_second_later, end),
        20.0,
        process_share(reference_one_second_later, reference_end),
    );
    let transition = process_share(changed, one_second_later);
    let reachable = process_share(reference_changed, reference_one_second_later);
    assert!(
        (20.0f64.min(reachable) - TOLERANCE..50.0 - TOLERANCE).contains(&transition),
        "the second after the change moves toward 20 %: {transition:.1} \
         (uncapped beside it {reachable:.1} %)"
    );
}

#[test]
fn policies_force_and_disable() {
    let _machine = among_others();
    // force: the configured share holds even if an effective share says more.
    let mut forced = Sandbox::new("force", 1, "16Gi");
    forced
        .set("CUDA_DEVICE_SM_LIMIT", "30")
        .set("GPU_CORE_UTILIZATION_POLICY", "force");
    let mut meter = BusyMeter::new(&forced);
    let mut reference = Reference::start(&[], "burst", "k1ms", 3.5, 1);
    let workload = Workload::start(&forced, "burst", "k1ms", 3.5, 1);
    let region = Region::open_existing(&forced.region).expect("region");
    region.layout().limits.devices[0]
        .sm_effective
        .store(9_000, Ordering::Release);
    let start = meter.read(0, workload.pid());
    wait_until(start.at_ns + 1_000_000_000);
    let settled = meter.read(0, workload.pid());
    let reference_settled = reference.read(0);
    wait_until(settled.at_ns + 2_000_000_000);
    let end = meter.read(0, workload.pid());
    let reference_end = reference.read(0);
    workload.finish();
    reference.finish();
    assert_near(
        "force",
        process_share(settled, end),
        30.0,
        process_share(reference_settled, reference_end),
    );

    // disable: no compute cap at all.
    let mut disabled = Sandbox::new("disable", 1, "16Gi");
    disabled
        .set("CUDA_DEVICE_SM_LIMIT", "30")
        .set("GPU_CORE_UTILIZATION_POLICY", "disable");
    let mut meter = BusyMeter::new(&disabled);
    let mut reference = Reference::start(&[], "burst", "k1ms", 2.5, 1);
    let workload = Workload::start(&disabled, "burst", "k1ms", 2.5, 1);
    let start = meter.read(0, workload.pid());
    let reference_start = reference.read(0);
    wait_until(start.at_ns + 2_000_000_000);
    let end = meter.read(0, workload.pid());
    let reference_end = reference.read(0);
    workload.finish();
    reference.finish();
    assert_not_held(
        "disable",
        process_share(start, end),
        30.0,
        process_share(reference_start, reference_end),
    );
}

#[test]
fn region_counters_account_for_launches_and_throttling() {
    let _machine = among_others();
    let mut sandbox = Sandbox::new("counters", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_SM_LIMIT", "40");
    let mut meter = BusyMeter::new(&sandbox);
    let workload = Workload::start(&sandbox, "burst", "k1ms", 4.0, 1);
    let pid = workload.pid();
    let region = Region::open_existing(&sandbox.region).expect("region");
    let bucket = &region.layout().devices[0].compute;
    let start = meter.read(0, pid);
    let granted_before = bucket.granted_ns();
    wait_until(start.at_ns + 3_000_000_000);
    let end = meter.read(0, pid);
    let granted_after = bucket.granted_ns();
    workload.finish();
    let granted = (granted_after - granted_before) as f64;
    let busy = (end.process_ns - start.process_ns) as f64;
    assert!(bucket.launches.load(Ordering::Relaxed) > 1000);
    assert!(
        bucket.throttled_ns.load(Ordering::Relaxed) > 1_000_000_000,
        "waited for most of the run"
    );
    // What was granted is what the device ran, within a few kernels queued
    // at either end of the window.
    assert!(
        (granted - busy).abs() / busy < 0.03,
        "granted {granted} ns vs device time used {busy} ns"
    );
}
