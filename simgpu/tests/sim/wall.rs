//! Scenarios for wall timing (`SIMGPU_TIMING=wall`): kernels run by a
//! device thread in wall-clock time (see `scenarios.rs` for how they run).

use std::ptr::null_mut;

use vgpu_cuda_abi::cuda::*;

use crate::common::*;
use crate::scenarios::{context, env_u64, function, launch, load, load_module};

const US: u64 = 1_000;
const MS: u64 = 1_000_000;

fn stream(cu: &Cu) -> CUstream {
    let mut s = null_mut();
    ok(cu.cuStreamCreate(&mut s, 0), "cuStreamCreate");
    s
}

fn event(cu: &Cu) -> CUevent {
    let mut e = null_mut();
    ok(cu.cuEventCreate(&mut e, 0), "cuEventCreate");
    e
}

fn elapsed_ns(cu: &Cu, from: CUevent, to: CUevent) -> u64 {
    let mut ms = 0f32;
    ok(
        cu.cuEventElapsedTime(&mut ms, from, to),
        "cuEventElapsedTime",
    );
    (f64::from(ms) * 1e6).round() as u64
}

/// Launch overhead, synchronisation, event timestamps and the device time
/// recorded, with `SIMGPU_LAUNCH_OVERHEAD=50us` and `SIMGPU_KERNELS`
/// replacing the module's 1 ms with 2 ms.
pub fn wall_timing() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1ms\nlong 30ms\n");
    let (k, long) = (function(&cu, m, "k"), function(&cu, m, "long"));
    let s = stream(&cu);
    let (e0, e1) = (event(&cu), event(&cu));
    let pid = std::process::id();

    // A launch costs its overhead in host time, and returns before the
    // kernel is done.
    let before = mono_ns();
    for _ in 0..20 {
        ok(launch(&cu, k, s), "launch");
    }
    let launched = mono_ns() - before;
    assert!(
        launched >= 20 * 50 * US,
        "20 launches of 50 us: {launched} ns"
    );
    assert!(
        launched < 40 * MS,
        "launches do not wait for kernels: {launched} ns"
    );
    // Synchronising returns once the kernels have truly run: 20 of 2 ms.
    ok(cu.cuStreamSynchronize(s), "cuStreamSynchronize");
    let done = mono_ns() - before;
    assert!(done >= 20 * 2 * MS, "synchronised after {done} ns");
    // The device time recorded is exactly the kernels' (no jitter here).
    assert_eq!(cu.simgpu_process_busy_ns(0, pid), 40 * MS);

    // On an idle stream of an idle device, an event completes at once.
    ok(cu.cuEventRecord(e0, s), "record");
    ok(
        cu.cuEventQuery(e0),
        "an idle device reaches the event at once",
    );
    // Behind a kernel it completes when the kernel does, and is stamped
    // with the kernel's end: the elapsed time is the launch overhead and
    // the kernel.
    ok(launch(&cu, long, s), "launch");
    ok(cu.cuEventRecord(e1, s), "record");
    assert_eq!(cu.cuEventQuery(e1), CUDA_ERROR_NOT_READY);
    let mut ms = 0f32;
    assert_eq!(cu.cuEventElapsedTime(&mut ms, e0, e1), CUDA_ERROR_NOT_READY);
    let waiting = mono_ns();
    ok(cu.cuEventSynchronize(e1), "cuEventSynchronize");
    assert!(
        mono_ns() - waiting >= 25 * MS,
        "the event waits for the kernel"
    );
    let elapsed = elapsed_ns(&cu, e0, e1);
    assert!(
        (30 * MS + 50 * US..30 * MS + 2 * MS).contains(&elapsed),
        "{elapsed} ns"
    );
    ok(cu.cuStreamQuery(s), "cuStreamQuery");
    assert_eq!(cu.simgpu_process_busy_ns(0, pid), 70 * MS);
    assert_eq!(cu.simgpu_device_busy_ns(0), 70 * MS);
    report("DONE", pid);
}

/// `SIMGPU_KERNEL_JITTER=10%`: 200 runs of a 1 ms kernel each take 0.9 to
/// 1.1 ms, not all the same, 1 ms on average; the device time recorded is
/// what they took.
pub fn wall_jitter() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1ms\nfirst 200ms\n");
    let (k, first) = (function(&cu, m, "k"), function(&cu, m, "first"));
    let s = stream(&cu);
    let events: Vec<CUevent> = (0..201).map(|_| event(&cu)).collect();
    // Everything is queued behind a long kernel, so the runs follow each
    // other on the device however slowly this (busy) host queues them.
    let before_first = event(&cu);
    let recording = mono_ns();
    ok(cu.cuEventRecord(before_first, s), "record");
    ok(launch(&cu, first, s), "launch");
    let launched = mono_ns();
    ok(cu.cuEventRecord(events[0], s), "record");
    for e in &events[1..] {
        ok(launch(&cu, k, s), "launch");
        ok(cu.cuEventRecord(*e, s), "record");
    }
    ok(cu.cuStreamSynchronize(s), "sync");
    let runs: Vec<u64> = events
        .windows(2)
        .map(|pair| elapsed_ns(&cu, pair[0], pair[1]))
        .collect();
    // Back to back on one stream: each run is its kernel (event timestamps
    // are f32 milliseconds, good to a few nanoseconds here).
    for run in &runs {
        assert!((899 * US..=1_101 * US).contains(run), "{run} ns");
    }
    let (fastest, slowest) = (
        runs.iter().copied().min().unwrap_or(0),
        runs.iter().copied().max().unwrap_or(0),
    );
    assert!(slowest - fastest > 100 * US, "{fastest}..{slowest} ns");
    let total: u64 = runs.iter().sum();
    // 200 uniform draws: their mean's standard error is 0.4 %.
    assert!(
        (196 * MS..=204 * MS).contains(&total),
        "{total} ns for 200 runs of 1 ms"
    );
    // The device was busy from the first kernel on to the last event: the
    // device time recorded is exactly that. The first kernel started when
    // it was launched, a launch overhead after `before_first` on an idle
    // host, later on a busy one that descheduled this thread in between
    // (the device idles meanwhile, as a GPU would).
    let span = elapsed_ns(&cu, before_first, events[200]);
    let busy = cu.simgpu_process_busy_ns(0, std::process::id());
    let host = launched - recording;
    assert!(
        busy <= span && span - busy < 100 * US + host,
        "busy {busy} ns in a span of {span} ns (the host took {host} ns to record and launch)"
    );
    report("DONE", total);
}

/// Two devices: a stream on device 1 waiting on an event recorded on device
/// 0 runs after device 0's kernel.
pub fn wall_cross_device() {
    let (_lib, cu) = load();
    ok(cu.cuInit(0), "cuInit");
    let image = "SIMGPU-MODULE\nk20 20ms\nk1 1ms\n";
    let mut ctxs = [null_mut(); 2];
    let mut streams = [null_mut(); 2];
    let mut k20 = [null_mut(); 2];
    let mut k1 = [null_mut(); 2];
    for d in 0..2 {
        ok(
            cu.cuCtxCreate_v2(&mut ctxs[d], 0, d as i32),
            "cuCtxCreate_v2",
        );
        streams[d] = stream(&cu);
        let m = load_module(&cu, image);
        k20[d] = function(&cu, m, "k20");
        k1[d] = function(&cu, m, "k1");
    }
    ok(cu.cuCtxSetCurrent(ctxs[0]), "current 0");
    let (start, after_k20) = (event(&cu), event(&cu));
    ok(cu.cuEventRecord(start, streams[0]), "record");
    ok(launch(&cu, k20[0], streams[0]), "launch on 0");
    ok(cu.cuEventRecord(after_k20, streams[0]), "record");
    ok(cu.cuCtxSetCurrent(ctxs[1]), "current 1");
    let done = event(&cu);
    ok(
        cu.cuStreamWaitEvent(streams[1], after_k20, 0),
        "cuStreamWaitEvent",
    );
    ok(launch(&cu, k1[1], streams[1]), "launch on 1");
    ok(cu.cuEventRecord(done, streams[1]), "record");
    ok(cu.cuStreamSynchronize(streams[1]), "sync 1");
    assert_eq!(
        cu.cuEventQuery(after_k20),
        CUDA_SUCCESS,
        "device 1 waited for device 0's kernel"
    );
    let waited = elapsed_ns(&cu, start, done);
    assert!(waited >= 21 * MS, "{waited} ns");
    let pid = std::process::id();
    assert_eq!(cu.simgpu_process_busy_ns(0, pid), 20 * MS);
    assert_eq!(cu.simgpu_process_busy_ns(1, pid), MS);
    report("DONE", waited);
}

/// Launches `KERNEL_MS` kernels back to back for `SECONDS`, then reports
/// the device time it got.
pub fn wall_saturate() {
    let (_lib, cu) = load();
    context(&cu);
    let ms = env_u64("KERNEL_MS");
    let m = load_module(&cu, &format!("SIMGPU-MODULE\nk {ms}ms\n"));
    let k = function(&cu, m, "k");
    let s = stream(&cu);
    report("READY", std::process::id());
    wait_parent();
    let deadline = mono_ns() + env_u64("SECONDS") * 1_000 * MS;
    while mono_ns() < deadline {
        for _ in 0..4 {
            ok(launch(&cu, k, s), "launch");
        }
        ok(cu.cuStreamSynchronize(s), "sync");
    }
    report("BUSY", cu.simgpu_process_busy_ns(0, std::process::id()));
    // The parent may ask for the device's switch counters once every
    // process has reported (so none switches any more) before it ends us.
    if wait_parent().trim() == "switches" {
        report(
            "SWITCHES",
            format!(
                "{} {}",
                cu.simgpu_device_switches(0),
                cu.simgpu_device_switch_ns(0)
            ),
        );
        wait_parent();
    }
}

/// Runs 1 ms kernels when the parent says `run N` (N of them, then waits
/// for them), and reports `RAN` with the device's switches and their
/// device time, this process's and the device's kernel time, and how long
/// the run took; any other line ends it.
pub fn wall_switch_step() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1ms\n");
    let k = function(&cu, m, "k");
    let s = stream(&cu);
    let pid = std::process::id();
    report("READY", pid);
    loop {
        let line = wait_parent();
        let Some(count) = line.trim().strip_prefix("run ") else {
            return;
        };
        let count: u32 = count.parse().expect("a kernel count");
        let start = mono_ns();
        for _ in 0..count {
            ok(launch(&cu, k, s), "launch");
        }
        ok(cu.cuStreamSynchronize(s), "sync");
        let took = mono_ns() - start;
        report(
            "RAN",
            format!(
                "{} {} {} {} {took}",
                cu.simgpu_device_switches(0),
                cu.simgpu_device_switch_ns(0),
                cu.simgpu_process_busy_ns(0, pid),
                cu.simgpu_device_busy_ns(0),
            ),
        );
    }
}

/// Launches a 200 ms kernel and exits at once, normally (its exit handler
/// gives its slot back while its device thread still holds the device).
pub fn wall_exit_running() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nlong 200ms\n");
    let long = function(&cu, m, "long");
    ok(launch(&cu, long, stream(&cu)), "launch");
}
