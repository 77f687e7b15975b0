//! `vgpu-accuracy`: how closely the compute share holds, for every limit,
//! launch pattern and kernel size, on the simulated GPU.
//!
//! Each case runs one workload alone under the shim for a second to settle
//! and then a measured window (10 s by default); the achieved share is the
//! simulated driver's own record of the process's device time over that
//! window. Cases run a few at a time, each on its own simulated device.
//! `--tenants` adds sets of containers sharing one device, each saturating
//! it at its own limit.
//!
//! `--timing wall` runs the simulated GPU's wall timing (`SIMGPU_TIMING`):
//! kernels run by a device thread in wall-clock time, vary from run to run
//! (`--jitter`, 5 % either way unless given) and every launch costs host
//! time (`--launch-overhead`, simgpu's 4 us unless given).
//!
//! `--compare-blocking` runs every case twice, side by side: with ordinary
//! launches and with launches that return only once their work has
//! finished (`CUDA_LAUNCH_BLOCKING=1`, which the simulated GPU honours as
//! the driver does), and prints how far each held its limit.
//!
//! `cargo build --release && cargo run --release -p vgpu-bench --bin vgpu-accuracy`
//! (`--save FILE` keeps the results as JSON, `--plot FILE` draws them as
//! SVG; `vgpu-plot` draws saved results again).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;
use vgpu_bench::accuracy::blocking_pattern;
use vgpu_bench::{AccuracyCase, AccuracyResults, RunInfo, SavedResults, SimulatedGpu, TenantCase};
use vgpu_testkit::compute::{process_share, wait_until, BusyMeter, Reading, Workload};
use vgpu_testkit::Sandbox;

const LIMITS: [u32; 6] = [5, 10, 25, 50, 75, 90];
const PATTERNS: [&str; 4] = ["burst", "sync", "streams", "graph"];
const KERNELS: [&str; 3] = ["k20us", "k1ms", "k30ms"];
/// The kernel the workload program runs for a length it does not have,
/// with its duration replaced (`SIMGPU_KERNELS`).
const STAND_IN_KERNEL: &str = "k1ms";
/// Wall timing's kernel spread unless `--jitter` says otherwise: about an
/// H100's for one kernel under load (1.39 to 1.65 ms for a 1.62 ms product).
const WALL_JITTER_PERCENT: f64 = 5.0;
/// simgpu's launch overhead in wall timing when none is set.
const WALL_LAUNCH_OVERHEAD_US: f64 = 4.0;

struct Options {
    window: Duration,
    jobs: usize,
    limits: Vec<u32>,
    patterns: Vec<String>,
    kernels: Vec<String>,
    tenants: Vec<Vec<u32>>,
    tenant_pattern: String,
    tenant_kernel: String,
    timing: String,
    jitter_percent: Option<f64>,
    launch_overhead_us: Option<f64>,
    compare_blocking: bool,
    save: Option<PathBuf>,
    plot: Option<PathBuf>,
}

fn parse_list<T: std::str::FromStr>(text: &str, what: &str) -> Result<Vec<T>> {
    text.split(',')
        .map(|item| {
            item.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("bad {what}: {item:?}"))
        })
        .collect()
}

/// `k20us`, `k200us`, `k1ms`...: the kernel's duration in nanoseconds.
fn kernel_ns(kernel: &str) -> Option<u64> {
    let text = kernel.strip_prefix('k')?;
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let scale = match unit {
        "us" => 1_000,
        "ms" => 1_000_000,
        _ => return None,
    };
    Some(number * scale).filter(|&ns| ns > 0)
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        window: Duration::from_secs(10),
        jobs: 4,
        limits: LIMITS.to_vec(),
        patterns: PATTERNS.iter().map(|p| p.to_string()).collect(),
        kernels: KERNELS.iter().map(|k| k.to_string()).collect(),
        tenants: Vec::new(),
        tenant_pattern: "burst".into(),
        tenant_kernel: "k1ms".into(),
        timing: "timeline".into(),
        jitter_percent: None,
        launch_overhead_us: None,
        compare_blocking: false,
        save: None,
        plot: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--window" => {
                options.window =
                    Duration::from_secs_f64(value()?.parse().context("--window: seconds")?)
            }
            "--jobs" => {
                options.jobs = value()?
                    .parse::<usize>()
                    .context("--jobs: a number")?
                    .max(1)
            }
            "--limits" => options.limits = parse_list(&value()?, "limit")?,
            "--patterns" => options.patterns = parse_list(&value()?, "pattern")?,
            "--kernels" => options.kernels = parse_list(&value()?, "kernel")?,
            "--tenants" => {
                options.tenants = value()?
                    .split(';')
                    .map(|set| parse_list(set, "tenant limit"))
                    .collect::<Result<_>>()?
            }
            "--tenant-pattern" => options.tenant_pattern = value()?,
            "--tenant-kernel" => options.tenant_kernel = value()?,
            "--timing" => options.timing = value()?,
            "--jitter" => {
                options.jitter_percent = Some(
                    value()?
                        .trim_end_matches('%')
                        .parse()
                        .context("--jitter: a percentage")?,
                )
            }
            "--launch-overhead" => {
                let text = value()?;
                let us = text
                    .strip_suffix("us")
                    .and_then(|n| n.parse::<f64>().ok())
                    .context("--launch-overhead: microseconds, such as 4us")?;
                options.launch_overhead_us = Some(us);
            }
            "--quick" => {
                options.window = Duration::from_secs(2);
                options.limits = vec![25, 75];
                options.patterns = vec!["burst".into(), "graph".into()];
                options.kernels = vec!["k1ms".into()];
            }
            "--compare-blocking" => options.compare_blocking = true,
            "--save" => options.save = Some(PathBuf::from(value()?)),
            "--plot" => options.plot = Some(PathBuf::from(value()?)),
            "-h" | "--help" => {
                println!(
                    "vgpu-accuracy: achieved compute share against the limit on the simulated GPU.\n\n\
                     Options:\n  --window SECONDS   measured window after a 1 s start (default 10)\n  \
                     --jobs N           cases run at once (default 4)\n  \
                     --limits 5,10,...  limits in percent (default 5,10,25,50,75,90)\n  \
                     --patterns LIST    burst, sync, streams, graph (default all)\n  \
                     --kernels LIST     kernel lengths: k20us, k1ms, k30ms (default), or any\n                     \
                     kNus / kNms (the workload's k1ms with its duration replaced)\n  \
                     --tenants SETS     containers sharing one device, each saturating it:\n                     \
                     limits separated by commas, sets by semicolons (30,70;25,25,25,25)\n  \
                     --tenant-pattern P the tenants' pattern (default burst)\n  \
                     --tenant-kernel K  the tenants' kernel (default k1ms)\n  \
                     --timing T         timeline (default) or wall: kernels run in wall-clock time\n  \
                     --jitter PERCENT   each kernel run varies by up to this either way\n                     \
                     (default 5 with wall timing, 0 with timeline)\n  \
                     --launch-overhead Nus  host time a launch costs (default: simgpu's, 4us with wall)\n  \
                     --compare-blocking each case also with CUDA_LAUNCH_BLOCKING=1 (launches\n                     \
                     that return once their work finished), side by side\n  \
                     --quick            4 cases (25 and 75 %, burst and graph, k1ms), 2 s each\n  \
                     --save FILE        write the results as JSON (vgpu-plot draws them again)\n  \
                     --plot FILE        draw achieved against target as SVG\n\n\
                     Needs release builds (cargo build --release)."
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    for pattern in options.patterns.iter().chain([&options.tenant_pattern]) {
        if !PATTERNS.contains(&pattern.as_str()) {
            bail!("unknown pattern {pattern:?}");
        }
    }
    for kernel in options.kernels.iter().chain([&options.tenant_kernel]) {
        if kernel_ns(kernel).is_none() {
            bail!("unknown kernel {kernel:?} (k20us, k1ms, k200us...)");
        }
    }
    if options.limits.iter().any(|l| *l == 0 || *l >= 100) {
        bail!("limits must be between 1 and 99");
    }
    for set in &options.tenants {
        if set.is_empty() || set.contains(&0) || set.iter().sum::<u32>() > 100 {
            bail!("a tenant set needs limits above 0 that add up to at most 100: {set:?}");
        }
    }
    if !["timeline", "wall"].contains(&options.timing.as_str()) {
        bail!("--timing is timeline or wall");
    }
    if options
        .jitter_percent
        .is_some_and(|j| !(0.0..100.0).contains(&j))
    {
        bail!("--jitter must be from 0 up to 100 %");
    }
    Ok(options)
}

/// The simulated GPU the options ask for, and the environment that sets it.
fn simulated_gpu(options: &Options) -> (SimulatedGpu, Vec<(String, String)>) {
    let wall = options.timing == "wall";
    let jitter = options
        .jitter_percent
        .unwrap_or(if wall { WALL_JITTER_PERCENT } else { 0.0 });
    let overhead =
        options
            .launch_overhead_us
            .unwrap_or(if wall { WALL_LAUNCH_OVERHEAD_US } else { 0.0 });
    let mut env = vec![
        ("SIMGPU_TIMING".to_string(), options.timing.clone()),
        ("SIMGPU_KERNEL_JITTER".to_string(), format!("{jitter}%")),
    ];
    if let Some(us) = options.launch_overhead_us {
        env.push(("SIMGPU_LAUNCH_OVERHEAD".to_string(), format!("{us}us")));
    }
    let gpu = SimulatedGpu {
        timing: options.timing.clone(),
        kernel_jitter_percent: jitter,
        launch_overhead_us: overhead,
    };
    (gpu, env)
}

/// The workload's kernel for `kernel`, and the environment that gives it
/// that length if the workload has no such kernel.
fn workload_kernel(kernel: &str) -> (&str, Option<(String, String)>) {
    if KERNELS.contains(&kernel) {
        return (kernel, None);
    }
    let ns = kernel_ns(kernel).unwrap_or(1_000_000);
    (
        STAND_IN_KERNEL,
        Some((
            "SIMGPU_KERNELS".to_string(),
            format!("{STAND_IN_KERNEL}={ns}ns"),
        )),
    )
}

fn sandbox(tag: &str, env: &[(String, String)], kernel: &str) -> (Sandbox, String) {
    let mut sandbox = Sandbox::new(tag, 1, "16Gi");
    for (key, value) in env {
        sandbox.set(key, value);
    }
    let (name, replaced) = workload_kernel(kernel);
    if let Some((key, value)) = replaced {
        sandbox.set(&key, &value);
    }
    (sandbox, name.to_string())
}

/// What one workload alone achieved (percent of the device).
#[derive(Clone, Copy)]
struct Single {
    /// Over the first second after start.
    first_second: f64,
    /// Over the measured window after that.
    steady: f64,
}

/// One workload alone at `limit`: its share over the first second and
/// over `window` after it. Alone: the sweep measures the limiter on a quiet
/// machine, so it runs no uncapped reference beside it.
fn measure_single(
    env: &[(String, String)],
    limit: u32,
    pattern: &str,
    kernel: &str,
    window: Duration,
) -> Single {
    let (mut sandbox, kernel) = sandbox("share", env, kernel);
    sandbox.set("CUDA_DEVICE_SM_LIMIT", &limit.to_string());
    let mut meter = BusyMeter::new(&sandbox);
    let seconds = 1.0 + window.as_secs_f64() + 0.5;
    let workload = Workload::start(&sandbox, pattern, &kernel, seconds, 1);
    let pid = workload.pid();
    let start = meter.read(0, pid);
    wait_until(start.at_ns + 1_000_000_000);
    let settled = meter.read(0, pid);
    wait_until(settled.at_ns + window.as_nanos() as u64);
    let end = meter.read(0, pid);
    workload.finish();
    Single {
        first_second: process_share(start, settled),
        steady: process_share(settled, end),
    }
}

/// Containers at `limits` on one device, all running `pattern` flat out:
/// each one's share over `window` after a one-second start.
fn measure_tenants(
    env: &[(String, String)],
    limits: &[u32],
    pattern: &str,
    kernel: &str,
    window: Duration,
) -> Vec<f64> {
    let (base, _) = sandbox("tenants", env, kernel);
    let mut meter = BusyMeter::new(&base);
    let workloads: Vec<(Sandbox, Workload)> = limits
        .iter()
        .enumerate()
        .map(|(index, limit)| {
            // Same simulated device (state file and libraries), separate
            // containers (regions).
            let (mut container, workload_kernel) = sandbox("tenant", env, kernel);
            container
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
            let seconds = 1.0 + window.as_secs_f64() + 0.5;
            let workload = Workload::start(&container, pattern, &workload_kernel, seconds, 1);
            (container, workload)
        })
        .collect();
    let start = meter.read(0, 0);
    wait_until(start.at_ns + 1_000_000_000);
    let settled: Vec<Reading> = workloads
        .iter()
        .map(|(_, w)| meter.read(0, w.pid()))
        .collect();
    wait_until(settled[0].at_ns + window.as_nanos() as u64);
    let end: Vec<Reading> = workloads
        .iter()
        .map(|(_, w)| meter.read(0, w.pid()))
        .collect();
    let shares = settled
        .iter()
        .zip(&end)
        .map(|(from, to)| process_share(*from, *to))
        .collect();
    for (_, workload) in workloads {
        workload.finish();
    }
    shares
}

fn main() -> Result<()> {
    let options = parse_options()?;
    let (gpu, env) = simulated_gpu(&options);
    let mut cases = Vec::new();
    let variants: &[bool] = if options.compare_blocking {
        &[false, true]
    } else {
        &[false]
    };
    for &limit in &options.limits {
        for pattern in &options.patterns {
            for kernel in &options.kernels {
                for &blocking in variants {
                    cases.push((limit, pattern.clone(), kernel.clone(), blocking));
                }
            }
        }
    }
    let blocking_env: Vec<(String, String)> = env
        .iter()
        .cloned()
        .chain([("CUDA_LAUNCH_BLOCKING".to_string(), "1".to_string())])
        .collect();
    let queue = Mutex::new(cases.clone().into_iter().enumerate());
    let results = Mutex::new(vec![None; cases.len()]);
    std::thread::scope(|scope| {
        for _ in 0..options.jobs {
            scope.spawn(|| loop {
                let next = queue.lock().map(|mut q| q.next()).ok().flatten();
                let Some((index, (limit, pattern, kernel, blocking))) = next else {
                    break;
                };
                let env = if blocking { &blocking_env } else { &env };
                let result = measure_single(env, limit, &pattern, &kernel, options.window);
                if let Ok(mut results) = results.lock() {
                    results[index] = Some(result);
                }
            });
        }
    });
    let results = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a case panicked"))?;
    let cases = cases
        .into_iter()
        .zip(results)
        .map(|((limit, pattern, kernel, blocking), result)| {
            let result = result.context("a case did not finish")?;
            Ok(AccuracyCase {
                limit,
                pattern: if blocking {
                    blocking_pattern(&pattern)
                } else {
                    pattern
                },
                kernel,
                achieved: result.steady,
                first_second: result.first_second,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // One set at a time: each saturates its device, and a set's containers
    // must not share the CPUs with another set's.
    let tenants = options
        .tenants
        .iter()
        .map(|limits| TenantCase {
            pattern: options.tenant_pattern.clone(),
            kernel: options.tenant_kernel.clone(),
            limits: limits.clone(),
            achieved: measure_tenants(
                &env,
                limits,
                &options.tenant_pattern,
                &options.tenant_kernel,
                options.window,
            ),
        })
        .collect();
    let results = AccuracyResults {
        run: RunInfo::of_this_process(),
        gpu,
        window_seconds: options.window.as_secs_f64(),
        cases,
        tenants,
    };
    println!(
        "vgpu-accuracy: simulated GPU ({}), {:.0} s window after a 1 s start, achieved = device time the process got\n",
        results.gpu.describe(),
        options.window.as_secs_f64()
    );
    print!("{}", results.tables());
    if options.compare_blocking {
        println!();
        print!("{}", results.blocking_table());
    }
    let saved = SavedResults::Accuracy(results);
    if let Some(path) = &options.save {
        saved.save(path)?;
    }
    if let Some(path) = &options.plot {
        saved.save_plot(path)?;
    }
    Ok(())
}
