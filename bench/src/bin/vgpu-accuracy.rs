//! `vgpu-accuracy`: how closely the compute share holds, for every limit,
//! launch pattern and kernel size, on the simulated GPU.
//!
//! Each case runs one workload alone under the shim for a second to settle
//! and then a measured window (10 s by default); the achieved share is the
//! simulated driver's own record of the process's device time over that
//! window. Cases run a few at a time, each on its own simulated device.
//!
//! `cargo build --release && cargo run --release -p vgpu-bench --bin vgpu-accuracy`

use anyhow::{bail, Context, Result};
use std::sync::Mutex;
use std::time::Duration;
use vgpu_testkit::compute::measure_single;

const LIMITS: [u32; 6] = [5, 10, 25, 50, 75, 90];
const PATTERNS: [&str; 4] = ["burst", "sync", "streams", "graph"];
const KERNELS: [&str; 3] = ["k20us", "k1ms", "k30ms"];

struct Options {
    window: Duration,
    jobs: usize,
    limits: Vec<u32>,
    patterns: Vec<String>,
    kernels: Vec<String>,
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

fn parse_options() -> Result<Options> {
    let mut options = Options {
        window: Duration::from_secs(10),
        jobs: 4,
        limits: LIMITS.to_vec(),
        patterns: PATTERNS.iter().map(|p| p.to_string()).collect(),
        kernels: KERNELS.iter().map(|k| k.to_string()).collect(),
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
            "-h" | "--help" => {
                println!(
                    "vgpu-accuracy: achieved compute share against the limit on the simulated GPU.\n\n\
                     Options:\n  --window SECONDS   measured window after a 1 s start (default 10)\n  \
                     --jobs N           cases run at once (default 4)\n  \
                     --limits 5,10,...  limits in percent (default 5,10,25,50,75,90)\n  \
                     --patterns LIST    burst, sync, streams, graph (default all)\n  \
                     --kernels LIST     k20us, k1ms, k30ms (default all)\n\n\
                     Needs release builds (cargo build --release)."
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    for pattern in &options.patterns {
        if !PATTERNS.contains(&pattern.as_str()) {
            bail!("unknown pattern {pattern:?}");
        }
    }
    for kernel in &options.kernels {
        if !KERNELS.contains(&kernel.as_str()) {
            bail!("unknown kernel {kernel:?}");
        }
    }
    if options.limits.iter().any(|l| *l == 0 || *l >= 100) {
        bail!("limits must be between 1 and 99");
    }
    Ok(options)
}

fn main() -> Result<()> {
    let options = parse_options()?;
    let mut cases = Vec::new();
    for &limit in &options.limits {
        for pattern in &options.patterns {
            for kernel in &options.kernels {
                cases.push((limit, pattern.clone(), kernel.clone()));
            }
        }
    }
    let queue = Mutex::new(cases.clone().into_iter().enumerate());
    let results = Mutex::new(vec![None; cases.len()]);
    std::thread::scope(|scope| {
        for _ in 0..options.jobs {
            scope.spawn(|| loop {
                let next = queue.lock().map(|mut q| q.next()).ok().flatten();
                let Some((index, (limit, pattern, kernel))) = next else {
                    break;
                };
                let result = measure_single(limit, &pattern, &kernel, options.window);
                if let Ok(mut results) = results.lock() {
                    results[index] = Some(result);
                }
            });
        }
    });
    let results = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a case panicked"))?;
    println!(
        "vgpu-accuracy: simulated GPU, {:.0} s window after a 1 s start, achieved = device time the process got\n",
        options.window.as_secs_f64()
    );
    println!("| limit | pattern | kernel | achieved | error | first second |");
    println!("|---:|---|---|---:|---:|---:|");
    let mut errors = Vec::new();
    for ((limit, pattern, kernel), result) in cases.iter().zip(&results) {
        let result = result.context("a case did not finish")?;
        let error = result.steady - *limit as f64;
        errors.push((error.abs(), format!("{limit} {pattern} {kernel}")));
        println!(
            "| {limit} % | {pattern} | {kernel} | {:.2} % | {:+.2} | {:.1} % |",
            result.steady, error, result.first_second
        );
    }
    errors.sort_by(|a, b| b.0.total_cmp(&a.0));
    let within = errors.iter().filter(|(e, _)| *e <= 2.0).count();
    println!(
        "\n{within} of {} cases within 2 points; largest error {:.2} points ({})",
        errors.len(),
        errors.first().map(|e| e.0).unwrap_or(0.0),
        errors.first().map(|e| e.1.as_str()).unwrap_or("-")
    );
    Ok(())
}
