//! Measuring compute shares on the simulated GPU: workloads run under the
//! shim, and the simulated driver's own record of device time says what
//! share each process really got.

use crate::{programs_dir, Sandbox};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::Duration;

/// Reads the simulated driver's busy-time record (outside the shim).
pub struct BusyMeter {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

/// One reading: when, and how much device time had been used by then.
#[derive(Clone, Copy, Debug)]
pub struct Reading {
    pub at_ns: u64,
    pub process_ns: u64,
    pub device_ns: u64,
}

impl BusyMeter {
    pub fn new(sandbox: &Sandbox) -> Self {
        let mut child = sandbox
            .command_without_shim(&programs_dir().join("simtool"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn simtool");
        let input = child.stdin.take().expect("simtool stdin");
        let output = BufReader::new(child.stdout.take().expect("simtool stdout"));
        Self {
            child,
            input,
            output,
        }
    }

    /// Device time used on `device` by `pid` (0: the device as a whole).
    pub fn read(&mut self, device: u32, pid: u32) -> Reading {
        writeln!(self.input, "{device} {pid}").expect("ask simtool");
        let mut line = String::new();
        self.output.read_line(&mut line).expect("simtool answer");
        let numbers: Vec<u64> = line
            .split_whitespace()
            .map(|n| n.parse().expect("number"))
            .collect();
        assert_eq!(numbers.len(), 3, "simtool said {line:?}");
        Reading {
            at_ns: numbers[0],
            process_ns: numbers[1],
            device_ns: numbers[2],
        }
    }
}

impl Drop for BusyMeter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent of wall time between two readings that the process used.
pub fn process_share(from: Reading, to: Reading) -> f64 {
    100.0 * (to.process_ns - from.process_ns) as f64 / (to.at_ns - from.at_ns) as f64
}

/// Percent of wall time between two readings that the device was busy.
pub fn device_share(from: Reading, to: Reading) -> f64 {
    100.0 * (to.device_ns - from.device_ns) as f64 / (to.at_ns - from.at_ns) as f64
}

/// A workload process under the shim, started and ready.
pub struct Workload {
    pub child: Child,
}

impl Workload {
    /// Starts `workload PATTERN KERNEL SECONDS DEVICES` and waits until its
    /// contexts and modules are set up.
    pub fn start(
        sandbox: &Sandbox,
        pattern: &str,
        kernel: &str,
        seconds: f64,
        devices: u32,
    ) -> Self {
        let mut command = sandbox.command(&programs_dir().join("workload"));
        command.args(Self::args(pattern, kernel, seconds, devices));
        Self::spawn(&mut command)
    }

    /// The arguments of `workload PATTERN KERNEL SECONDS DEVICES`, for a
    /// test that starts it through another program (`vgpu run`).
    pub fn args(pattern: &str, kernel: &str, seconds: f64, devices: u32) -> Vec<String> {
        vec![
            pattern.to_string(),
            kernel.to_string(),
            seconds.to_string(),
            devices.to_string(),
        ]
    }

    /// Starts `command`, which runs the workload (maybe through another
    /// program that passes its stdout on), and waits until it is ready.
    pub fn spawn(command: &mut std::process::Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn workload");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().expect("workload stdout"))
            .read_line(&mut line)
            .expect("workload ready");
        assert_eq!(line.trim(), "ready", "workload did not start");
        Self { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the workload to finish on its own.
    pub fn finish(mut self) {
        let status = self.child.wait().expect("workload exit");
        assert!(status.success(), "workload failed: {status}");
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The same program run uncapped beside a measured one, on a simulated GPU
/// of its own: what the program can reach under the load the measured one
/// runs under, read over the same windows. A share judged against a fixed
/// figure fails whenever the machine is busy (the program falls behind for
/// want of CPU, not of tokens); judged against this, it fails only when the
/// limiter takes more from the program than its cap asks.
pub struct Reference {
    meter: BusyMeter,
    workload: Workload,
    _sandbox: Sandbox,
}

impl Reference {
    /// Starts `workload PATTERN KERNEL SECONDS DEVICES` under the shim with
    /// no cap, in a sandbox of its own with `env` set for the simulated GPU.
    pub fn start(
        env: &[(&str, &str)],
        pattern: &str,
        kernel: &str,
        seconds: f64,
        devices: u32,
    ) -> Self {
        let mut sandbox = Sandbox::new("reference", devices, "16Gi");
        for (key, value) in env {
            sandbox.set(key, value);
        }
        let meter = BusyMeter::new(&sandbox);
        let workload = Workload::start(&sandbox, pattern, kernel, seconds, devices);
        Self {
            meter,
            workload,
            _sandbox: sandbox,
        }
    }

    /// Device time the reference has used on `device` so far.
    pub fn read(&mut self, device: u32) -> Reading {
        let pid = self.workload.pid();
        self.meter.read(device, pid)
    }

    /// Waits for the reference to finish on its own.
    pub fn finish(self) {
        self.workload.finish();
    }
}

/// How far apart two uncapped runs of one program, side by side on a busy
/// machine, may end over a few seconds, as a fraction of what they reach:
/// beside two CPU hogs, 25.3 % against 30.2 % (`vgpu run` under a cap it
/// never reached) and 90.6 % against 95.2 % were measured.
pub const SIDE_BY_SIDE_SPREAD: f64 = 0.2;

/// Judges a share measured under a cap of `limit` percent: the cap holds
/// strictly (never more than `limit` plus `tolerance` points), and the
/// program gets its share unless it could not reach it at all: no less than
/// the smaller of `limit` and `uncapped` (what the same program reached with
/// no cap beside it, over the same window), less `tolerance`. Where the
/// program beside it did not reach the cap, the cap was not what held this
/// one either: the two are then compared as two uncapped runs, within
/// [`SIDE_BY_SIDE_SPREAD`] of the reference (or `tolerance`, the larger).
pub fn assert_share(what: &str, achieved: f64, limit: f64, uncapped: f64, tolerance: f64) {
    assert!(
        achieved <= limit + tolerance,
        "{what}: {achieved:.2} % is over its cap of {limit} % (allowed {tolerance} points; \
         uncapped beside it: {uncapped:.2} %)"
    );
    let floor = if uncapped >= limit + tolerance {
        limit - tolerance
    } else {
        limit.min(uncapped) - tolerance.max(SIDE_BY_SIDE_SPREAD * uncapped)
    };
    assert!(
        achieved >= floor,
        "{what}: {achieved:.2} % is short of {floor:.2} % (cap {limit} %, uncapped beside it \
         {uncapped:.2} %, allowed {tolerance} points)"
    );
}

/// What one measured run achieved.
#[derive(Clone, Copy, Debug)]
pub struct ShareResult {
    /// Share over the first second after start (percent).
    pub first_second: f64,
    /// Share over the measured window after that (percent).
    pub steady: f64,
    /// What the same program reached uncapped beside it over that window.
    pub uncapped: f64,
}

/// Runs one workload in a fresh sandbox at `limit` percent, beside its
/// uncapped [`Reference`], and measures its share over `window` after a
/// one-second start.
pub fn measure_single(limit: u32, pattern: &str, kernel: &str, window: Duration) -> ShareResult {
    measure_single_in(&[], limit, pattern, kernel, window)
}

/// Like [`measure_single`], with `env` set for the simulated GPU (of both
/// the measured workload and its reference).
pub fn measure_single_in(
    env: &[(&str, &str)],
    limit: u32,
    pattern: &str,
    kernel: &str,
    window: Duration,
) -> ShareResult {
    let mut sandbox = Sandbox::new("share", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_SM_LIMIT", &limit.to_string());
    for (key, value) in env {
        sandbox.set(key, value);
    }
    let mut meter = BusyMeter::new(&sandbox);
    let seconds = 1.0 + window.as_secs_f64() + 0.5;
    let mut reference = Reference::start(env, pattern, kernel, seconds, 1);
    let workload = Workload::start(&sandbox, pattern, kernel, seconds, 1);
    let pid = workload.pid();
    let start = meter.read(0, pid);
    wait_until(start.at_ns + 1_000_000_000);
    let settled = meter.read(0, pid);
    let reference_settled = reference.read(0);
    wait_until(settled.at_ns + window.as_nanos() as u64);
    let end = meter.read(0, pid);
    let reference_end = reference.read(0);
    workload.finish();
    reference.finish();
    ShareResult {
        first_second: process_share(start, settled),
        steady: process_share(settled, end),
        uncapped: process_share(reference_settled, reference_end),
    }
}

/// Sleeps until CLOCK_MONOTONIC reaches `deadline_ns`: the end of a
/// measurement window, not a stand-in for synchronisation.
pub fn wait_until(deadline_ns: u64) {
    let now = monotonic_ns();
    if deadline_ns > now {
        std::thread::sleep(Duration::from_nanos(deadline_ns - now));
    }
}

pub use vgpu_node_contract::region::monotonic_ns;
