//! Whether the shim loads into a CUDA program and holds a cap.
//!
//! The parent runs `vgpu run --memory 1g --library <shim> -- vgpu
//! doctor-probe` (this same binary, as a user would, in a temporary region
//! root it removes), so the program gets exactly the environment and
//! preload `vgpu run` gives. The child ([`child`]) reaches the driver as
//! most programs do, by `dlopen("libcuda.so.1")` and `dlsym`, and prints
//! what it saw as `key=value` lines; the parent judges them.

use super::findings::{mib, Findings, Section};
use crate::places::{self, PlaceError};
use serde::Serialize;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use vgpu_cuda_abi::cuda::{
    CUcontext, CUdevice, CUdeviceptr, CUresult, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};

/// The cap the probe runs under, as given to `vgpu run` and in bytes.
const CAP_ARG: &str = "1g";
pub const CAP: u64 = 1 << 30;
/// The most the probe allocates under the cap.
const UNDER_CAP: u64 = 256 << 20;
/// How far past what is left of the cap the refused allocation asks.
const PAST: u64 = 1 << 20;
/// How long the probe may take (a first context on a GPU takes seconds).
const TIMEOUT: Duration = Duration::from_secs(90);
/// The hidden subcommand the child runs.
pub const SUBCOMMAND: &str = "doctor-probe";

/// What the probe found; absent figures were not reached.
#[derive(Debug, Default, Serialize)]
pub struct ProbeReport {
    /// The shim preloaded (found as `vgpu run` finds it).
    pub library: Option<String>,
    pub cap_bytes: u64,
    /// The CUDA program ran to its end and reported.
    pub ran: bool,
    /// The shim was mapped into the program.
    pub shim_loaded: Option<bool>,
    /// The step that failed, and how.
    pub failed_step: Option<String>,
    pub error: Option<String>,
    /// `cuMemGetInfo` in the program, under the cap.
    pub mem_total_bytes: Option<u64>,
    pub mem_free_bytes: Option<u64>,
    /// An allocation under the cap, and its CUresult.
    pub under_cap_bytes: Option<u64>,
    pub under_cap_result: Option<u32>,
    /// An allocation past what is left of the cap, and its CUresult.
    pub past_cap_bytes: Option<u64>,
    pub past_cap_result: Option<u32>,
    /// The total is the cap and the allocation past it was refused with
    /// CUDA_ERROR_OUT_OF_MEMORY.
    pub cap_held: bool,
}

const HINT_BUILD_SHIM: &str = "Build it beside vgpu with `cargo build --release -p vgpu-shim`, \
    name one with --library or $VGPU_LIBRARY, or install the chart (nodes get \
    /usr/local/vgpu/libvgpu.so).";

/// Runs the probe in a child, adding findings.
pub fn run(library: Option<&Path>, findings: &mut Findings) -> ProbeReport {
    let mut report = ProbeReport {
        cap_bytes: CAP,
        ..ProbeReport::default()
    };
    let library = match places::find_library(library) {
        Ok(path) => path,
        Err(error @ (PlaceError::NoLibrary { .. } | PlaceError::MissingLibrary(_))) => {
            findings.fail(
                Section::Shim,
                format!("the shim is missing: {error}"),
                HINT_BUILD_SHIM,
            );
            return report;
        }
        Err(error) => {
            findings.fail(Section::Shim, error.to_string(), HINT_BUILD_SHIM);
            return report;
        }
    };
    report.library = Some(library.display().to_string());
    findings.ok(Section::Shim, format!("shim {}", library.display()));
    eprintln!(
        "vgpu doctor: running a CUDA program under the shim with a {} MiB cap on GPU 0 ...",
        mib(CAP)
    );
    let output = match spawn(&library) {
        Ok(output) => output,
        Err(why) => {
            report.error = Some(why.clone());
            findings.fail(
                Section::Shim,
                format!("the probe did not run: {why}"),
                "See the message; `vgpu run --memory 1g -- nvidia-smi` runs the same way.",
            );
            return report;
        }
    };
    judge(&library, &output, &mut report, findings);
    report
}

/// The child's exit, its `key=value` lines and its stderr.
struct ChildOutput {
    status: std::process::ExitStatus,
    values: HashMap<String, String>,
    stderr: String,
    timed_out: bool,
}

/// A private directory, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), "could not remove the probe's directory: {error}");
        }
    }
}

fn spawn(library: &Path) -> Result<ChildOutput, String> {
    let vgpu = std::env::current_exe().map_err(|error| format!("finding vgpu itself: {error}"))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("vgpu-doctor-{}-{nanos}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|error| format!("{}: {error}", dir.display()))?;
    let scratch = Scratch(dir);
    let mut command = Command::new(&vgpu);
    command
        .arg("--root")
        .arg(scratch.0.join("regions"))
        .arg("run")
        .arg("--library")
        .arg(library)
        .args(["--name", "doctor", "--memory", CAP_ARG, "--"])
        .arg(&vgpu)
        .arg(SUBCOMMAND)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a probe that hangs is stopped with
        // the program `vgpu run` started.
        .process_group(0);
    let mut child = command
        .spawn()
        .map_err(|error| format!("starting {}: {error}", vgpu.display()))?;
    let group = child.id();
    let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
    let (sender, receiver) = std::sync::mpsc::channel();
    // Both pipes are read to their end on a thread of their own, so
    // neither fills while the other is read; the main thread only waits.
    std::thread::spawn(move || {
        let mut out = String::new();
        let mut err = String::new();
        let err_reader = std::thread::spawn(move || {
            if let Some(pipe) = stderr.as_mut() {
                let _ = pipe.read_to_string(&mut err);
            }
            err
        });
        if let Some(pipe) = stdout.as_mut() {
            let _ = pipe.read_to_string(&mut out);
        }
        let err = err_reader.join().unwrap_or_default();
        let status = child.wait();
        let _ = sender.send((status, out, err));
    });
    let (received, timed_out) = match receiver.recv_timeout(TIMEOUT) {
        Ok(received) => (received, false),
        Err(_) => {
            // SAFETY: kill(2) on the process group this call created; its
            // leader is our child, not yet reaped (the thread reaps it only
            // after its pipes close, which the kill brings about).
            unsafe { libc::kill(-(group as libc::pid_t), libc::SIGKILL) };
            let received = receiver
                .recv()
                .map_err(|_| "the probe's reader stopped".to_string())?;
            (received, true)
        }
    };
    let (status, out, err) = received;
    let status = status.map_err(|error| format!("waiting for the probe: {error}"))?;
    drop(scratch);
    Ok(ChildOutput {
        status,
        values: key_values(&out),
        stderr: err,
        timed_out,
    })
}

fn key_values(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|line| line.split_once('='))
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect()
}

/// Names of the CUDA results the probe reports.
fn result_name(result: u32) -> String {
    match result {
        0 => "CUDA_SUCCESS".into(),
        2 => "CUDA_ERROR_OUT_OF_MEMORY".into(),
        3 => "CUDA_ERROR_NOT_INITIALIZED".into(),
        100 => "CUDA_ERROR_NO_DEVICE".into(),
        101 => "CUDA_ERROR_INVALID_DEVICE".into(),
        999 => "CUDA_ERROR_UNKNOWN".into(),
        other => format!("CUresult {other}"),
    }
}

/// The last few non-empty lines of `text`, on one line.
fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
    if tail.is_empty() {
        "no message".into()
    } else {
        tail
    }
}

fn judge(library: &Path, output: &ChildOutput, report: &mut ProbeReport, findings: &mut Findings) {
    let values = &output.values;
    let number = |key: &str| values.get(key).and_then(|v| v.parse::<u64>().ok());
    let result = |key: &str| values.get(key).and_then(|v| v.parse::<u32>().ok());
    report.ran = values.contains_key("done");
    report.mem_total_bytes = number("mem_total");
    report.mem_free_bytes = number("mem_free");
    report.under_cap_bytes = number("under_bytes");
    report.under_cap_result = result("under_result");
    report.past_cap_bytes = number("past_bytes");
    report.past_cap_result = result("past_result");
    report.failed_step = values.get("failed").cloned();
    report.error = values.get("error").cloned();

    if output.timed_out {
        findings.fail(
            Section::Shim,
            format!(
                "the probe did not finish in {} s and was stopped",
                TIMEOUT.as_secs()
            ),
            "A CUDA call hung: is the GPU busy or wedged (`nvidia-smi`)? Try again, and \
             check `dmesg` for XID errors.",
        );
        return;
    }
    // Which of LD_PRELOAD's libraries the program had mapped.
    let wanted = std::fs::canonicalize(library).unwrap_or_else(|_| library.to_path_buf());
    let loaded = values.contains_key("preload").then(|| {
        values
            .get("mapped")
            .is_some_and(|mapped| mapped.split(':').any(|path| Path::new(path) == wanted))
    });
    report.shim_loaded = loaded;
    if !values.contains_key("preload") {
        // `vgpu run` itself failed, or the program died before its report.
        let status = output.status;
        let how = match (status.code(), status.signal()) {
            (_, Some(signal)) => format!("was killed by signal {signal}"),
            (Some(code), _) if code > 128 => format!("was killed by signal {}", code - 128),
            (Some(code), _) => format!("exited with status {code}"),
            (None, None) => "ended".to_string(),
        };
        findings.fail(
            Section::Shim,
            format!("the probe {how}: {}", last_lines(&output.stderr)),
            "`vgpu run` set it up; run `vgpu run --memory 1g -- true` to see the same \
             message, and see `vgpu run --help`.",
        );
        return;
    }
    if loaded == Some(false) {
        let refused = output
            .stderr
            .lines()
            .find(|line| line.contains("cannot be preloaded"))
            .map_or_else(String::new, |line| format!(": {}", line.trim()));
        findings.fail(
            Section::Shim,
            format!("the shim was not loaded into the program{refused}"),
            format!(
                "The dynamic loader skips a library it cannot open or load (another \
                 architecture, a newer glibc than this machine's); `LD_PRELOAD={} true` \
                 prints its reason.",
                library.display()
            ),
        );
    } else {
        findings.ok(
            Section::Shim,
            "the shim loaded into the CUDA program (LD_PRELOAD)",
        );
    }
    if let Some(step) = &report.failed_step {
        let error = report
            .error
            .clone()
            .or_else(|| result("result").map(|code| format!("{code} ({})", result_name(code))))
            .unwrap_or_else(|| "no reason given".into());
        let hint = match step.as_str() {
            "dlopen libcuda.so.1" => {
                "The CUDA driver library must load in a program: install NVIDIA's driver, or \
                 add the directory of its libcuda.so.1 to LD_LIBRARY_PATH (the message says \
                 whether it was not found or did not load); in a container, NVIDIA's \
                 container toolkit mounts it."
            }
            "cuInit" => {
                "The driver does not start: `nvidia-smi` should list the GPUs; \
                 CUDA_ERROR_NO_DEVICE (100) means none is visible (CUDA_VISIBLE_DEVICES, \
                 /dev/nvidia* in a container); the driver and its libcuda.so.1 must be of \
                 one version."
            }
            _ => {
                "Check `nvidia-smi` (is GPU 0 in exclusive-process mode and in use, or \
                 out of memory?) and `dmesg` for XID errors."
            }
        };
        findings.fail(
            Section::Shim,
            format!("the CUDA program failed at {step}: {error}"),
            hint,
        );
        return;
    }
    findings.ok(
        Section::Shim,
        "libcuda.so.1 loaded; cuInit and a context on GPU 0 succeeded",
    );
    let total = report.mem_total_bytes.unwrap_or(0);
    let total_is_cap = total == CAP;
    if total_is_cap {
        findings.ok(
            Section::Shim,
            format!(
                "cuMemGetInfo: total {} MiB (the cap), free {} MiB",
                mib(total),
                mib(report.mem_free_bytes.unwrap_or(0))
            ),
        );
    } else {
        findings.fail(
            Section::Shim,
            format!(
                "cuMemGetInfo: total {} MiB, not the {} MiB cap: the shim does not hold the cap",
                mib(total),
                mib(CAP)
            ),
            "The shim loaded but did not apply the limit: check that nothing else in \
             LD_PRELOAD or /etc/ld.so.preload wraps the driver before it, and that the \
             shim's CUDA_DEVICE_MEMORY_LIMIT reaches the program (`vgpu run -- env`).",
        );
    }
    match (report.under_cap_bytes, report.under_cap_result) {
        (Some(bytes), Some(CUDA_SUCCESS)) => {
            findings.ok(
                Section::Shim,
                format!("{} MiB allocated under the cap", mib(bytes)),
            );
        }
        (bytes, code) => {
            findings.fail(
                Section::Shim,
                format!(
                    "an allocation of {} MiB under the cap failed: {}",
                    mib(bytes.unwrap_or(0)),
                    code.map_or_else(|| "not tried".into(), result_name)
                ),
                "Memory within the cap must be allocatable: is GPU 0's memory taken by \
                 other programs (`nvidia-smi`)?",
            );
        }
    }
    let past = report.past_cap_bytes.unwrap_or(0);
    match report.past_cap_result {
        Some(CUDA_ERROR_OUT_OF_MEMORY) => {
            findings.ok(
                Section::Shim,
                format!(
                    "{} MiB ({} MiB more than is left of the cap) refused with \
                     CUDA_ERROR_OUT_OF_MEMORY",
                    mib(past),
                    mib(PAST)
                ),
            );
            report.cap_held = total_is_cap;
        }
        Some(CUDA_SUCCESS) => {
            findings.fail(
                Section::Shim,
                format!(
                    "{} MiB past the cap were allocated: the cap did not hold",
                    mib(past)
                ),
                "The shim must refuse it; report this with `vgpu doctor --json`'s output.",
            );
        }
        code => {
            findings.fail(
                Section::Shim,
                format!(
                    "an allocation past the cap failed with {}, not CUDA_ERROR_OUT_OF_MEMORY",
                    code.map_or_else(|| "no result".into(), result_name)
                ),
                "Programs expect CUDA_ERROR_OUT_OF_MEMORY when memory runs out; check \
                 `dmesg` and `nvidia-smi`.",
            );
        }
    }
}

// The child: a CUDA program under the shim.

type CuInit = unsafe extern "C" fn(c_uint) -> CUresult;
type CuDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
type CuCtxCreate = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
type CuCtxDestroy = unsafe extern "C" fn(CUcontext) -> CUresult;
type CuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
type CuMemAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type CuMemFree = unsafe extern "C" fn(CUdeviceptr) -> CUresult;

/// The driver's functions the probe calls.
struct Driver {
    init: CuInit,
    device_get: CuDeviceGet,
    ctx_create: CuCtxCreate,
    ctx_destroy: CuCtxDestroy,
    mem_get_info: CuMemGetInfo,
    mem_alloc: CuMemAlloc,
    mem_free: CuMemFree,
}

/// The message of the last failed dl call.
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message that stays
    // valid until the next dl call of this thread; it is copied at once.
    unsafe {
        let text = libc::dlerror();
        if text.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

/// `name` in `handle`, or why not.
fn symbol(handle: *mut c_void, name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: `handle` is a live handle from dlopen; `name` is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        Err(format!("{}: {}", name.to_string_lossy(), dl_error()))
    } else {
        Ok(address)
    }
}

impl Driver {
    /// Loads libcuda.so.1 (kept loaded: the process ends soon after).
    fn load() -> Result<Self, (String, String)> {
        // SAFETY: the name is a NUL-terminated literal; loading runs the
        // driver library's initialisers, as any CUDA program does.
        let handle =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(("dlopen libcuda.so.1".into(), dl_error()));
        }
        let resolve = |name: &CStr| symbol(handle, name).map_err(|e| ("dlsym".to_string(), e));
        // SAFETY: each address is the driver's function of that name (or
        // the shim's hook of it), whose C signature in cuda.h is the
        // function pointer type the transmute turns it into.
        unsafe {
            Ok(Self {
                init: std::mem::transmute::<*mut c_void, CuInit>(resolve(c"cuInit")?),
                device_get: std::mem::transmute::<*mut c_void, CuDeviceGet>(resolve(
                    c"cuDeviceGet",
                )?),
                ctx_create: std::mem::transmute::<*mut c_void, CuCtxCreate>(resolve(
                    c"cuCtxCreate_v2",
                )?),
                ctx_destroy: std::mem::transmute::<*mut c_void, CuCtxDestroy>(resolve(
                    c"cuCtxDestroy_v2",
                )?),
                mem_get_info: std::mem::transmute::<*mut c_void, CuMemGetInfo>(resolve(
                    c"cuMemGetInfo_v2",
                )?),
                mem_alloc: std::mem::transmute::<*mut c_void, CuMemAlloc>(resolve(
                    c"cuMemAlloc_v2",
                )?),
                mem_free: std::mem::transmute::<*mut c_void, CuMemFree>(resolve(c"cuMemFree_v2")?),
            })
        }
    }
}

/// The files of this process's memory map.
fn mapped_files() -> Vec<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<PathBuf> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .map(PathBuf::from)
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The probe program: writes `key=value` lines to `out`; status 0 when it
/// could report (what it found is the parent's to judge).
pub fn child(out: &mut impl Write) -> std::io::Result<()> {
    let preload = std::env::var("LD_PRELOAD").unwrap_or_default();
    let mapped = mapped_files();
    // LD_PRELOAD's libraries, resolved as the loader maps them, that are
    // in this process.
    let loaded: Vec<String> = preload
        .split([':', ' '])
        .filter(|item| !item.is_empty())
        .filter_map(|item| std::fs::canonicalize(item).ok())
        .filter(|path| mapped.contains(path))
        .map(|path| path.display().to_string())
        .collect();
    writeln!(out, "preload={preload}")?;
    writeln!(out, "mapped={}", loaded.join(":"))?;
    let driver = match Driver::load() {
        Ok(driver) => driver,
        Err((step, error)) => {
            writeln!(out, "failed={step}")?;
            writeln!(out, "error={}", error.replace('\n', " "))?;
            return writeln!(out, "done=1");
        }
    };
    // SAFETY: the driver's own entry point, as cuda.h declares it.
    let result = unsafe { (driver.init)(0) };
    if result != CUDA_SUCCESS {
        writeln!(out, "failed=cuInit\nresult={result}")?;
        return writeln!(out, "done=1");
    }
    let mut device: CUdevice = 0;
    // SAFETY: out-pointer to a live local.
    let result = unsafe { (driver.device_get)(&mut device, 0) };
    if result != CUDA_SUCCESS {
        writeln!(out, "failed=cuDeviceGet(0)\nresult={result}")?;
        return writeln!(out, "done=1");
    }
    let mut context: CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a live local; flags 0; a device from cuDeviceGet.
    let result = unsafe { (driver.ctx_create)(&mut context, 0, device) };
    if result != CUDA_SUCCESS {
        writeln!(out, "failed=cuCtxCreate\nresult={result}")?;
        return writeln!(out, "done=1");
    }
    let memory_info = || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to live locals; the context is current.
        let result = unsafe { (driver.mem_get_info)(&mut free, &mut total) };
        (result, free as u64, total as u64)
    };
    let (result, free, total) = memory_info();
    if result != CUDA_SUCCESS {
        writeln!(out, "failed=cuMemGetInfo\nresult={result}")?;
        return writeln!(out, "done=1");
    }
    writeln!(out, "mem_total={total}\nmem_free={free}")?;
    let allocate = |bytes: u64| {
        let mut pointer: CUdeviceptr = 0;
        let size = usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: out-pointer to a live local; the context is current.
        let result = unsafe { (driver.mem_alloc)(&mut pointer, size) };
        (result, pointer)
    };
    // Half of what is free, at most UNDER_CAP, in whole MiB.
    let under = (free / 2).min(UNDER_CAP) >> 20 << 20;
    let (under_result, under_pointer) = allocate(under.max(1 << 20));
    writeln!(
        out,
        "under_bytes={}\nunder_result={under_result}",
        under.max(1 << 20)
    )?;
    let (_, free_after, _) = memory_info();
    writeln!(out, "free_after={free_after}")?;
    let past = free_after + PAST;
    let (past_result, past_pointer) = allocate(past);
    writeln!(out, "past_bytes={past}\npast_result={past_result}")?;
    // SAFETY: each pointer was allocated above in the current context and
    // is freed once; the context was created above and is destroyed last.
    unsafe {
        if past_result == CUDA_SUCCESS {
            (driver.mem_free)(past_pointer);
        }
        if under_result == CUDA_SUCCESS {
            (driver.mem_free)(under_pointer);
        }
        (driver.ctx_destroy)(context);
    }
    writeln!(out, "done=1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_named_and_lines_parsed() {
        assert_eq!(result_name(2), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(result_name(46), "CUresult 46");
        let values = key_values("preload=/x/libvgpu.so\nmapped=\nmem_total=1073741824\nnoise\n");
        assert_eq!(values["mem_total"], "1073741824");
        assert_eq!(values["mapped"], "");
        assert!(!values.contains_key("noise"));
        assert_eq!(last_lines("a\n\nb\nc\nd\n"), "b / c / d");
        assert_eq!(last_lines(""), "no message");
    }
}
