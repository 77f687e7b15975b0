//! A node: a simulated GPU (its own state file and UUIDs) and the real
//! `vgpu-device-plugin` binary running on it as a separate process, as the
//! DaemonSet runs it, pointed at an API server and a private device plugin
//! directory.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use vgpu_cluster::client::ApiSource;
use vgpu_testkit::{shim_library, Sandbox};

pub const PLUGIN: &str = env!("CARGO_BIN_EXE_vgpu-device-plugin");

pub struct PluginNode {
    pub name: String,
    pub sandbox: Sandbox,
    pub plugin_dir: PathBuf,
    pub containers_dir: PathBuf,
    pub preload: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl PluginNode {
    /// A node named `name` with `gpus` simulated GPUs of `memory` each,
    /// its plugin reaching the API server through `api`.
    pub fn new(name: &str, gpus: u32, memory: &str, api: &ApiSource, extra: &[&str]) -> Self {
        let mut sandbox = Sandbox::new(name, gpus, memory);
        sandbox.set("SIMGPU_UUID_SEED", name);
        let plugin_dir = sandbox.dir.join("device-plugins");
        let containers_dir = sandbox.dir.join("containers");
        let preload = sandbox.dir.join("vgpu/ld.so.preload");
        let log = sandbox.dir.join("plugin.log");
        std::fs::create_dir_all(&plugin_dir).expect("plugin dir");
        let path = |p: &Path| p.display().to_string();
        let (api_flag, api_value) = match api {
            ApiSource::Url(url) => ("--apiserver-url", url.clone()),
            ApiSource::Kubeconfig(kubeconfig) => ("--kubeconfig", path(kubeconfig)),
            other => panic!("a test plugin is given its API server explicitly, not {other:?}"),
        };
        let mut args: Vec<String> = [
            "--node-name",
            name,
            api_flag,
            &api_value,
            "--kubelet-poll-ms",
            "50",
            "--resync-seconds",
            "1",
            "--lease-duration-seconds",
            "2",
            "--log-level",
            "debug",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend([
            "--device-plugin-dir".to_string(),
            path(&plugin_dir),
            "--nvml-library".to_string(),
            path(&sandbox.lib_dir.join("libnvidia-ml.so.1")),
            "--library".to_string(),
            path(&shim_library()),
            "--preload-file".to_string(),
            path(&preload),
            "--containers-dir".to_string(),
            path(&containers_dir),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        Self {
            name: name.to_string(),
            sandbox,
            plugin_dir,
            containers_dir,
            preload,
            log,
            args,
            child: None,
        }
    }

    /// Starts the plugin process.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("plugin log");
        let mut command = self.sandbox.command_without_shim(Path::new(PLUGIN));
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        self.child = Some(command.spawn().expect("start vgpu-device-plugin"));
    }

    /// Kills the plugin process (SIGKILL: no clean-up of any kind).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Asks the plugin to stop (SIGTERM) and waits for it.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: kill(2) on the pid of a child this test started and has
        // not reaped yet.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        child.wait().expect("wait for the plugin")
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// The plugin's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PluginNode {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- vgpu-device-plugin log of {} ----\n{}",
                self.name,
                self.log_text()
            );
        }
    }
}
