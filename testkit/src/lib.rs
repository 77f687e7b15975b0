//! Helpers shared by the integration tests: a simulated-GPU sandbox per
//! test, the built shim and test programs, and parsing of their output.
//!
//! Tests need the workspace's cdylibs built first (`cargo build`), as the
//! README's test command does; a missing library is reported with that hint.
//! `VGPU_SHIM_LIBRARY` names another build of the shim to test (the README's
//! test command points it at the shipped glibc-2.17 build).
//!
//! [`node_container`] makes a container as a node sets one up (region,
//! grant and mounts from the node agent's own plan), on the host.
//!
//! [`module_graph`] reads a crate's modules and the circles between them,
//! for the test that keeps every crate's layers pointing one way.

pub mod compute;
pub mod decisions;
pub mod extender_client;
pub mod fault_proxy;
pub mod kube;
pub mod module_graph;
pub mod namespaces;
pub mod node_container;
pub mod pending_pods;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use vgpu_node_agent::driver_libraries::DRIVER_LIBRARIES;

/// Directory holding the compiled C test programs.
pub fn programs_dir() -> PathBuf {
    PathBuf::from(env!("VGPU_TEST_PROGRAMS"))
}

/// `target/<profile>`, found from the running executable: tests live in
/// `target/<profile>/deps/`, binaries in `target/<profile>/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("executable path");
    let dir = exe.parent().expect("executable has a directory");
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir.parent().expect("deps has a parent").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

fn built_library(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace first (`cargo build --workspace`)",
        path.display()
    );
    path
}

/// Names the shim under test when set: an absolute path, so that the shipped
/// build (`cargo zigbuild` for glibc 2.17, in
/// `target/x86_64-unknown-linux-gnu/release/`) is what the tests load rather
/// than the host build beside them.
pub const SHIM_LIBRARY_VARIABLE: &str = "VGPU_SHIM_LIBRARY";

/// The shim under test: `$VGPU_SHIM_LIBRARY` when set, else the `libvgpu.so`
/// built beside the running test.
pub fn shim_library() -> PathBuf {
    match std::env::var_os(SHIM_LIBRARY_VARIABLE) {
        Some(named) if !named.is_empty() => {
            let path = PathBuf::from(named);
            // Tests run from their own package's directory, so a relative
            // path would name a different file in each package.
            assert!(
                path.is_absolute(),
                "{SHIM_LIBRARY_VARIABLE}={} must be an absolute path",
                path.display()
            );
            assert!(
                path.is_file(),
                "{SHIM_LIBRARY_VARIABLE}={} is missing: build it first (see scripts/test)",
                path.display()
            );
            path
        }
        _ => built_library("libvgpu.so"),
    }
}

/// The simulated GPU library.
pub fn simulated_gpu_library() -> PathBuf {
    built_library("libsimgpu.so")
}

static SANDBOX_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A private simulated GPU and container: its own driver state file, its own
/// region file, and a library directory where the simulated GPU answers to
/// the names of NVIDIA's driver libraries.
pub struct Sandbox {
    pub dir: PathBuf,
    pub lib_dir: PathBuf,
    pub region: PathBuf,
    pub sim_state: PathBuf,
    env: Vec<(String, String)>,
}

/// Ports are picked from here up to the start of the kernel's ephemeral range.
const LOWEST_PORT: u16 = 20000;

/// A loopback port nothing listens on now, for a server a test starts as a
/// child process. It is picked at random below the kernel's ephemeral range:
/// a port from binding port 0 lies inside that range, where any outgoing
/// connection on the machine can take it as its source port before the
/// server binds it (CI saw "address already in use" so, with many tests
/// starting servers at once). `tests/cluster/controlplane.py` picks the same way.
pub fn free_port() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.subsec_nanos())
        .unwrap_or(0)
        ^ std::process::id().rotate_left(16)
        ^ SANDBOX_COUNTER.fetch_add(1, Ordering::Relaxed) as u32;
    let span = u32::from(ephemeral_low.saturating_sub(LOWEST_PORT));
    if span < 1000 {
        // No room below the range: take the kernel's pick.
        return std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
    }
    // A small linear-congruential walk from the seed visits different
    // ports on each try.
    let mut state = seed;
    for _ in 0..200 {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let port = LOWEST_PORT + ((state >> 8) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {LOWEST_PORT} and {ephemeral_low}");
}

/// A new empty folder `vgpu-test-<pid>-<n>-<name>` under the temporary
/// folder, for one test's files.
pub fn unique_temp_dir(name: &str) -> PathBuf {
    let unique = SANDBOX_COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "vgpu-test-{}-{}-{name}",
        std::process::id(),
        unique
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a test folder");
    dir
}

impl Sandbox {
    /// A sandbox whose simulated GPU has `devices` devices of `memory` each.
    pub fn new(name: &str, devices: u32, memory: &str) -> Self {
        let dir = unique_temp_dir(name);
        let lib_dir = dir.join("lib");
        std::fs::create_dir_all(&lib_dir).expect("create sandbox");
        let simulated = simulated_gpu_library();
        for alias in DRIVER_LIBRARIES {
            std::os::unix::fs::symlink(&simulated, lib_dir.join(alias)).expect("link driver alias");
        }
        let region = dir.join("region.cache");
        let sim_state = dir.join("simgpu.state");
        let env = vec![
            ("SIMGPU_DEVICES".to_string(), devices.to_string()),
            ("SIMGPU_MEMORY".to_string(), memory.to_string()),
            ("SIMGPU_STATE".to_string(), sim_state.display().to_string()),
            ("LD_LIBRARY_PATH".to_string(), lib_dir.display().to_string()),
            (
                "CUDA_DEVICE_MEMORY_SHARED_CACHE".to_string(),
                region.display().to_string(),
            ),
            // Contexts are charged explicitly in the tests that check them.
            ("VGPU_CONTEXT_RESERVE".to_string(), "0".to_string()),
        ];
        Self {
            dir,
            lib_dir,
            region,
            sim_state,
            env,
        }
    }

    /// Sets (or replaces) an environment variable for every command.
    pub fn set(&mut self, key: &str, value: &str) -> &mut Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Removes an environment variable from every command.
    pub fn unset(&mut self, key: &str) -> &mut Self {
        self.env.retain(|(k, _)| k != key);
        self
    }

    /// A command for `program` with the sandbox environment, without the shim.
    pub fn command_without_shim(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command.env_clear();
        if let Ok(path) = std::env::var("PATH") {
            command.env("PATH", path);
        }
        for (key, value) in &self.env {
            command.env(key, value);
        }
        command
    }

    /// A command for `program` running under the shim.
    pub fn command(&self, program: &Path) -> Command {
        let mut command = self.command_without_shim(program);
        command.env("LD_PRELOAD", shim_library());
        command
    }

    /// The UUID of the sandbox's first simulated GPU, as NVML names it.
    pub fn gpu_uuid(&self) -> String {
        let mut nvml = self.command_without_shim(&programs_dir().join("probe"));
        nvml.args(["dlsym", "nvml"]);
        key_values(&run_ok(&mut nvml))
            .remove("uuid")
            .expect("the simulated GPU's UUID")
    }

    /// `probe ACCESS ARGS...` (the linked build for the `linked` access mode).
    pub fn probe(&self, access: &str, args: &[&str]) -> Command {
        let program = if access == "linked" {
            programs_dir().join("probe_linked")
        } else {
            programs_dir().join("probe")
        };
        let mut command = self.command(&program);
        command.arg(access).args(args);
        command
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts a test program that holds something (memory, a slot) and waits
/// for its "ready" line; it keeps holding until its stdin closes.
pub fn spawn_until_ready(command: &mut Command) -> std::process::Child {
    use std::io::{BufRead, BufReader};
    let mut child = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn test program");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("read ready");
    assert_eq!(line.trim(), "ready", "the program did not start");
    child
}

/// Runs a command, panicking with its stderr if it fails.
pub fn run_ok(command: &mut Command) -> Output {
    let output = command.output().expect("spawn test program");
    assert!(
        output.status.success(),
        "{command:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Parses `key=value` lines.
pub fn key_values(output: &Output) -> HashMap<String, String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A numeric value from parsed output.
pub fn number(values: &HashMap<String, String>, key: &str) -> i128 {
    values
        .get(key)
        .unwrap_or_else(|| panic!("output has no {key}: {values:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number: {values:?}"))
}

pub const MIB: i128 = 1 << 20;
