//! `vgpu demo`: a memory cap and a compute share holding, shown by running
//! two small CUDA programs without and with `vgpu run` (this same binary,
//! as a user would run it), on this machine's NVIDIA GPU when its driver is
//! there and on the simulated GPU otherwise.
//!
//! The programs are the test programs' `probe`, `workload` and `simtool`,
//! built with vgpu (`build.rs`); the simulated GPU, `libsimgpu.so`, and the
//! shim are found next to the `vgpu` binary, as in a cargo target
//! directory. Everything the demo makes (regions, the simulated GPU's state)
//! is in a private temporary directory, removed when it ends.

use crate::args::DemoArgs;
use crate::places::{self, PlaceError};
use std::ffi::{CStr, OsString};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use thiserror::Error;
use vgpu_node_agent::driver_libraries::DRIVER_LIBRARIES;

/// The cap the memory part runs under, as given to `vgpu run` and in bytes.
const CAP_ARG: &str = "4g";
const CAP: u64 = 4 << 30;
/// The share the compute part runs under, in percent.
const SHARE: u32 = 30;
/// The size of each buffer the memory part allocates.
const CHUNK: u64 = 256 << 20;
/// The simulated GPU's one device.
const SIMULATED_MEMORY: &str = "16Gi";
/// `workload`'s kernel and how long each takes, on either GPU.
const KERNEL: &str = "k1ms";
const KERNEL_TIME: Duration = Duration::from_millis(1);
/// How long a share is measured, after the first second under the share
/// (in which it settles).
const MEASURED: Duration = Duration::from_secs(3);
const SETTLE: Duration = Duration::from_secs(1);
/// CUDA_ERROR_OUT_OF_MEMORY.
const OUT_OF_MEMORY: &str = "2";
/// The simulated GPU, linked under the names of NVIDIA's driver libraries
/// ([`DRIVER_LIBRARIES`]).
const SIMULATED_LIBRARY: &str = "libsimgpu.so";

#[derive(Debug, Error)]
pub enum DemoError {
    #[error("{what} is missing ({path}): {how}")]
    Missing {
        what: String,
        path: PathBuf,
        how: String,
    },
    #[error(transparent)]
    Place(#[from] PlaceError),
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Child {
        step: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{step} failed ({status}): {stderr}")]
    Failed {
        step: String,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{step}: {what} in its output: {output:?}")]
    Output {
        step: String,
        what: String,
        output: String,
    },
    #[error("the memory cap did not hold: {0}")]
    CapBroken(String),
    #[error("writing the output: {0}")]
    Write(#[from] std::io::Error),
}

/// Runs the demo, writing what it shows to `out`.
pub fn run(args: &DemoArgs, out: &mut impl Write) -> Result<(), DemoError> {
    let vgpu = std::env::current_exe().map_err(|source| DemoError::Io {
        path: PathBuf::from("/proc/self/exe"),
        op: "find the vgpu binary",
        source,
    })?;
    let beside = vgpu.parent().map(Path::to_path_buf).unwrap_or_default();
    let library = match places::find_library(args.library.as_deref()) {
        Err(PlaceError::NoLibrary { looked }) => {
            return Err(DemoError::Missing {
                what: "the shim, libvgpu.so,".into(),
                path: PathBuf::from(looked),
                how: "build it beside vgpu with `cargo build --release -p vgpu-shim`, or name one with --library".into(),
            })
        }
        found => found?,
    };
    let gpu = if args.simulated {
        Gpu::Simulated {
            why: "--simulated was given".into(),
        }
    } else {
        match nvidia_driver() {
            Ok(()) => Gpu::Real,
            Err(why) => Gpu::Simulated { why },
        }
    };
    let programs = PathBuf::from(env!("VGPU_DEMO_PROGRAMS"));
    let mut needed = vec!["probe", "workload"];
    if matches!(gpu, Gpu::Simulated { .. }) {
        needed.push("simtool");
    }
    for name in needed {
        let path = programs.join(name);
        if !path.is_file() {
            return Err(DemoError::Missing {
                what: format!("the demo program {name}"),
                path,
                how: "it is built with vgpu, from testkit/programs, by \
                      `cargo build --release -p vgpu-cli`, which needs a C compiler (cc)"
                    .into(),
            });
        }
    }
    let demo = Demo::new(vgpu, library, programs, &beside, &gpu)?;
    demo.show(&gpu, out)
}

/// The GPU the demo runs on.
enum Gpu {
    Real,
    /// No driver (why not, for the user).
    Simulated {
        why: String,
    },
}

/// Whether NVIDIA's driver is here: its control device and a
/// `libcuda.so.1` that loads. Err says what is missing.
fn nvidia_driver() -> Result<(), String> {
    const CONTROL_DEVICE: &str = "/dev/nvidiactl";
    if !Path::new(CONTROL_DEVICE).exists() {
        return Err(format!(
            "no NVIDIA driver here ({CONTROL_DEVICE} is missing)"
        ));
    }
    // SAFETY: the name is a NUL-terminated string literal. Loading runs
    // the driver library's initialisers, as any CUDA program does; nothing
    // from it is called.
    let handle =
        unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated message that
        // stays valid until the next dl call of this thread.
        let message = unsafe {
            let text = libc::dlerror();
            if text.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(text).to_string_lossy().into_owned()
            }
        };
        return Err(format!(
            "{CONTROL_DEVICE} is here but libcuda.so.1 does not load ({message})"
        ));
    }
    // SAFETY: `handle` is the live handle dlopen returned above; nothing
    // of the library is in use.
    unsafe { libc::dlclose(handle) };
    Ok(())
}

/// The demo's programs, its environment, and its private directory.
struct Demo {
    vgpu: PathBuf,
    library: PathBuf,
    programs: PathBuf,
    dir: PathBuf,
    /// Set for every program.
    env: Vec<(OsString, OsString)>,
    /// Removed for every program.
    unset: Vec<OsString>,
}

impl Demo {
    fn new(
        vgpu: PathBuf,
        library: PathBuf,
        programs: PathBuf,
        beside: &Path,
        gpu: &Gpu,
    ) -> Result<Self, DemoError> {
        let io = |path: &Path, op| {
            let path = path.to_path_buf();
            move |source| DemoError::Io { path, op, source }
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("vgpu-demo-{}-{nanos}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(io(&dir, "create the demo's directory"))?;
        // From here on, dropping `demo` removes the directory.
        let mut demo = Self {
            vgpu,
            library,
            programs,
            dir,
            env: Vec::new(),
            // A program "without vgpu" must really be without the shim.
            unset: vec!["LD_PRELOAD".into()],
        };
        if let Gpu::Simulated { .. } = gpu {
            let simulated = beside.join(SIMULATED_LIBRARY);
            if !simulated.is_file() {
                return Err(DemoError::Missing {
                    what: "the simulated GPU, libsimgpu.so,".into(),
                    path: simulated,
                    how: "build it beside vgpu with `cargo build --release -p simgpu` \
                          (without --release for a debug build of vgpu)"
                        .into(),
                });
            }
            let lib_dir = demo.dir.join("lib");
            std::fs::create_dir(&lib_dir).map_err(io(&lib_dir, "create directory"))?;
            for name in DRIVER_LIBRARIES {
                let alias = lib_dir.join(name);
                std::os::unix::fs::symlink(&simulated, &alias).map_err(io(&alias, "symlink"))?;
            }
            // Only this demo's simulated device, whatever the caller's
            // environment says.
            demo.unset.extend(
                std::env::vars_os()
                    .map(|(key, _)| key)
                    .filter(|key| key.to_string_lossy().starts_with("SIMGPU_")),
            );
            demo.unset.push("CUDA_VISIBLE_DEVICES".into());
            let state = demo.dir.join("simgpu.state");
            demo.env = vec![
                ("SIMGPU_DEVICES".into(), "1".into()),
                ("SIMGPU_MEMORY".into(), SIMULATED_MEMORY.into()),
                ("SIMGPU_STATE".into(), state.into_os_string()),
                ("LD_LIBRARY_PATH".into(), lib_dir.into_os_string()),
            ];
        }
        Ok(demo)
    }

    fn environment(&self, command: &mut Command) {
        for key in &self.unset {
            command.env_remove(key);
        }
        command.envs(self.env.iter().map(|(key, value)| (key, value)));
    }

    /// `PROGRAM ARGS...` as it is, without vgpu.
    fn without_vgpu(&self, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new(self.programs.join(program));
        command.args(args);
        self.environment(&mut command);
        command
    }

    /// `vgpu run RUN_ARGS... -- PROGRAM ARGS...`, in the demo's own root.
    fn under_vgpu(&self, run_args: &[&str], program: &str, args: &[&str]) -> Command {
        let mut command = Command::new(&self.vgpu);
        command
            .arg("--root")
            .arg(self.dir.join("regions"))
            .arg("run")
            .arg("--library")
            .arg(&self.library)
            .args(run_args)
            .arg("--")
            .arg(self.programs.join(program))
            .args(args);
        self.environment(&mut command);
        command
    }

    /// Runs `command` to its end; its `key=value` lines.
    fn values(&self, step: &str, command: &mut Command) -> Result<Values, DemoError> {
        let output = command
            .stdin(Stdio::null())
            .output()
            .map_err(|source| DemoError::Child {
                step: step.into(),
                source,
            })?;
        if !output.status.success() {
            return Err(DemoError::Failed {
                step: step.into(),
                status: output.status,
                stderr: last_lines(&String::from_utf8_lossy(&output.stderr)),
            });
        }
        Ok(Values {
            step: step.into(),
            text: String::from_utf8_lossy(&output.stdout).into_owned(),
        })
    }

    /// Starts `command` (a workload) and waits for its `ready` line.
    fn start(&self, step: &str, command: &mut Command) -> Result<Running, DemoError> {
        let child_error = |source| DemoError::Child {
            step: step.into(),
            source,
        };
        // To a file, not a pipe: nothing reads it while the workload runs.
        let stderr_path = self.dir.join(format!("{}.stderr", step.replace(' ', "-")));
        let stderr = std::fs::File::create(&stderr_path).map_err(child_error)?;
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(child_error)?;
        let stdout = child.stdout.take().map(BufReader::new);
        let mut running = Running {
            step: step.into(),
            child,
            stdout,
            stderr_path,
        };
        match running.line()? {
            Some((line, _)) if line == "ready" => Ok(running),
            _ => Err(running.failure()),
        }
    }

    fn show(&self, gpu: &Gpu, out: &mut impl Write) -> Result<(), DemoError> {
        let simulated = match gpu {
            Gpu::Real => {
                writeln!(
                    out,
                    "vgpu demo: NVIDIA's driver is here (/dev/nvidiactl, libcuda.so.1), \
                     so this runs on GPU 0 of this machine."
                )?;
                false
            }
            Gpu::Simulated { why } => {
                writeln!(
                    out,
                    "vgpu demo: {why}, so this runs on the simulated GPU:\n\
                     {SIMULATED_LIBRARY} as libcuda.so.1 and libnvidia-ml.so.1, one device of {} MiB.",
                    mib(simulated_memory())
                )?;
                true
            }
        };
        let memory = self.memory(simulated, out)?;
        let compute = if simulated {
            self.compute_simulated(out)?
        } else {
            self.compute_real(out)?
        };
        writeln!(out)?;
        writeln!(
            out,
            "The {} MiB cap held: {} MiB allocated, then refused{}.",
            mib(CAP),
            mib(memory.allocated_under_cap),
            memory.uncapped.map_or_else(String::new, |uncapped| format!(
                ", on a device where {} MiB could be allocated without vgpu",
                mib(uncapped)
            ))
        )?;
        writeln!(
            out,
            "The {SHARE} % share measured {:.1} % of the device's time ({:.1} % without vgpu).",
            compute.capped, compute.alone
        )?;
        Ok(())
    }

    /// Allocates 256 MiB buffers until refused, without vgpu and under a
    /// cap, then reads NVML under the cap. On a real GPU, the device is
    /// not filled without vgpu (other programs may be using it): NVML's
    /// figures are shown instead.
    fn memory(&self, simulated: bool, out: &mut impl Write) -> Result<MemoryResult, DemoError> {
        let chunk = CHUNK.to_string();
        let fill = ["procaddr", "fill", chunk.as_str()];
        let under_cap = format!("vgpu run --memory {CAP_ARG}");
        writeln!(
            out,
            "\nMemory: a program allocates {} MiB buffers until it is refused.",
            mib(CHUNK)
        )?;
        let uncapped = if simulated {
            let alone =
                self.values("probe without vgpu", &mut self.without_vgpu("probe", &fill))?;
            let allocated = alone.bytes("allocated")?;
            writeln!(
                out,
                "  {:<34} allocated {} MiB before the device ran out; cuMemGetInfo total {} MiB",
                "without vgpu:",
                mib(allocated),
                mib(alone.bytes("mem_total")?)
            )?;
            Some(allocated)
        } else {
            let nvml = self.values(
                "NVML without vgpu",
                &mut self.without_vgpu("probe", &["dlsym", "nvml"]),
            )?;
            writeln!(
                out,
                "  {:<34} NVML: {} MiB in all, {} MiB in use (not filled: other programs may use this GPU)",
                "without vgpu:",
                mib(nvml.bytes("nvml_total")?),
                mib(nvml.bytes("nvml_used")?)
            )?;
            None
        };

        let cap_args = ["--name", "demo-memory", "--memory", CAP_ARG];
        let capped = self.values(
            &format!("probe under {under_cap}"),
            &mut self.under_vgpu(&cap_args, "probe", &fill),
        )?;
        let allocated = capped.bytes("allocated")?;
        let total = capped.bytes("mem_total")?;
        let free = capped.bytes("mem_free")?;
        let refusal = capped.text("refusal")?;
        let refused_as = if refusal == OUT_OF_MEMORY {
            "CUDA_ERROR_OUT_OF_MEMORY".to_string()
        } else {
            format!("error {refusal}")
        };
        writeln!(
            out,
            "  {:<34} allocated {} MiB, then {refused_as}; cuMemGetInfo total {} MiB, free {} MiB",
            format!("under {under_cap}:"),
            mib(allocated),
            mib(total),
            mib(free)
        )?;
        // What cuMemGetInfo counts as used beyond the buffers is what the
        // shim charged for the program's CUDA context.
        let context = total.saturating_sub(free).saturating_sub(allocated);
        let left = if free > 0 {
            format!(" + {} MiB free, less than a buffer", mib(free))
        } else {
            String::new()
        };
        writeln!(
            out,
            "  {:<34} (the {} MiB cap = {} MiB of buffers + {} MiB charged for the CUDA context{left})",
            "",
            mib(total),
            mib(allocated),
            mib(context)
        )?;
        let nvml = self.values(
            &format!("NVML under {under_cap}"),
            &mut self.under_vgpu(&cap_args, "probe", &["dlsym", "nvml"]),
        )?;
        writeln!(
            out,
            "  {:<34} total {} MiB, used {} MiB (no process holds memory now)",
            format!("NVML under {under_cap}:"),
            mib(nvml.bytes("nvml_total")?),
            mib(nvml.bytes("nvml_used")?)
        )?;

        let held = allocated <= CAP && total == CAP && refusal == OUT_OF_MEMORY;
        if !held {
            return Err(DemoError::CapBroken(format!(
                "under --memory {CAP_ARG} the program allocated {} MiB, was told of {} MiB and was refused with {refused_as}",
                mib(allocated),
                mib(total)
            )));
        }
        Ok(MemoryResult {
            allocated_under_cap: allocated,
            uncapped,
        })
    }

    /// The compute part on the simulated GPU: its own record of the
    /// device's busy time, read outside the shim.
    fn compute_simulated(&self, out: &mut impl Write) -> Result<ComputeResult, DemoError> {
        writeln!(
            out,
            "\nCompute: a program launches {} ms kernels flat out; the simulated GPU's own record \
             of its busy time, over {} s.",
            KERNEL_TIME.as_millis(),
            MEASURED.as_secs()
        )?;
        let mut meter = Meter::start(self)?;
        let seconds = |window: Duration| format!("{:.1}", window.as_secs_f64() + 0.5);
        let alone_args = ["burst", KERNEL, &seconds(MEASURED), "1"];
        let running = self.start(
            "workload without vgpu",
            &mut self.without_vgpu("workload", &alone_args),
        )?;
        let from = meter.read()?;
        std::thread::sleep(MEASURED);
        let alone = busy_share(from, meter.read()?);
        running.finish()?;
        writeln!(
            out,
            "  {:<34} {alone:.1} % of the device's time",
            "without vgpu:"
        )?;

        let share = SHARE.to_string();
        let capped_args = ["burst", KERNEL, &seconds(SETTLE + MEASURED), "1"];
        let under_share = format!("vgpu run --cores {SHARE}");
        let running = self.start(
            &format!("workload under {under_share}"),
            &mut self.under_vgpu(
                &["--name", "demo-compute", "--cores", &share],
                "workload",
                &capped_args,
            ),
        )?;
        let start = meter.read()?;
        std::thread::sleep(SETTLE);
        let settled = meter.read()?;
        std::thread::sleep(MEASURED);
        let capped = busy_share(settled, meter.read()?);
        running.finish()?;
        writeln!(
            out,
            "  {:<34} {capped:.1} % of the device's time ({:.1} % in its first second)",
            format!("under {under_share}:"),
            busy_share(start, settled)
        )?;
        Ok(ComputeResult { alone, capped })
    }

    /// The compute part on a real GPU: the kernels completed times their
    /// duration (they spin on the GPU's clock) over the time they took.
    fn compute_real(&self, out: &mut impl Write) -> Result<ComputeResult, DemoError> {
        writeln!(
            out,
            "\nCompute: a program launches {} ms kernels flat out; kernels completed x {} ms \
             over the time they took.",
            KERNEL_TIME.as_millis(),
            KERNEL_TIME.as_millis()
        )?;
        let seconds = format!("{:.1}", MEASURED.as_secs_f64());
        let args = ["burst", KERNEL, seconds.as_str(), "1"];
        let alone = self
            .start(
                "workload without vgpu",
                &mut self.without_vgpu("workload", &args),
            )?
            .kernel_share()?;
        writeln!(
            out,
            "  {:<34} {alone:.1} % of the device's time over {} s",
            "without vgpu:",
            MEASURED.as_secs()
        )?;
        let share = SHARE.to_string();
        let under_share = format!("vgpu run --cores {SHARE}");
        let capped = self
            .start(
                &format!("workload under {under_share}"),
                &mut self.under_vgpu(
                    &["--name", "demo-compute", "--cores", &share],
                    "workload",
                    &args,
                ),
            )?
            .kernel_share()?;
        writeln!(
            out,
            "  {:<34} {capped:.1} % of the device's time over {} s",
            format!("under {under_share}:"),
            MEASURED.as_secs()
        )?;
        Ok(ComputeResult { alone, capped })
    }
}

/// What the memory part found.
struct MemoryResult {
    allocated_under_cap: u64,
    /// What could be allocated without vgpu (the simulated GPU only).
    uncapped: Option<u64>,
}

/// Shares of the device's time, in percent.
struct ComputeResult {
    alone: f64,
    capped: f64,
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), "could not remove the demo's directory: {error}");
        }
    }
}

/// A program's `key=value` output lines.
struct Values {
    step: String,
    text: String,
}

impl Values {
    fn text(&self, key: &str) -> Result<&str, DemoError> {
        self.text
            .lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .ok_or_else(|| DemoError::Output {
                step: self.step.clone(),
                what: format!("no {key}"),
                output: self.text.clone(),
            })
    }

    fn bytes(&self, key: &str) -> Result<u64, DemoError> {
        let text = self.text(key)?;
        text.parse().map_err(|_| DemoError::Output {
            step: self.step.clone(),
            what: format!("{key}={text} is not a number"),
            output: self.text.clone(),
        })
    }
}

/// A workload that has said `ready`.
struct Running {
    step: String,
    child: Child,
    stdout: Option<BufReader<ChildStdout>>,
    stderr_path: PathBuf,
}

impl Running {
    /// The next line of its output and when it came; `None` at its end.
    fn line(&mut self) -> Result<Option<(String, Instant)>, DemoError> {
        let Some(stdout) = self.stdout.as_mut() else {
            return Ok(None);
        };
        let mut line = String::new();
        let read = stdout
            .read_line(&mut line)
            .map_err(|source| DemoError::Child {
                step: self.step.clone(),
                source,
            })?;
        Ok((read > 0).then(|| (line.trim_end().to_string(), Instant::now())))
    }

    /// Why it failed: its status and the end of its stderr.
    fn failure(mut self) -> DemoError {
        drop(self.stdout.take());
        match self.child.wait() {
            Ok(status) => DemoError::Failed {
                step: self.step.clone(),
                status,
                stderr: last_lines(&std::fs::read_to_string(&self.stderr_path).unwrap_or_default()),
            },
            Err(source) => DemoError::Child {
                step: self.step.clone(),
                source,
            },
        }
    }

    /// Waits for it to end, successfully.
    fn finish(mut self) -> Result<(), DemoError> {
        while self.line()?.is_some() {}
        self.succeeded()
    }

    fn succeeded(mut self) -> Result<(), DemoError> {
        let status = self.child.wait().map_err(|source| DemoError::Child {
            step: self.step.clone(),
            source,
        })?;
        if status.success() {
            Ok(())
        } else {
            Err(self.failure())
        }
    }

    /// Waits for its `launches=N` line: the share of the device's time its
    /// kernels took, N kernels of [`KERNEL_TIME`] since it said `ready`.
    fn kernel_share(mut self) -> Result<f64, DemoError> {
        let ready = Instant::now();
        let mut counted = None;
        while let Some((line, at)) = self.line()? {
            if let Some(launches) = line.strip_prefix("launches=") {
                counted = launches.parse::<u64>().ok().map(|n| (n, at));
            }
        }
        let step = self.step.clone();
        self.succeeded()?;
        let (launches, at) = counted.ok_or_else(|| DemoError::Output {
            step,
            what: "no launches=N".into(),
            output: String::new(),
        })?;
        let busy = KERNEL_TIME.as_secs_f64() * launches as f64;
        let elapsed = at.saturating_duration_since(ready).as_secs_f64().max(1e-9);
        Ok((busy * 100.0 / elapsed).min(100.0))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Left running only when the demo failed: do not leave it behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The simulated GPU's record of device time, read outside the shim by
/// `simtool` (one line in, one line out).
struct Meter {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

/// A reading: the monotonic clock and device 0's busy time, nanoseconds.
#[derive(Clone, Copy)]
struct Busy {
    at_ns: u64,
    busy_ns: u64,
}

impl Meter {
    fn start(demo: &Demo) -> Result<Self, DemoError> {
        let step = "simtool (the simulated GPU's record)";
        let mut child = demo
            .without_vgpu("simtool", &[])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| DemoError::Child {
                step: step.into(),
                source,
            })?;
        match (child.stdin.take(), child.stdout.take()) {
            (Some(input), Some(output)) => Ok(Self {
                child,
                input,
                output: BufReader::new(output),
            }),
            _ => Err(DemoError::Output {
                step: step.into(),
                what: "no pipes".into(),
                output: String::new(),
            }),
        }
    }

    /// Device 0 as a whole (process 0): the demo's simulated GPU runs
    /// nothing else.
    fn read(&mut self) -> Result<Busy, DemoError> {
        let step = "simtool (the simulated GPU's record)";
        let io = |source| DemoError::Child {
            step: step.into(),
            source,
        };
        writeln!(self.input, "0 0").map_err(io)?;
        self.input.flush().map_err(io)?;
        let mut line = String::new();
        self.output.read_line(&mut line).map_err(io)?;
        let numbers: Vec<u64> = line
            .split_whitespace()
            .filter_map(|number| number.parse().ok())
            .collect();
        match numbers[..] {
            [at_ns, _process_ns, busy_ns] => Ok(Busy { at_ns, busy_ns }),
            _ => Err(DemoError::Output {
                step: step.into(),
                what: "not three numbers".into(),
                output: line,
            }),
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent of the time between two readings that the device was busy.
fn busy_share(from: Busy, to: Busy) -> f64 {
    let elapsed = to.at_ns.saturating_sub(from.at_ns).max(1) as f64;
    to.busy_ns.saturating_sub(from.busy_ns) as f64 * 100.0 / elapsed
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

fn simulated_memory() -> u64 {
    vgpu_node_contract::size::parse_size(SIMULATED_MEMORY).unwrap_or(0)
}

/// The last few lines of a program's stderr, on one line.
fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .collect();
    let tail = &lines[lines.len().saturating_sub(3)..];
    if tail.is_empty() {
        "no message".to_string()
    } else {
        tail.join(" / ")
    }
}
