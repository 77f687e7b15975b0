//! Integration tests of the simulated GPU (`libsimgpu.so`).
//!
//! The library reads its configuration once per process, so each test runs
//! one or more child processes (this same executable, re-run with
//! `SIMGPU_TEST_SCENARIO` naming what to do; see `scenarios.rs`), each with
//! its own environment and a private state file.

mod common;
mod graphs;
mod scenarios;
mod wall;

use std::time::{Duration, Instant};

use common::{TestEnv, SCENARIO_VAR};

const MI: u64 = 1 << 20;

/// Entry point of child processes; does nothing in a normal test run.
#[test]
fn child_entry() {
    if let Ok(name) = std::env::var(SCENARIO_VAR) {
        scenarios::run(&name);
    }
}

#[test]
fn devices_memory_and_sm_count_come_from_env() {
    TestEnv::new("devices")
        .var("SIMGPU_DEVICES", 3)
        .var("SIMGPU_MEMORY", "8Gi")
        .var("SIMGPU_MEMORY_1", "4096m")
        .var("SIMGPU_SM_COUNT", 66)
        .var("SIMGPU_NAME", "Test GPU")
        .var("SIMGPU_DRIVER_VERSION", 12040)
        .run("devices", &[]);
}

#[test]
fn a_bad_value_is_one_stderr_line_and_init_fails() {
    let out = TestEnv::new("badenv")
        .var("SIMGPU_MEMORY", "12X")
        .run("bad_env", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("simgpu:")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("SIMGPU_MEMORY"), "{}", lines[0]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("simgpu"), "nothing on stdout: {stdout}");
}

#[test]
fn allocations_beyond_total_fail_and_contexts_free_their_memory() {
    TestEnv::new("memory")
        .var("SIMGPU_MEMORY", "1Gi")
        .var("SIMGPU_CONTEXT_BYTES", "16Mi")
        .run("memory_accounting", &[]);
}

#[test]
fn copies_round_trip_bytes_and_are_bounds_checked() {
    TestEnv::new("memcpy").run("memcpy", &[]);
}

#[test]
fn get_proc_address_follows_versions_and_flags() {
    let out = TestEnv::new("procaddr").run("proc_address", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("@EXPORTS")
            || String::from_utf8_lossy(&out.stderr).contains("nm not available")
    );
}

#[test]
fn contexts_stack_and_primary_contexts() {
    TestEnv::new("contexts")
        .var("SIMGPU_CONTEXT_BYTES", "8Mi")
        .run("contexts", &[]);
}

#[test]
fn two_processes_share_used_memory() {
    let env = TestEnv::new("shared").var("SIMGPU_MEMORY", "4Gi");
    let mut holder = env.spawn("hold", &[("HOLD_BYTES", (1024 * MI).to_string())]);
    let pid = holder.expect("READY");
    env.run(
        "check_shared",
        &[
            ("EXPECT_USED", (1024 * MI).to_string()),
            ("HOLDER_PID", pid.clone()),
        ],
    );
    holder.send("done");
    holder.finish();
    env.run(
        "nvml_expect",
        &[
            ("EXPECT_USED", "0".into()),
            ("EXPECT_PID", pid),
            ("EXPECT_PRESENT", "0".into()),
        ],
    );
}

#[test]
fn memory_of_a_sigkilled_process_is_reclaimed() {
    let env = TestEnv::new("sigkill").var("SIMGPU_MEMORY", "4Gi");
    let mut holder = env.spawn("hold", &[("HOLD_BYTES", (2048 * MI).to_string())]);
    let pid = holder.expect("READY");
    env.run(
        "nvml_expect",
        &[
            ("EXPECT_USED", (2048 * MI).to_string()),
            ("EXPECT_PID", pid.clone()),
            ("EXPECT_PRESENT", "1".into()),
        ],
    );
    holder.kill();
    env.run(
        "nvml_expect",
        &[
            ("EXPECT_USED", "0".into()),
            ("EXPECT_PID", pid),
            ("EXPECT_PRESENT", "0".into()),
        ],
    );
}

#[test]
fn kernels_from_two_processes_run_one_after_another() {
    let env = TestEnv::new("timeline");
    let mut a = env.spawn("kernel_race", &[]);
    let mut b = env.spawn("kernel_race", &[]);
    a.expect("READY");
    b.expect("READY");
    a.send("go");
    b.send("go");
    let parse = |s: String| -> Vec<u64> {
        s.split_whitespace()
            .map(|x| x.parse().expect("time"))
            .collect()
    };
    let ta = parse(a.expect("TIMES"));
    let tb = parse(b.expect("TIMES"));
    a.finish();
    b.finish();
    for t in [&ta, &tb] {
        assert!(t[2] - t[0] >= 20_000_000, "each kernel takes 20 ms: {t:?}");
    }
    let first_start = ta[0].min(tb[0]);
    let last_end = ta[2].max(tb[2]);
    assert!(
        last_end - first_start >= 40_000_000,
        "two 20 ms kernels on one device take at least 40 ms: {ta:?} {tb:?}"
    );
}

#[test]
fn events_streams_queue_depth_and_utilization() {
    TestEnv::new("timing").run("timing", &[]);
}

#[test]
fn nvml_memory_and_process_list() {
    TestEnv::new("nvml")
        .var("SIMGPU_MEMORY", "2Gi")
        .var("SIMGPU_CONTEXT_BYTES", "10Mi")
        .run("nvml_processes", &[]);
}

#[test]
fn nvml_xid_events_are_injected_and_reported_once() {
    TestEnv::new("events")
        .var("SIMGPU_DEVICES", 2)
        .run("nvml_events", &[]);
}

#[test]
fn nvml_reports_the_configured_numa_nodes_and_nvlinks() {
    let machine = |tag: &str| {
        TestEnv::new(tag)
            .var("SIMGPU_DEVICES", 4)
            .var("SIMGPU_NUMA", "0,0,1,1")
            .var("SIMGPU_NVLINK", "0,2;1,3")
    };
    machine("topology").run("nvml_topology", &[("TOPOLOGY_CASE", "islands".into())]);
    machine("topology-one")
        .var("SIMGPU_VISIBLE_DEVICES", 2)
        .run("nvml_topology", &[("TOPOLOGY_CASE", "one_visible".into())]);
    TestEnv::new("topology-flat")
        .var("SIMGPU_DEVICES", 2)
        .run("nvml_topology", &[("TOPOLOGY_CASE", "flat".into())]);
}

#[test]
fn pools_reserve_chunks_and_release_at_sync_and_trim() {
    TestEnv::new("pool")
        .var("SIMGPU_MEMORY", "1Gi")
        .run("pool", &[]);
}

#[test]
fn virtual_memory_maps_real_bytes() {
    TestEnv::new("vmm").run("vmm", &[]);
}

#[test]
fn a_forked_child_has_its_own_accounting() {
    TestEnv::new("fork").run("fork", &[]);
}

#[test]
fn a_stale_state_file_is_replaced_but_a_used_one_is_not() {
    let env = TestEnv::new("stale");
    env.run("init_expect", &[("EXPECT_INIT", "0".into())]);
    // Same file, another device count, nobody using it: replaced.
    let mut holder = env.spawn(
        "init_expect",
        &[
            ("EXPECT_INIT", "0".into()),
            ("HOLD", "1".into()),
            ("SIMGPU_DEVICES", "2".into()),
        ],
    );
    holder.expect("READY");
    // In use with two devices: a one-device configuration is refused.
    let out = env
        .command("init_expect", &[("EXPECT_INIT", "1".into())])
        .output()
        .expect("spawn");
    common::assert_passed("init_expect", &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("another configuration"), "{stderr}");
    holder.send("done");
    holder.finish();
}

#[test]
fn a_process_killed_while_launching_never_blocks_the_device() {
    let env = TestEnv::new("robust");
    let mut looper = env.spawn("launch_loop", &[]);
    looper.expect("READY");
    std::thread::sleep(Duration::from_millis(100));
    looper.kill();
    let mut child = env
        .command("kernel_once", &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(status.success(), "kernel_once failed: {status:?}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a launch hung after another process was killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn captured_kernels_do_not_run_and_a_replayed_graph_takes_their_time() {
    TestEnv::new("capture").run("graph_capture", &[]);
}

#[test]
fn explicit_graph_nodes_round_trip() {
    TestEnv::new("graph").run("graph_explicit", &[]);
}

#[test]
fn cooperative_multi_device_launch_runs_on_each_stream() {
    TestEnv::new("multidev")
        .var("SIMGPU_DEVICES", 2)
        .run("multi_device", &[]);
}

#[test]
fn busy_time_stays_exact_beyond_the_ring() {
    TestEnv::new("busylong").run("busy_long", &[]);
}

#[test]
fn busy_time_hooks_count_elapsed_kernel_time_per_process() {
    let env = TestEnv::new("busy");
    let mut probe = env.spawn("busy_probe", &[]);
    probe.expect("READY");
    let mut a = env.spawn("busy_kernel", &[("KERNEL_MS", "50".into())]);
    let mut b = env.spawn("busy_kernel", &[("KERNEL_MS", "30".into())]);
    let a_pid = a.expect("READY");
    let b_pid = b.expect("READY");
    a.send("go");
    let a_times = a.expect("LAUNCHED");
    b.send("go");
    b.expect("LAUNCHED");
    probe.send(&format!("{a_pid} {b_pid} {a_times}"));
    probe.expect("SAMPLED");
    for p in [&mut a, &mut b] {
        p.send("sync");
        p.expect("DONE");
    }
    probe.send("after");
    probe.expect("CHECKED");
    probe.finish();
    a.send("exit");
    b.send("exit");
    a.finish();
    b.finish();
}

/// Wall timing (`SIMGPU_TIMING=wall`): the same scenarios as above where
/// they hold there too, and what only wall timing does.
fn wall(tag: &str) -> TestEnv {
    TestEnv::new(tag).var("SIMGPU_TIMING", "wall")
}

#[test]
fn wall_timing_launch_overhead_synchronisation_events_and_device_time() {
    wall("wall")
        .var("SIMGPU_LAUNCH_OVERHEAD", "50us")
        .var("SIMGPU_KERNELS", "k=2ms")
        .run("wall_timing", &[]);
}

#[test]
fn wall_timing_kernels_vary_by_the_jitter_and_average_their_duration() {
    wall("jitter")
        .var("SIMGPU_KERNEL_JITTER", "10%")
        .run("wall_jitter", &[]);
}

#[test]
fn wall_timing_a_wait_on_another_devices_event_holds_the_stream() {
    wall("crossdev")
        .var("SIMGPU_DEVICES", 2)
        .run("wall_cross_device", &[]);
}

#[test]
fn wall_timing_events_streams_queue_depth_and_utilization() {
    wall("walltiming").run("timing", &[]);
}

#[test]
fn wall_timing_two_processes_take_turns_and_never_overlap() {
    let env = wall("turns");
    let mut a = env.spawn(
        "wall_saturate",
        &[("KERNEL_MS", "10".into()), ("SECONDS", "1".into())],
    );
    let mut b = env.spawn(
        "wall_saturate",
        &[("KERNEL_MS", "10".into()), ("SECONDS", "1".into())],
    );
    a.expect("READY");
    b.expect("READY");
    a.send("go");
    b.send("go");
    let busy: Vec<u64> = [&mut a, &mut b]
        .into_iter()
        .map(|p| p.expect("BUSY").parse().expect("busy ns"))
        .collect();
    for p in [&mut a, &mut b] {
        p.send("exit");
    }
    a.finish();
    b.finish();
    // Each ran about 1 s of work on one device: together at most the
    // wall time they shared (plus a kernel each in flight at the start
    // and end), and each got a fair part of it.
    let total = busy[0] + busy[1];
    assert!(total <= 1_150_000_000, "{busy:?}");
    for ns in &busy {
        assert!(*ns >= 350_000_000, "turns are fair: {busy:?}");
    }
}

/// What one `wall_switch_step` run reported.
#[derive(Debug, PartialEq, Eq)]
struct Ran {
    switches: u64,
    switch_ns: u64,
    own_busy_ns: u64,
    device_busy_ns: u64,
}

/// Has `process` run `count` 1 ms kernels; answers what it reported and
/// how long the run took (ns).
fn run_kernels(process: &mut common::Running, count: u32) -> (Ran, u64) {
    process.send(&format!("run {count}"));
    let numbers: Vec<u64> = process
        .expect("RAN")
        .split_whitespace()
        .map(|n| n.parse().expect("a number"))
        .collect();
    let ran = Ran {
        switches: numbers[0],
        switch_ns: numbers[1],
        own_busy_ns: numbers[2],
        device_busy_ns: numbers[3],
    };
    (ran, numbers[4])
}

const SWITCH_COST_NS: u64 = 500_000;

/// `SIMGPU_SWITCH_COST`: each time the device passes from one process's
/// work to another's (a process that exited counts as another, even if a
/// new one reuses its slot) it spends the cost first, and that time is in
/// no process's kernel time nor the device's. A process that takes the
/// device again after nobody else had it does not switch.
#[test]
fn wall_timing_a_switch_between_processes_costs_device_time_given_to_no_process() {
    const MS: u64 = 1_000_000;
    let env = wall("switch").var("SIMGPU_SWITCH_COST", "500us");
    let mut a = env.spawn("wall_switch_step", &[]);
    let mut b = env.spawn("wall_switch_step", &[]);
    a.expect("READY");
    b.expect("READY");
    let ran = |switches, own_ms, device_ms| Ran {
        switches,
        switch_ns: switches * SWITCH_COST_NS,
        own_busy_ns: own_ms * MS,
        device_busy_ns: device_ms * MS,
    };

    // The first process on the device, and the same one again: no switch.
    assert_eq!(run_kernels(&mut a, 3).0, ran(0, 3, 3));
    assert_eq!(run_kernels(&mut a, 2).0, ran(0, 5, 5));
    // The device passes to b: one switch, whose time b waits for on top
    // of its kernel, and which neither b's nor the device's kernel time
    // holds.
    let (after_b, took) = run_kernels(&mut b, 1);
    assert_eq!(after_b, ran(1, 1, 6));
    assert!(took >= SWITCH_COST_NS + MS, "b's run took {took} ns");
    // And back to a: a second switch, not in a's time either.
    assert_eq!(run_kernels(&mut a, 1).0, ran(2, 6, 7));
    // a exits while the device holds its work; whoever comes next, even in
    // a's slot, switches.
    a.send("exit");
    a.finish();
    let mut c = env.spawn("wall_switch_step", &[]);
    c.expect("READY");
    assert_eq!(run_kernels(&mut c, 1).0, ran(3, 1, 8));
    assert_eq!(run_kernels(&mut b, 1).0, ran(4, 2, 9));
    for mut p in [b, c] {
        p.send("exit");
        p.finish();
    }
}

/// Two processes saturating the device switch back and forth at every
/// turn; every switch is charged exactly the cost, and kernel and switch
/// time together never exceed the wall time they ran in.
#[test]
fn wall_timing_switches_of_two_saturating_processes_are_each_charged_the_cost() {
    let env = wall("switchsaturate").var("SIMGPU_SWITCH_COST", "200us");
    let spawn = || {
        env.spawn(
            "wall_saturate",
            &[("KERNEL_MS", "1".into()), ("SECONDS", "1".into())],
        )
    };
    let (mut a, mut b) = (spawn(), spawn());
    a.expect("READY");
    b.expect("READY");
    let start = Instant::now();
    a.send("go");
    b.send("go");
    let busy: Vec<u64> = [&mut a, &mut b]
        .into_iter()
        .map(|p| p.expect("BUSY").parse().expect("busy ns"))
        .collect();
    let wall_ns = start.elapsed().as_nanos() as u64;
    a.send("switches");
    let counters: Vec<u64> = a
        .expect("SWITCHES")
        .split_whitespace()
        .map(|n| n.parse().expect("a number"))
        .collect();
    let (switches, switch_ns) = (counters[0], counters[1]);
    for p in [&mut a, &mut b] {
        p.send("exit");
    }
    a.finish();
    b.finish();
    // Turns of at most 2 ms while the other waits: hundreds of switches in
    // a second (a hundred even if the host is slow to queue work).
    assert!(switches >= 100, "{switches} switches, busy {busy:?}");
    assert_eq!(switch_ns, switches * 200_000);
    let device_ns = busy[0] + busy[1] + switch_ns;
    assert!(
        device_ns <= wall_ns,
        "kernels {busy:?} and switches {switch_ns} ns in {wall_ns} ns of wall time"
    );
}

#[test]
fn wall_timing_a_process_killed_holding_the_device_never_blocks_it() {
    let env = wall("wallrobust");
    let mut looper = env.spawn("launch_loop", &[]);
    looper.expect("READY");
    std::thread::sleep(Duration::from_millis(100));
    looper.kill();
    let out = env.command("kernel_once", &[]).output().expect("spawn");
    common::assert_passed("kernel_once", &out);
}

/// A process that exits normally while its kernel runs gives its slot back
/// still holding the device; the next process, given that same slot, must
/// not take the stale hold for its own and wait for ever.
#[test]
fn wall_timing_a_process_reusing_the_slot_of_one_that_exited_holding_the_device_runs() {
    let env = wall("wallreuse");
    env.run("wall_exit_running", &[]);
    let mut next = env
        .command("kernel_once", &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    // The kernel left behind ends within 200 ms; ten seconds leave room
    // for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = next.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = next.kill();
            let _ = next.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        status.is_some_and(|s| s.success()),
        "the next process never ran its kernel: {status:?}"
    );
}

#[test]
fn wall_timing_captured_kernels_and_replayed_graphs() {
    wall("wallcapture").run("graph_capture", &[]);
}

#[test]
fn wall_timing_cooperative_multi_device_launch() {
    wall("wallmultidev")
        .var("SIMGPU_DEVICES", 2)
        .run("multi_device", &[]);
}

#[test]
fn wall_timing_busy_time_stays_exact_beyond_the_ring() {
    wall("wallbusylong").run("busy_long", &[]);
}

#[test]
fn the_state_file_is_open_to_every_user_whatever_the_creators_umask() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // A container's non-root process shares the device with the node's
    // root-run agents: the file root creates under umask 077 must still
    // open for everyone, as a real GPU's device nodes do.
    let env = TestEnv::new("mode")
        .var("SIMGPU_MEMORY", "1Gi")
        .var("SIMGPU_CONTEXT_BYTES", "16Mi");
    let mut command = env.command("memory_accounting", &[]);
    // SAFETY: umask is async-signal-safe and touches only the child.
    unsafe {
        command.pre_exec(|| {
            libc::umask(0o077);
            Ok(())
        });
    }
    let out = command.output().expect("spawn scenario");
    common::assert_passed("memory_accounting", &out);
    let mode = std::fs::metadata(&env.state)
        .expect("the state file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o666, "mode {mode:o}");
}
