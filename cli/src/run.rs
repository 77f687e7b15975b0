//! `vgpu run`: the region, the shim's environment, the command, its status.
//!
//! The environment is the device plugin's: [`ShimConfig::to_env`] writes
//! what the shim reads back, from the same limits the region is created
//! with. Limits are the same on every GPU (`--devices` only narrows what
//! the command sees), so a region is one cap and one share per GPU.

use crate::args::RunArgs;
use crate::places::{self, PlaceError, REGION_FILE};
use std::ffi::OsString;
use std::fs::File;
use std::path::Path;
use thiserror::Error;
use vgpu_cluster::file_error::{io_error, FileError};
use vgpu_node_contract::figures::has_live_process;
use vgpu_node_contract::region::limits::granted::{region_limits, DeviceShare, NodeLimits};
use vgpu_node_contract::region::{Region, RegionError, RegionLimits, MAX_DEVICES, UNCAPPED};
use vgpu_node_contract::shim_env::{self, ShimConfig};

/// `CUDA_VISIBLE_DEVICES`: the driver's own filter of the GPUs a process sees.
const ENV_CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// Next to each region: every `vgpu run` in it holds a shared lock while its
/// command runs, so another can tell whether the region is in use.
const RUNS_LOCK: &str = "runs.lock";

/// Exit status when vgpu itself could not set the run up (as `docker run`).
pub const EXIT_SETUP: i32 = 125;
/// Exit status when the command could not be executed (as shells).
pub const EXIT_NOT_EXECUTABLE: i32 = 126;
/// Exit status when the command was not found (as shells).
pub const EXIT_NOT_FOUND: i32 = 127;

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error("region {name:?} is in use with other limits ({current}); run with those, or change them with `vgpu set {name}`")]
    LimitsDiffer { name: String, current: String },
    #[error("{command}: command not found")]
    NotFound { command: String },
    #[error("{command}: {source}")]
    NotExecutable {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("waiting for the command: {0}")]
    Wait(#[source] std::io::Error),
}

impl RunError {
    /// The exit status `vgpu run` ends with for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::NotFound { .. } => EXIT_NOT_FOUND,
            Self::NotExecutable { .. } => EXIT_NOT_EXECUTABLE,
            Self::Place(PlaceError::MissingLibrary(_) | PlaceError::NoLibrary { .. }) => 2,
            _ => EXIT_SETUP,
        }
    }
}

/// An I/O failure of a run is told as the places' own.
impl From<FileError> for RunError {
    fn from(error: FileError) -> Self {
        Self::Place(error.into())
    }
}

/// The limits a run asks for, the same on every GPU.
pub fn limits_of(args: &RunArgs) -> RegionLimits {
    let share = DeviceShare {
        memory_bytes: args.memory.unwrap_or(UNCAPPED),
        cores_percent: args.cores.unwrap_or(100),
        burst_percent: args.burst,
    };
    let node = NodeLimits {
        swap_limit: args.swap,
        ..NodeLimits::default()
    };
    region_limits([share; MAX_DEVICES], None, &node)
}

/// Describes the limits of device 0 (all devices have the same in a local
/// region), for messages.
pub fn describe(limits: &RegionLimits) -> String {
    crate::show::LimitsView::of(limits, 0).to_string()
}

/// Runs the command and returns the exit status `vgpu run` ends with.
pub fn run(root: &Path, args: RunArgs) -> Result<i32, RunError> {
    let library = places::find_library(args.library.as_deref())?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| format!("run-{}", std::process::id()));
    let limits = limits_of(&args);
    places::ensure_root(root)?;
    let dir = places::local_dir(root, &name);
    places::ensure_root(&dir)?;
    let region_path = dir.join(REGION_FILE);
    // Held (shared) until the command ends: `runs` says the region is in use.
    let runs = join_region(&dir, &region_path, &name, &limits)?;

    let config = ShimConfig {
        limits,
        region_path: region_path.display().to_string(),
        region_path_set: true,
        oversubscribe: args.swap.is_some(),
        ..ShimConfig::default()
    };
    let mut command = tokio::process::Command::new(&args.command[0]);
    command.args(&args.command[1..]);
    for (key, _) in std::env::vars_os() {
        if is_limit_variable(&key) {
            command.env_remove(&key);
        }
    }
    command.envs(config.to_env(MAX_DEVICES));
    command.env("LD_PRELOAD", preload_value(&library));
    if let Some(devices) = &args.devices {
        let list: Vec<String> = devices.0.iter().map(u32::to_string).collect();
        command.env(ENV_CUDA_VISIBLE_DEVICES, list.join(","));
        // Number the GPUs as nvidia-smi does, as the device plugin does.
        command.env(shim_env::ENV_DEVICE_ORDER, "PCI_BUS_ID");
    }
    tracing::info!(region = %region_path.display(), library = %library.display(), "starting");
    let status = wait(command, &args.command[0])?;
    drop(runs);
    Ok(status)
}

/// Opens (or creates) the region with `limits` and takes this run's shared
/// lock on it. A region with other limits is replaced only when idle: no
/// run holds its lock and no process holds a slot.
fn join_region(
    dir: &Path,
    region_path: &Path,
    name: &str,
    limits: &RegionLimits,
) -> Result<File, RunError> {
    let lock_path = dir.join(RUNS_LOCK);
    let runs = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(io_error(&lock_path, "open"))?;
    // Exclusive only if no other run holds it: then this run may replace
    // a stale region. Otherwise wait (briefly) for any run still setting up.
    let alone = runs.try_lock().is_ok();
    if !alone {
        runs.lock_shared().map_err(io_error(&lock_path, "lock"))?;
    }
    let region = Region::open_or_create(region_path, limits)?;
    let current = region.limits();
    if current != limits.as_stored() {
        if !alone || has_live_process(&region) {
            return Err(RunError::LimitsDiffer {
                name: name.to_string(),
                current: describe(&current),
            });
        }
        tracing::info!(region = %region_path.display(), "idle region: replaced with the new limits");
        drop(region);
        std::fs::remove_file(region_path).map_err(io_error(region_path, "remove"))?;
        Region::open_or_create(region_path, limits)?;
    }
    if alone {
        // Converts the exclusive lock: other runs may now join.
        runs.lock_shared().map_err(io_error(&lock_path, "lock"))?;
    }
    Ok(runs)
}

/// Whether `key` is one of the shim's limit variables, which this run sets
/// itself (an inherited one must not change what the region says). An
/// inherited `CUDA_VISIBLE_DEVICES` stays unless `--devices` replaces it.
fn is_limit_variable(key: &OsString) -> bool {
    let Some(key) = key.to_str() else {
        return false;
    };
    let bases = [
        shim_env::ENV_MEMORY_LIMIT,
        shim_env::ENV_SM_LIMIT,
        shim_env::ENV_SM_BURST_LIMIT,
        shim_env::ENV_SWAP_LIMIT,
    ];
    let exact = [
        shim_env::ENV_OVERSUBSCRIBE,
        shim_env::ENV_REGION_PATH,
        shim_env::ENV_UTILIZATION_POLICY,
        shim_env::ENV_TASK_PRIORITY,
    ];
    exact.contains(&key)
        || bases.iter().any(|base| {
            key == *base
                || key
                    .strip_prefix(base)
                    .and_then(|rest| rest.strip_prefix('_'))
                    .is_some_and(|index| {
                        !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit())
                    })
        })
}

/// `LD_PRELOAD` with the shim first, keeping what the caller preloads.
fn preload_value(library: &Path) -> OsString {
    let mut value = library.as_os_str().to_owned();
    if let Some(existing) = std::env::var_os("LD_PRELOAD") {
        if places::preload_names(&existing, library) {
            return existing;
        }
        if !existing.is_empty() {
            value.push(":");
            value.push(existing);
        }
    }
    value
}

/// Starts the command and waits for it, passing on SIGTERM and SIGHUP.
/// SIGINT and SIGQUIT are caught and not passed on: a terminal sends them
/// to the command itself, and vgpu must outlive it to report its status.
fn wait(mut command: tokio::process::Command, program: &OsString) -> Result<i32, RunError> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RunError::Wait)?;
    let shown = program.to_string_lossy().into_owned();
    runtime.block_on(async move {
        let mut child = command
            .spawn()
            .map_err(|error| spawn_error(&shown, error))?;
        let mut term = signal(SignalKind::terminate()).map_err(RunError::Wait)?;
        let mut hangup = signal(SignalKind::hangup()).map_err(RunError::Wait)?;
        let mut interrupt = signal(SignalKind::interrupt()).map_err(RunError::Wait)?;
        let mut quit = signal(SignalKind::quit()).map_err(RunError::Wait)?;
        loop {
            tokio::select! {
                status = child.wait() => return status.map(exit_code).map_err(RunError::Wait),
                _ = term.recv() => forward(&child, libc::SIGTERM),
                _ = hangup.recv() => forward(&child, libc::SIGHUP),
                _ = interrupt.recv() => {},
                _ = quit.recv() => {},
            }
        }
    })
}

fn spawn_error(command: &str, error: std::io::Error) -> RunError {
    match error.kind() {
        std::io::ErrorKind::NotFound => RunError::NotFound {
            command: command.to_string(),
        },
        _ => RunError::NotExecutable {
            command: command.to_string(),
            source: error,
        },
    }
}

fn forward(child: &tokio::process::Child, signal: libc::c_int) {
    // `id` is None once the child has been reaped: nothing to signal then,
    // and its PID may already belong to another process.
    if let Some(pid) = child.id() {
        // SAFETY: kill has no memory-safety preconditions; `pid` is our
        // child, not yet reaped, so it names no other process.
        unsafe {
            libc::kill(pid as libc::pid_t, signal);
        }
    }
}

/// The status a shell would report: the exit code, or 128 + the signal.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => EXIT_SETUP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_shims_limit_variables_are_replaced() {
        for key in [
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT_3",
            "CUDA_DEVICE_SM_LIMIT_12",
            "VGPU_SWAP_LIMIT",
            "CUDA_OVERSUBSCRIBE",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
        ] {
            assert!(is_limit_variable(&key.into()), "{key}");
        }
        for key in [
            "CUDA_DEVICE_MEMORY_LIMITX",
            "CUDA_DEVICE_MEMORY_LIMIT_",
            "LIBCUDA_LOG_LEVEL",
            "VGPU_CONTEXT_RESERVE",
            "CUDA_VISIBLE_DEVICES",
            "PATH",
        ] {
            assert!(!is_limit_variable(&key.into()), "{key}");
        }
    }
}
