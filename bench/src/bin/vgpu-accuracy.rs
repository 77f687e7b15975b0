//! `vgpu-accuracy`: how closely the compute share holds, for every limit,
//! launch pattern and kernel size, on the simulated GPU.
//!
//! Each case runs one workload alone under the shim for a second to settle
//! and then a measured window (10 s by default); the achieved share is the
//! simulated driver's own record of the process's device time over that
//! window. Cases run a few at a time, each on its own simulated device.
//!
//! `cargo build --release && cargo run --release -p vgpu-bench --bin vgpu-accuracy`
//! (`--save FILE` keeps the results as JSON, `--plot FILE` draws them as
//! SVG; `vgpu-plot` draws saved results again).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;
use vgpu_bench::{AccuracyCase, AccuracyResults, RunInfo, SavedResults};
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

fn parse_options() -> Result<Options> {
    let mut options = Options {
        window: Duration::from_secs(10),
        jobs: 4,
        limits: LIMITS.to_vec(),
        patterns: PATTERNS.iter().map(|p| p.to_string()).collect(),
        kernels: KERNELS.iter().map(|k| k.to_string()).collect(),
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
            "--quick" => {
                options.window = Duration::from_secs(2);
                options.limits = vec![25, 75];
                options.patterns = vec!["burst".into(), "graph".into()];
                options.kernels = vec!["k1ms".into()];
            }
            "--save" => options.save = Some(PathBuf::from(value()?)),
            "--plot" => options.plot = Some(PathBuf::from(value()?)),
            "-h" | "--help" => {
                println!(
                    "vgpu-accuracy: achieved compute share against the limit on the simulated GPU.\n\n\
                     Options:\n  --window SECONDS   measured window after a 1 s start (default 10)\n  \
                     --jobs N           cases run at once (default 4)\n  \
                     --limits 5,10,...  limits in percent (default 5,10,25,50,75,90)\n  \
                     --patterns LIST    burst, sync, streams, graph (default all)\n  \
                     --kernels LIST     k20us, k1ms, k30ms (default all)\n  \
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
    let cases = cases
        .into_iter()
        .zip(results)
        .map(|((limit, pattern, kernel), result)| {
            let result = result.context("a case did not finish")?;
            Ok(AccuracyCase {
                limit,
                pattern,
                kernel,
                achieved: result.steady,
                first_second: result.first_second,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let results = AccuracyResults {
        run: RunInfo::of_this_process(),
        window_seconds: options.window.as_secs_f64(),
        cases,
    };
    println!(
        "vgpu-accuracy: simulated GPU, {:.0} s window after a 1 s start, achieved = device time the process got\n",
        options.window.as_secs_f64()
    );
    print!("{}", results.tables());
    let saved = SavedResults::Accuracy(results);
    if let Some(path) = &options.save {
        saved.save(path)?;
    }
    if let Some(path) = &options.plot {
        saved.save_plot(path)?;
    }
    Ok(())
}
