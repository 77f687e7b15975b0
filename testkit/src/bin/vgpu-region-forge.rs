//! `vgpu-region-forge`: what root in a container can write into the region
//! that limits it, for the hostile-tenant tests on a real node (the
//! workloads image carries it; nothing of the product ships it).
//!
//! ```text
//! vgpu-region-forge [--region PATH] [--arbitration-for-s S] [--every-ms MS] [--lift]
//!                   [--hold-mutex] [--replace N]
//! ```
//!
//! The region is the one the shim uses (`CUDA_DEVICE_MEMORY_SHARED_CACHE`
//! unless `--region`), waited for until a program of the container has made
//! it. For `--arbitration-for-s` seconds, every `--every-ms`, it writes the
//! most important priority and the `force` policy into the header and
//! counts launches on every device (the inputs of the node monitor's
//! arbitration), printing `forged=<times>` as it goes. Then, with `--lift`,
//! it lifts its own limits once (every device uncapped in memory, 100 % of
//! the compute, the effective share whole) and prints `lifted=1`.
//!
//! With `--hold-mutex` it leaves a dead process slot holding memory (what
//! the monitor's janitor returns, under the region's mutex) and marks the
//! mutex held by a thread that does not exist, so no one can take it, then
//! prints `held=1`. With `--replace N` it then replaces the region file N
//! times, every `--every-ms`, with a copy of itself (a new file each time,
//! the mutex still held in it), printing `replaced=N` at the end.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::{MemoryKind, Region, RegionLayout, SHARE_FULL, UNCAPPED};
use vgpu_node_contract::shim_env::ENV_REGION_PATH;

struct Options {
    region: Option<PathBuf>,
    arbitration_for: Duration,
    every: Duration,
    lift: bool,
    hold_mutex: bool,
    replace: u64,
}

const USAGE: &str =
    "vgpu-region-forge [--region PATH] [--arbitration-for-s S] [--every-ms MS] [--lift]\n\
     \x20                 [--hold-mutex] [--replace N]\n\
     Writes into a vgpu region what root in its container can: the most important priority,\n\
     the force policy and launches for S seconds, then (--lift) its limits lifted once;\n\
     (--hold-mutex) a dead process's memory left behind under a mutex held for ever,\n\
     (--replace N) the file replaced N times by a copy of itself, every MS milliseconds.\n\
     For the hostile-tenant tests.";

/// The options, or `None` when asked for help.
fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut options = Options {
        region: None,
        arbitration_for: Duration::ZERO,
        every: Duration::from_millis(100),
        lift: false,
        hold_mutex: false,
        replace: 0,
    };
    let number = |flag: &str, value: Option<String>| -> Result<u64, String> {
        let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
        value
            .parse()
            .map_err(|_| format!("{flag}: {value:?} is not a whole number"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--region" => {
                options.region = Some(args.next().ok_or("--region needs a path")?.into());
            }
            "--arbitration-for-s" => {
                options.arbitration_for = Duration::from_secs(number(&arg, args.next())?);
            }
            "--every-ms" => {
                options.every = Duration::from_millis(number(&arg, args.next())?.max(1))
            }
            "--lift" => options.lift = true,
            "--hold-mutex" => options.hold_mutex = true,
            "--replace" => options.replace = number(&arg, args.next())?,
            "--help" | "-h" => return Ok(None),
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(Some(options))
}

/// The region at `path`, once a program of the container has made it.
fn wait_for_region(path: &Path) -> Result<Region, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Region::open_existing(path) {
            Ok(region) => return Ok(region),
            Err(error) if Instant::now() >= deadline => {
                return Err(format!("region {}: {error}", path.display()))
            }
            // Polled: nothing announces that another process made a file.
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn run(options: Options) -> Result<(), String> {
    let path = match options.region {
        Some(path) => path,
        None => std::env::var_os(ENV_REGION_PATH)
            .map(PathBuf::from)
            .ok_or_else(|| format!("no --region and no {ENV_REGION_PATH} in the environment"))?,
    };
    let region = wait_for_region(&path)?;
    let layout = region.layout();
    let started = Instant::now();
    let mut times = 0u64;
    while started.elapsed() < options.arbitration_for {
        layout.limits.priority.store(i32::MIN, Ordering::Relaxed);
        layout
            .limits
            .policy
            .store(UtilizationPolicy::Force as u32, Ordering::Relaxed);
        for device in &layout.devices {
            device.compute.launches.fetch_add(1_000, Ordering::Relaxed);
        }
        times += 1;
        if times % 10 == 1 {
            println!("forged={times}");
        }
        // Paced: the attack is to be in the region at every monitor pass.
        std::thread::sleep(options.every);
    }
    if options.lift {
        for device in &layout.limits.devices {
            device.memory_limit.store(UNCAPPED, Ordering::Relaxed);
            device.sm_limit.store(100, Ordering::Relaxed);
            device.sm_effective.store(SHARE_FULL, Ordering::Relaxed);
        }
        println!("lifted=1");
    }
    if options.hold_mutex {
        hold_mutex(&path)?;
        println!("held=1");
    }
    for _ in 0..options.replace {
        replace(&path)?;
        std::thread::sleep(options.every);
    }
    if options.replace > 0 {
        println!("replaced={}", options.replace);
    }
    Ok(())
}

/// Memory charged to a process slot whose owner is gone (its liveness lock
/// released with the handle), then the region's mutex marked as held by a
/// thread that does not exist: whoever waits for it waits until they give
/// up.
fn hold_mutex(path: &Path) -> Result<(), String> {
    let failed = |what: &str, error: &dyn std::fmt::Display| format!("{what}: {error}");
    let other = Region::open_existing(path).map_err(|e| failed("a second handle", &e))?;
    let slot = other
        .claim_slot(std::process::id(), 0)
        .map_err(|e| failed("a slot", &e))?;
    other
        .reserve(slot, 0, MemoryKind::Data, 7 << 20)
        .map_err(|e| failed("charging the slot", &e))?
        .map_err(|e| failed("charging the slot", &e))?;
    // Closing the handle releases the slot's liveness lock: its owner is
    // "dead" and its memory is the janitor's to return.
    drop(other);
    // The lock word, the mutex's first field, naming thread 12345.
    let lock_word = std::mem::offset_of!(RegionLayout, lock) as u64;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|file| file.write_at(&12_345u32.to_le_bytes(), lock_word))
        .map_err(|e| failed("writing the mutex", &e))?;
    Ok(())
}

/// `path` replaced by a new file with the same bytes.
fn replace(path: &Path) -> Result<(), String> {
    let failed = |error: std::io::Error| format!("replacing {}: {error}", path.display());
    let bytes = std::fs::read(path).map_err(failed)?;
    let fresh = path.with_extension("forged");
    std::fs::write(&fresh, bytes).map_err(failed)?;
    std::fs::rename(&fresh, path).map_err(failed)
}

fn main() -> ExitCode {
    let outcome = match parse(std::env::args().skip(1)) {
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Some(options)) => run(options),
        Err(message) => Err(message),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("vgpu-region-forge: {message}");
            ExitCode::FAILURE
        }
    }
}
