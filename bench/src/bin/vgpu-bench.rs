//! `vgpu-bench`: the shim's added cost on the simulated GPU, measured side
//! by side with the driver alone, printed as a table.
//!
//! Run from a release build so the shim measured is the one shipped:
//! `cargo build --release && cargo run --release -p vgpu-bench --bin vgpu-bench`.
//! Every figure is a median over repeats; the ratio columns compare runs
//! taken in the same pass, which is what survives a noisy shared machine.
//! `--save FILE` keeps the results as JSON and `--plot FILE` draws them as
//! bars against the driver alone (SVG); `vgpu-plot` draws saved results again.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use vgpu_bench::overhead::TABLE_HEADER;
use vgpu_bench::{CallCost, OverheadResults, Percentiles, RunInfo, SavedResults, StartUpCost};
use vgpu_testkit::{programs_dir, Sandbox};

#[derive(Clone, Copy)]
enum Setup {
    Driver,
    Shim,
}

struct Options {
    repeats: usize,
    alloc_iterations: u64,
    launch_iterations: u64,
    save: Option<PathBuf>,
    plot: Option<PathBuf>,
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        repeats: 7,
        alloc_iterations: 200_000,
        launch_iterations: 20_000_000,
        save: None,
        plot: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut text = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        let mut value = |name: &str| -> Result<u64> {
            text(name)?
                .parse()
                .with_context(|| format!("{name} needs a whole number"))
        };
        match arg.as_str() {
            "--repeats" => options.repeats = value("--repeats")?.max(1) as usize,
            "--alloc-iterations" => options.alloc_iterations = value("--alloc-iterations")?.max(1),
            "--launch-iterations" => {
                options.launch_iterations = value("--launch-iterations")?.max(1)
            }
            "--save" => options.save = Some(PathBuf::from(text("--save")?)),
            "--plot" => options.plot = Some(PathBuf::from(text("--plot")?)),
            "--quick" => {
                options.repeats = 3;
                options.alloc_iterations = 20_000;
                options.launch_iterations = 2_000_000;
            }
            "-h" | "--help" => {
                println!(
                    "vgpu-bench: measures what the shim adds to driver calls on the simulated GPU.\n\n\
                     Options:\n  --repeats N            runs per figure (median reported; default 7)\n  \
                     --alloc-iterations N   alloc+free pairs per run (default 200000)\n  \
                     --launch-iterations N  launches per run (default 20000000)\n  \
                     --quick                small runs, for a smoke test\n  \
                     --save FILE            write the results as JSON (vgpu-plot draws them again)\n  \
                     --plot FILE            draw the table as bars against the driver alone (SVG)\n\n\
                     Needs release builds of libvgpu.so and libsimgpu.so (cargo build --release)."
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    Ok(options)
}

fn sandbox() -> Sandbox {
    let mut sandbox = Sandbox::new("bench", 1, "80Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "40Gi");
    sandbox
}

/// One run of the 1 ns kernel loop under a 99 % compute cap. Returns the
/// time per launch and, of that, the time spent waiting for tokens (read
/// from the region around the timed loop). With `prefill`, the bucket is
/// given a large balance just before the loop, so no launch waits and the
/// figure is the limiter's bookkeeping alone; without it, the loop runs at
/// its cap (a kernel shorter than the host's own launch sequence is charged
/// the host time, see the README) and pays for crediting and waiting too.
fn capped_launch(iterations: u64, prefill: bool) -> Result<(f64, f64)> {
    let mut sandbox = sandbox();
    sandbox.set("CUDA_DEVICE_SM_LIMIT", "99");
    let mut child = spawn(&sandbox, Setup::Shim, &["kernel", &iterations.to_string()])?;
    let mut reader = BufReader::new(child.stdout.take().context("bench stdout")?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if line.trim() != "ready" {
        bail!("bench program did not get ready: {line:?}");
    }
    let region = vgpu_node_contract::region::Region::open_existing(&sandbox.region)?;
    let throttled = || {
        region.layout().devices[0]
            .compute
            .throttled_ns
            .load(std::sync::atomic::Ordering::Acquire)
    };
    if prefill {
        region.layout().devices[0]
            .compute
            .tokens
            .store(i64::MAX / 4, std::sync::atomic::Ordering::Release);
    }
    let before = throttled();
    child.stdin.as_mut().context("stdin")?.write_all(b"go\n")?;
    line.clear();
    reader.read_line(&mut line)?;
    let after = throttled();
    if !child.wait()?.success() {
        bail!("bench program failed");
    }
    let total: f64 = line
        .trim()
        .strip_prefix("ns=")
        .with_context(|| format!("unexpected output {line:?}"))?
        .parse()?;
    Ok((total, (after - before) as f64 / iterations as f64))
}

fn spawn(sandbox: &Sandbox, setup: Setup, args: &[&str]) -> Result<Child> {
    let program = programs_dir().join("bench");
    let mut command = match setup {
        Setup::Driver => sandbox.command_without_shim(&program),
        Setup::Shim => sandbox.command(&program),
    };
    let init = args.first() == Some(&"init");
    if init {
        // The shim reports its own set-up time at debug level.
        command.env("LIBCUDA_LOG_LEVEL", "3");
    }
    command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if init {
            Stdio::piped()
        } else {
            Stdio::inherit()
        })
        .spawn()
        .context("spawn bench program")
}

/// The shim's own set-up time: (wall, cpu) nanoseconds.
type SetupTime = (f64, f64);

/// The shim's "set-up took N ns, cpu M ns" figures from a debug log.
fn setup_nanos(stderr: &str) -> Option<SetupTime> {
    let rest = stderr.split("set-up took ").nth(1)?;
    let wall = rest.split_whitespace().next()?.parse().ok()?;
    let cpu = rest
        .split("cpu ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((wall, cpu))
}

/// Starts `count` processes, waits until all are ready, releases them at
/// once and returns each one's `ns=` figure.
fn run_together(sandbox: &Sandbox, setup: Setup, count: usize, args: &[&str]) -> Result<Vec<f64>> {
    Ok(run_together_with_setup(sandbox, setup, count, args)?.0)
}

/// As [`run_together`], also returning the shim's own set-up times (init
/// runs under the shim only).
fn run_together_with_setup(
    sandbox: &Sandbox,
    setup: Setup,
    count: usize,
    args: &[&str],
) -> Result<(Vec<f64>, Vec<SetupTime>)> {
    let mut children = Vec::with_capacity(count);
    let mut readers = Vec::with_capacity(count);
    for _ in 0..count {
        let mut child = spawn(sandbox, setup, args)?;
        let stdout = child.stdout.take().context("bench stdout")?;
        children.push(child);
        readers.push(BufReader::new(stdout));
    }
    for reader in &mut readers {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("bench program did not get ready: {line:?}");
        }
    }
    for child in &mut children {
        child.stdin.as_mut().context("stdin")?.write_all(b"go\n")?;
    }
    let mut figures = Vec::with_capacity(count);
    let mut setups = Vec::new();
    for (mut child, mut reader) in children.into_iter().zip(readers) {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            std::io::Read::read_to_string(&mut pipe, &mut stderr)?;
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("bench program failed: {status}\n{stderr}");
        }
        if let (Setup::Shim, Some(figures)) = (setup, setup_nanos(&stderr)) {
            setups.push(figures);
        }
        let value = line
            .trim()
            .strip_prefix("ns=")
            .with_context(|| format!("unexpected output {line:?}"))?;
        figures.push(value.parse()?);
    }
    Ok((figures, setups))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn percentile(values: &mut [f64], fraction: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * fraction).round() as usize;
    values[index]
}

/// Median over repeats of the per-run median across processes; driver and
/// shim runs alternate so drift on the machine hits both alike.
fn paired(options: &Options, count: usize, args: &[&str]) -> Result<(f64, f64)> {
    let (mut driver, mut shim) = (Vec::new(), Vec::new());
    for _ in 0..options.repeats {
        let sandbox = sandbox();
        driver.push(median(&mut run_together(
            &sandbox,
            Setup::Driver,
            count,
            args,
        )?));
        shim.push(median(&mut run_together(
            &sandbox,
            Setup::Shim,
            count,
            args,
        )?));
    }
    Ok((median(&mut driver), median(&mut shim)))
}

/// Prints a row as soon as it is measured: a full run takes minutes.
fn print_row(row: &str) {
    print!("{row}");
    let _ = std::io::stdout().flush();
}

fn main() -> Result<()> {
    let options = parse_options()?;
    let alloc_iterations = options.alloc_iterations.to_string();
    let launch_iterations = options.launch_iterations.to_string();
    println!(
        "vgpu-bench: simulated GPU, {} repeats per figure (median)\n",
        options.repeats
    );
    print!("{TABLE_HEADER}");
    let mut calls = Vec::new();
    let mut record = |call: CallCost| {
        print_row(&call.table_row());
        calls.push(call);
    };
    for processes in [1usize, 8] {
        let (driver, shim) = paired(
            &options,
            processes,
            &["alloc", &alloc_iterations, "1048576"],
        )?;
        let plural = if processes == 1 { "" } else { "es" };
        record(CallCost {
            measurement: format!(
                "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), {processes} process{plural}"
            ),
            short: format!("alloc + free 1 MiB, {processes} process{plural}"),
            baseline_ns: driver,
            measured_ns: shim,
            decimals: 0,
        });
    }
    // Every 1 MiB allocation spills: the cap is below it.
    let (mut device_pairs, mut spilled_pairs) = (Vec::new(), Vec::new());
    for _ in 0..options.repeats {
        let plain = sandbox();
        let mut swapping = sandbox();
        swapping
            .set("CUDA_DEVICE_MEMORY_LIMIT", "512k")
            .set("CUDA_OVERSUBSCRIBE", "true")
            .set("VGPU_SWAP_LIMIT", "1Gi");
        device_pairs.push(median(&mut run_together(
            &plain,
            Setup::Shim,
            1,
            &["alloc", &alloc_iterations, "1048576"],
        )?));
        spilled_pairs.push(median(&mut run_together(
            &swapping,
            Setup::Shim,
            1,
            &["alloc", &alloc_iterations, "1048576"],
        )?));
    }
    record(CallCost {
        measurement: "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB) served from host swap, against one in device memory (both with shim)".into(),
        short: "alloc + free 1 MiB from host swap ÷ device memory".into(),
        baseline_ns: median(&mut device_pairs),
        measured_ns: median(&mut spilled_pairs),
        decimals: 0,
    });
    let (driver, shim) = paired(&options, 1, &["launch", &launch_iterations])?;
    record(CallCost {
        measurement: "cuLaunchKernel refused by the driver (hook only), no compute cap".into(),
        short: "launch refused by the driver (the hook alone)".into(),
        baseline_ns: driver,
        measured_ns: shim,
        decimals: 1,
    });
    let kernel_iterations = (options.launch_iterations / 10).max(1);
    let (mut driver, mut uncapped, mut capped, mut waiting) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut in_hand = Vec::new();
    let iterations_text = kernel_iterations.to_string();
    for _ in 0..options.repeats {
        let plain = sandbox();
        driver.push(median(&mut run_together(
            &plain,
            Setup::Driver,
            1,
            &["kernel", &iterations_text],
        )?));
        uncapped.push(median(&mut run_together(
            &plain,
            Setup::Shim,
            1,
            &["kernel", &iterations_text],
        )?));
        let (total, waited) = capped_launch(kernel_iterations, false)?;
        capped.push(total);
        waiting.push(waited);
        let (total, waited) = capped_launch(kernel_iterations, true)?;
        if waited > 0.0 {
            bail!("a launch waited although the bucket was full");
        }
        in_hand.push(total);
    }
    let driver = median(&mut driver);
    let waiting = median(&mut waiting);
    for (measurement, short, measured_ns) in [
        (
            "cuLaunchKernel of a 1 ns kernel, no compute cap".to_string(),
            "launch of a 1 ns kernel, no compute cap",
            median(&mut uncapped),
        ),
        (
            "cuLaunchKernel of a 1 ns kernel, 99 % cap, tokens in hand".to_string(),
            "launch of a 1 ns kernel, 99 % cap, tokens in hand",
            median(&mut in_hand),
        ),
        (
            format!("cuLaunchKernel of a 1 ns kernel, 99 % cap, at the cap (of which {waiting:.1} ns waiting)"),
            "launch of a 1 ns kernel, 99 % cap, at the cap",
            median(&mut capped),
        ),
    ] {
        record(CallCost {
            measurement,
            short: short.into(),
            baseline_ns: driver,
            measured_ns,
            decimals: 1,
        });
    }
    let mut start_ups = Vec::new();
    for (processes, region_exists) in [(1usize, false), (64, false), (64, true)] {
        let (mut driver, mut shim, mut own) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..options.repeats {
            let sandbox = sandbox();
            // The simulated driver creates its state file on first use: keep
            // that out of both columns.
            run_together(&sandbox, Setup::Driver, 1, &["init"])?;
            if region_exists {
                // As the device plugin prepares it before the container starts.
                run_together(&sandbox, Setup::Shim, 1, &["init"])?;
            }
            driver.extend(run_together(&sandbox, Setup::Driver, processes, &["init"])?);
            let (figures, setups) =
                run_together_with_setup(&sandbox, Setup::Shim, processes, &["init"])?;
            shim.extend(figures);
            own.extend(setups);
        }
        if own.len() != shim.len() {
            bail!(
                "{} of {} shim runs reported their set-up time",
                own.len(),
                shim.len()
            );
        }
        let mut wall: Vec<f64> = own.iter().map(|(wall, _)| *wall).collect();
        let mut cpu: Vec<f64> = own.iter().map(|(_, cpu)| *cpu).collect();
        let start_up = StartUpCost {
            processes,
            region_exists,
            driver_ms: milliseconds(&mut driver),
            shim_ms: milliseconds(&mut shim),
            shim_own_wall_ms: milliseconds(&mut wall),
            shim_own_cpu_ms: milliseconds(&mut cpu),
        };
        print_row(&start_up.table_rows());
        start_ups.push(start_up);
    }
    let saved = SavedResults::Overhead(OverheadResults {
        run: RunInfo::of_this_process(),
        repeats: options.repeats,
        alloc_iterations: options.alloc_iterations,
        launch_iterations: options.launch_iterations,
        calls,
        start_ups,
    });
    if let Some(path) = &options.save {
        saved.save(path)?;
    }
    if let Some(path) = &options.plot {
        saved.save_plot(path)?;
    }
    Ok(())
}

/// The p50 and p99 of nanosecond figures, in milliseconds.
fn milliseconds(nanoseconds: &mut [f64]) -> Percentiles {
    Percentiles {
        p50: percentile(nanoseconds, 0.5) / 1e6,
        p99: percentile(nanoseconds, 0.99) / 1e6,
    }
}
