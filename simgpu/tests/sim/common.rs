//! Test plumbing: loading the built `libsimgpu.so`, typed entry points, and
//! running scenarios in child processes (the simulation reads its
//! environment once per process, so every configuration gets a process).

#![allow(non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vgpu_cuda_abi::cuda::*;
use vgpu_cuda_abi::nvml::*;

/// Environment variable naming the scenario a child process runs.
pub const SCENARIO_VAR: &str = "SIMGPU_TEST_SCENARIO";

/// Path of the built library. `cargo test -p simgpu` builds the cdylib as a
/// dependency of this test into `target/<profile>/deps/` (it is uplifted to
/// `target/<profile>/` only by `cargo build`), so that copy is always fresh.
pub fn lib_path() -> PathBuf {
    if let Ok(p) = std::env::var("SIMGPU_TEST_LIB") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe
        .parent()
        .expect("test executable lives in target/<profile>/deps");
    let candidates = [
        deps.join("libsimgpu.so"),
        deps.parent()
            .map(|p| p.join("libsimgpu.so"))
            .unwrap_or_default(),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| panic!("libsimgpu.so not found in {candidates:?}"))
}

/// A dlopen'ed library.
pub struct Lib {
    handle: *mut c_void,
}

impl Lib {
    pub fn open_path(path: &Path) -> Lib {
        let c = CString::new(path.as_os_str().to_string_lossy().as_bytes()).expect("path");
        // SAFETY: dlopen with a valid C string; the handle is kept for the
        // process's life.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a C string describing the last error.
            let err = unsafe { CStr::from_ptr(libc::dlerror()) };
            panic!("dlopen {}: {}", path.display(), err.to_string_lossy());
        }
        Lib { handle }
    }

    pub fn open() -> Lib {
        Lib::open_path(&lib_path())
    }

    /// Address of an exported symbol, or 0.
    pub fn addr(&self, name: &str) -> usize {
        let c = CString::new(name).expect("symbol name");
        // SAFETY: valid handle and C string.
        unsafe { libc::dlsym(self.handle, c.as_ptr()) as usize }
    }

    /// An exported function as a typed pointer `T` (a fn pointer type).
    pub fn sym<T: Copy>(&self, name: &str) -> T {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<usize>());
        let p = self.addr(name);
        assert!(p != 0, "symbol {name} is not exported");
        // SAFETY: T is a function pointer type of the same size as usize and
        // the caller names the matching C signature.
        unsafe { std::mem::transmute_copy::<usize, T>(&p) }
    }
}

/// Declares typed, callable entry points loaded from the library.
macro_rules! api {
    ($S:ident { $( $name:ident ( $($arg:ident : $t:ty),* ) -> $r:ty ;)* }) => {
        pub struct $S {
            $( $name: unsafe extern "C" fn($($t),*) -> $r, )*
        }
        impl $S {
            pub fn load(lib: &Lib) -> $S {
                $S { $( $name: lib.sym(stringify!($name)), )* }
            }
            $(
                #[allow(clippy::too_many_arguments)]
                pub fn $name(&self, $($arg: $t),*) -> $r {
                    // SAFETY: tests pass pointers to live, correctly typed
                    // buffers, as the C API requires.
                    unsafe { (self.$name)($($arg),*) }
                }
            )*
        }
    };
}

api!(Cu {
    cuInit(flags: c_uint) -> CUresult;
    cuDriverGetVersion(v: *mut c_int) -> CUresult;
    cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult;
    cuDeviceGetCount(n: *mut c_int) -> CUresult;
    cuDeviceGetName(name: *mut c_char, len: c_int, d: CUdevice) -> CUresult;
    cuDeviceGetUuid_v2(u: *mut CUuuid, d: CUdevice) -> CUresult;
    cuDeviceTotalMem_v2(b: *mut usize, d: CUdevice) -> CUresult;
    cuDeviceGetAttribute(v: *mut c_int, a: c_int, d: CUdevice) -> CUresult;
    cuDeviceGetPCIBusId(s: *mut c_char, len: c_int, d: CUdevice) -> CUresult;
    cuDeviceGetByPCIBusId(d: *mut CUdevice, s: *const c_char) -> CUresult;
    cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult;
    cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult;
    cuCtxCreate_v2(c: *mut CUcontext, flags: c_uint, d: CUdevice) -> CUresult;
    cuCtxDestroy_v2(c: CUcontext) -> CUresult;
    cuCtxGetCurrent(c: *mut CUcontext) -> CUresult;
    cuCtxSetCurrent(c: CUcontext) -> CUresult;
    cuCtxPushCurrent_v2(c: CUcontext) -> CUresult;
    cuCtxPopCurrent_v2(c: *mut CUcontext) -> CUresult;
    cuCtxGetDevice(d: *mut CUdevice) -> CUresult;
    cuCtxSynchronize() -> CUresult;
    cuDevicePrimaryCtxRetain(c: *mut CUcontext, d: CUdevice) -> CUresult;
    cuDevicePrimaryCtxRelease_v2(d: CUdevice) -> CUresult;
    cuDevicePrimaryCtxGetState(d: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult;
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult;
    cuMemAlloc_v2(p: *mut CUdeviceptr, n: usize) -> CUresult;
    cuMemFree_v2(p: CUdeviceptr) -> CUresult;
    cuMemAllocPitch_v2(p: *mut CUdeviceptr, pitch: *mut usize, w: usize, h: usize, e: c_uint) -> CUresult;
    cuMemAllocManaged(p: *mut CUdeviceptr, n: usize, flags: c_uint) -> CUresult;
    cuMemAllocHost_v2(p: *mut *mut c_void, n: usize) -> CUresult;
    cuMemFreeHost(p: *mut c_void) -> CUresult;
    cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, p: CUdeviceptr) -> CUresult;
    cuPointerGetAttribute(data: *mut c_void, a: CUpointer_attribute, p: CUdeviceptr) -> CUresult;
    cuMemcpy(d: CUdeviceptr, s: CUdeviceptr, n: usize) -> CUresult;
    cuMemcpyHtoD_v2(d: CUdeviceptr, s: *const c_void, n: usize) -> CUresult;
    cuMemcpyDtoH_v2(d: *mut c_void, s: CUdeviceptr, n: usize) -> CUresult;
    cuMemcpyDtoD_v2(d: CUdeviceptr, s: CUdeviceptr, n: usize) -> CUresult;
    cuMemcpyHtoD_v2_ptds(d: CUdeviceptr, s: *const c_void, n: usize) -> CUresult;
    cuMemcpyDtoHAsync_v2(d: *mut c_void, s: CUdeviceptr, n: usize, st: CUstream) -> CUresult;
    cuMemsetD8_v2(d: CUdeviceptr, v: u8, n: usize) -> CUresult;
    cuMemsetD32_v2(d: CUdeviceptr, v: c_uint, n: usize) -> CUresult;
    cuMemsetD32Async(d: CUdeviceptr, v: c_uint, n: usize, st: CUstream) -> CUresult;
    cuArray3DCreate_v2(a: *mut CUarray, d: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult;
    cuArrayDestroy(a: CUarray) -> CUresult;
    cuMipmappedArrayCreate(a: *mut CUmipmappedArray, d: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> CUresult;
    cuMipmappedArrayDestroy(a: CUmipmappedArray) -> CUresult;
    cuStreamCreate(s: *mut CUstream, flags: c_uint) -> CUresult;
    cuStreamDestroy_v2(s: CUstream) -> CUresult;
    cuStreamSynchronize(s: CUstream) -> CUresult;
    cuStreamQuery(s: CUstream) -> CUresult;
    cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) -> CUresult;
    cuEventCreate(e: *mut CUevent, flags: c_uint) -> CUresult;
    cuEventRecord(e: CUevent, s: CUstream) -> CUresult;
    cuEventSynchronize(e: CUevent) -> CUresult;
    cuEventQuery(e: CUevent) -> CUresult;
    cuEventElapsedTime(ms: *mut f32, a: CUevent, b: CUevent) -> CUresult;
    cuEventDestroy_v2(e: CUevent) -> CUresult;
    cuModuleLoadData(m: *mut CUmodule, image: *const c_void) -> CUresult;
    cuModuleLoad(m: *mut CUmodule, path: *const c_char) -> CUresult;
    cuModuleUnload(m: CUmodule) -> CUresult;
    cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) -> CUresult;
    cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint,
        shm: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult;
    cuMemGetAllocationGranularity(g: *mut usize, p: *const CUmemAllocationProp, o: c_int) -> CUresult;
    cuMemCreate(h: *mut CUmemGenericAllocationHandle, n: usize, p: *const CUmemAllocationProp, f: u64) -> CUresult;
    cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult;
    cuMemAddressReserve(p: *mut CUdeviceptr, n: usize, align: usize, addr: CUdeviceptr, f: u64) -> CUresult;
    cuMemAddressFree(p: CUdeviceptr, n: usize) -> CUresult;
    cuMemMap(p: CUdeviceptr, n: usize, off: usize, h: CUmemGenericAllocationHandle, f: u64) -> CUresult;
    cuMemUnmap(p: CUdeviceptr, n: usize) -> CUresult;
    cuMemSetAccess(p: CUdeviceptr, n: usize, desc: *const c_void, count: usize) -> CUresult;
    cuMemGetAllocationPropertiesFromHandle(p: *mut CUmemAllocationProp, h: CUmemGenericAllocationHandle) -> CUresult;
    cuDeviceGetDefaultMemPool(p: *mut CUmemoryPool, d: CUdevice) -> CUresult;
    cuDeviceGetMemPool(p: *mut CUmemoryPool, d: CUdevice) -> CUresult;
    cuMemPoolCreate(p: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult;
    cuMemPoolDestroy(p: CUmemoryPool) -> CUresult;
    cuMemPoolTrimTo(p: CUmemoryPool, keep: usize) -> CUresult;
    cuMemPoolSetAttribute(p: CUmemoryPool, a: CUmemPool_attribute, v: *mut c_void) -> CUresult;
    cuMemPoolGetAttribute(p: CUmemoryPool, a: CUmemPool_attribute, v: *mut c_void) -> CUresult;
    cuMemAllocAsync(p: *mut CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    cuMemAllocAsync_ptsz(p: *mut CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    cuMemAllocFromPoolAsync(p: *mut CUdeviceptr, n: usize, pool: CUmemoryPool, s: CUstream) -> CUresult;
    cuMemFreeAsync(p: CUdeviceptr, s: CUstream) -> CUresult;
    cuGetProcAddress(sym: *const c_char, pfn: *mut *mut c_void, v: c_int, flags: u64) -> CUresult;
    cuGetProcAddress_v2(sym: *const c_char, pfn: *mut *mut c_void, v: c_int, flags: u64,
        status: *mut CUdriverProcAddressQueryResult) -> CUresult;
    simgpu_device_used_bytes(d: c_int) -> u64;
    cuEventRecordWithFlags(e: CUevent, s: CUstream, flags: c_uint) -> CUresult;
    cuLaunchCooperativeKernelMultiDevice(p: *mut CUDA_LAUNCH_PARAMS, n: c_uint, flags: c_uint) -> CUresult;
    cuStreamBeginCapture_v2(s: CUstream, mode: CUstreamCaptureMode) -> CUresult;
    cuStreamEndCapture(s: CUstream, g: *mut CUgraph) -> CUresult;
    cuStreamIsCapturing(s: CUstream, st: *mut CUstreamCaptureStatus) -> CUresult;
    cuStreamGetCaptureInfo_v2(s: CUstream, st: *mut CUstreamCaptureStatus, id: *mut u64, g: *mut CUgraph,
        deps: *mut *const CUgraphNode, n: *mut usize) -> CUresult;
    cuGraphCreate(g: *mut CUgraph, flags: c_uint) -> CUresult;
    cuGraphDestroy(g: CUgraph) -> CUresult;
    cuGraphAddKernelNode_v2(n: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize,
        p: *const CUDA_KERNEL_NODE_PARAMS_v2) -> CUresult;
    cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, n: *mut usize) -> CUresult;
    cuGraphNodeGetType(n: CUgraphNode, t: *mut CUgraphNodeType) -> CUresult;
    cuGraphKernelNodeGetParams_v2(n: CUgraphNode, p: *mut CUDA_KERNEL_NODE_PARAMS_v2) -> CUresult;
    cuGraphInstantiateWithFlags(e: *mut CUgraphExec, g: CUgraph, flags: u64) -> CUresult;
    cuGraphInstantiate_v2(e: *mut CUgraphExec, g: CUgraph, err: *mut CUgraphNode, log: *mut c_char,
        size: usize) -> CUresult;
    cuGraphExecDestroy(e: CUgraphExec) -> CUresult;
    cuGraphLaunch(e: CUgraphExec, s: CUstream) -> CUresult;
    simgpu_process_busy_ns(d: c_int, pid: u32) -> u64;
    simgpu_device_busy_ns(d: c_int) -> u64;
    simgpu_device_switches(d: c_int) -> u64;
    simgpu_device_switch_ns(d: c_int) -> u64;
});

api!(Nvml {
    nvmlInit_v2() -> nvmlReturn_t;
    nvmlShutdown() -> nvmlReturn_t;
    nvmlErrorString(r: nvmlReturn_t) -> *const c_char;
    nvmlSystemGetDriverVersion(s: *mut c_char, len: c_uint) -> nvmlReturn_t;
    nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t;
    nvmlDeviceGetCount_v2(n: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetHandleByIndex_v2(i: c_uint, d: *mut nvmlDevice_t) -> nvmlReturn_t;
    nvmlDeviceGetHandleByUUID(u: *const c_char, d: *mut nvmlDevice_t) -> nvmlReturn_t;
    nvmlDeviceGetHandleByPciBusId_v2(b: *const c_char, d: *mut nvmlDevice_t) -> nvmlReturn_t;
    nvmlDeviceGetIndex(d: nvmlDevice_t, i: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetName(d: nvmlDevice_t, s: *mut c_char, len: c_uint) -> nvmlReturn_t;
    nvmlDeviceGetUUID(d: nvmlDevice_t, s: *mut c_char, len: c_uint) -> nvmlReturn_t;
    nvmlDeviceGetPciInfo_v3(d: nvmlDevice_t, p: *mut nvmlPciInfo_t) -> nvmlReturn_t;
    nvmlDeviceGetMemoryInfo(d: nvmlDevice_t, m: *mut nvmlMemory_t) -> nvmlReturn_t;
    nvmlDeviceGetMemoryInfo_v2(d: nvmlDevice_t, m: *mut nvmlMemory_v2_t) -> nvmlReturn_t;
    nvmlDeviceGetComputeRunningProcesses(d: nvmlDevice_t, n: *mut c_uint, p: *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;
    nvmlDeviceGetComputeRunningProcesses_v3(d: nvmlDevice_t, n: *mut c_uint, p: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    nvmlDeviceGetGraphicsRunningProcesses_v3(d: nvmlDevice_t, n: *mut c_uint, p: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    nvmlDeviceGetUtilizationRates(d: nvmlDevice_t, u: *mut nvmlUtilization_t) -> nvmlReturn_t;
    nvmlDeviceGetProcessUtilization(d: nvmlDevice_t, s: *mut nvmlProcessUtilizationSample_t, n: *mut c_uint,
        last: c_ulonglong) -> nvmlReturn_t;
    nvmlDeviceGetTemperature(d: nvmlDevice_t, sensor: c_uint, t: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetPowerUsage(d: nvmlDevice_t, p: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetCudaComputeCapability(d: nvmlDevice_t, a: *mut c_int, b: *mut c_int) -> nvmlReturn_t;
    nvmlDeviceGetNumaNodeId(d: nvmlDevice_t, n: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetTopologyCommonAncestor(a: nvmlDevice_t, b: nvmlDevice_t, level: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetNvLinkState(d: nvmlDevice_t, link: c_uint, active: *mut c_uint) -> nvmlReturn_t;
    nvmlDeviceGetNvLinkRemotePciInfo_v2(d: nvmlDevice_t, link: c_uint, p: *mut nvmlPciInfo_t) -> nvmlReturn_t;
    nvmlDeviceGetNvLinkRemoteDeviceType(d: nvmlDevice_t, link: c_uint, kind: *mut c_uint) -> nvmlReturn_t;
});

/// Asserts a CUDA call succeeded, naming the call.
#[track_caller]
pub fn ok(result: CUresult, what: &str) {
    assert_eq!(result, CUDA_SUCCESS, "{what} returned {result}");
}

/// Reads a NUL-terminated buffer as a String.
pub fn buf_str(buf: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same layout.
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), buf.len()) };
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Reads a static C string returned by the library.
pub fn static_str(p: *const c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: the library returns NUL-terminated static strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `CLOCK_MONOTONIC` in nanoseconds (system-wide, like the simulation's).
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall clock in microseconds (NVML sample timestamps).
pub fn realtime_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// Prints a marker line for the parent (`@KEY value...`).
pub fn report(key: &str, value: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "\n@{key} {value}");
    let _ = out.flush();
}

/// Blocks until the parent sends a line on stdin.
pub fn wait_parent() -> String {
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    line
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// A scenario environment: a private state file plus variables.
pub struct TestEnv {
    pub dir: PathBuf,
    pub state: PathBuf,
    vars: Vec<(String, String)>,
}

impl TestEnv {
    pub fn new(tag: &str) -> TestEnv {
        let dir = std::env::temp_dir().join(format!(
            "simgpu-test-{tag}-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let state = dir.join("state");
        TestEnv {
            dir,
            state,
            vars: Vec::new(),
        }
    }

    pub fn var(mut self, key: &str, value: impl ToString) -> TestEnv {
        self.vars.push((key.to_string(), value.to_string()));
        self
    }

    pub fn command(&self, scenario: &str, extra: &[(&str, String)]) -> Command {
        let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
        cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"]);
        for (k, _) in std::env::vars() {
            if k.starts_with("SIMGPU_") {
                cmd.env_remove(k);
            }
        }
        cmd.env(SCENARIO_VAR, scenario)
            .env("SIMGPU_STATE", &self.state)
            .env("SIMGPU_TEST_LIB", lib_path())
            .env("RUST_BACKTRACE", "1");
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs a scenario to completion and asserts it passed.
    pub fn run(&self, scenario: &str, extra: &[(&str, String)]) -> Output {
        let out = self
            .command(scenario, extra)
            .stdin(Stdio::null())
            .output()
            .expect("spawn scenario");
        assert_passed(scenario, &out);
        out
    }

    /// Starts a scenario that talks to the parent.
    pub fn spawn(&self, scenario: &str, extra: &[(&str, String)]) -> Running {
        let mut child = self
            .command(scenario, extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn scenario");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let stdin = child.stdin.take();
        Running {
            name: scenario.to_string(),
            child,
            stdout,
            stdin,
        }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[track_caller]
pub fn assert_passed(scenario: &str, out: &Output) {
    assert!(
        out.status.success(),
        "scenario {scenario} failed ({:?})\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scenario process in flight.
pub struct Running {
    name: String,
    pub child: Child,
    stdout: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for `@key value` and returns the value.
    pub fn expect(&mut self, key: &str) -> String {
        let marker = format!("@{key} ");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("read child stdout");
            if n == 0 || Instant::now() > deadline {
                let mut err = String::new();
                if let Some(mut e) = self.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!(
                    "scenario {} ended before @{key}\n--- stdout\n{seen}\n--- stderr\n{err}",
                    self.name
                );
            }
            if let Some(at) = line.find(&marker) {
                return line[at + marker.len()..].trim().to_string();
            }
            seen.push_str(&line);
        }
    }

    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(line.as_bytes()).expect("write child stdin");
        stdin.write_all(b"\n").expect("write child stdin");
        stdin.flush().expect("flush child stdin");
    }

    /// Waits for the child to exit and asserts it passed.
    pub fn finish(mut self) {
        self.stdin.take();
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.stdout, &mut rest);
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        let status = self.child.wait().expect("wait child");
        assert!(
            status.success(),
            "scenario {} failed ({status:?})\n--- stdout\n{rest}\n--- stderr\n{err}",
            self.name
        );
    }

    /// SIGKILLs the child and reaps it.
    pub fn kill(mut self) {
        self.child.kill().expect("kill child");
        let _ = self.child.wait();
    }
}
