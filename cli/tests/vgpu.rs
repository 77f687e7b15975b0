//! `vgpu` end to end: the built binary runs the testkit's C programs under
//! the shim on a simulated GPU, with regions in a directory of the test's
//! own. Shares are the simulated driver's own record of device time.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use vgpu_node_contract::region::{Region, RegionLimits};
use vgpu_testkit::compute::{
    assert_share, device_share, process_share, wait_until, BusyMeter, Reading, Reference, Workload,
};
use vgpu_testkit::*;

/// Allowed error, in percentage points of the device (as the monitor's
/// arbitration tests allow).
const TOLERANCE: f64 = 4.0;
const GIB: i128 = 1 << 30;

/// A share under a cap of `limit` %, judged against what the same program
/// reached uncapped beside it (`vgpu_testkit::compute::assert_share`).
fn assert_near(what: &str, achieved: f64, limit: f64, uncapped: f64) {
    assert_share(what, achieved, limit, uncapped, TOLERANCE);
}

/// A simulated GPU and a region root for `vgpu`.
struct Local {
    sandbox: Sandbox,
    root: PathBuf,
}

impl Local {
    fn new(name: &str, memory: &str) -> Self {
        let sandbox = Sandbox::new(name, 1, memory);
        let root = sandbox.dir.join("regions");
        Self { sandbox, root }
    }

    /// `vgpu ARGS...` with the simulated GPU's environment (and none of
    /// the sandbox's own shim settings: vgpu makes those).
    fn vgpu(&self, args: &[&str]) -> Command {
        let mut command = self
            .sandbox
            .command_without_shim(Path::new(env!("CARGO_BIN_EXE_vgpu")));
        command
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE")
            .env("VGPU_ROOT", &self.root)
            .env("VGPU_LIBRARY", shim_library())
            .args(args);
        command
    }

    /// `vgpu run RUN_ARGS... -- PROGRAM PROGRAM_ARGS...`.
    fn run(&self, run_args: &[&str], program: &Path, program_args: &[&str]) -> Command {
        let mut command = self.vgpu(&["run"]);
        command
            .args(run_args)
            .arg("--")
            .arg(program)
            .args(program_args);
        command
    }

    fn probe(&self, run_args: &[&str], probe_args: &[&str]) -> Command {
        let mut args = vec!["dlsym"];
        args.extend_from_slice(probe_args);
        self.run(run_args, &programs_dir().join("probe"), &args)
    }

    fn workload(&self, run_args: &[&str], seconds: f64) -> Workload {
        let args = Workload::args("sync", "k1ms", seconds, 1);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Workload::spawn(&mut self.run(run_args, &programs_dir().join("workload"), &args))
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let output = run_ok(&mut self.vgpu(args));
        serde_json::from_slice(&output.stdout).expect("vgpu prints JSON")
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The share of the device over the next `seconds`, and what the uncapped
/// `reference` beside it reached over the same window.
fn measure(meter: &mut BusyMeter, reference: &mut Reference, seconds: f64) -> (f64, f64) {
    let from: Reading = meter.read(0, 0);
    let reference_from = reference.read(0);
    wait_until(from.at_ns + (seconds * 1e9) as u64);
    let share = device_share(from, meter.read(0, 0));
    (share, process_share(reference_from, reference.read(0)))
}

/// The workload `Local::workload` runs, uncapped beside it for `seconds`.
fn reference(seconds: f64) -> Reference {
    Reference::start(&[], "sync", "k1ms", seconds, 1)
}

#[test]
fn a_run_cannot_allocate_beyond_its_memory_cap() {
    let local = Local::new("cli-cap", "8Gi");
    let output = run_ok(&mut local.probe(&["--memory", "1g"], &["fill", "67108864"]));
    let values = key_values(&output);
    assert_eq!(number(&values, "chunks"), 16, "{values:?}");
    assert_eq!(number(&values, "allocated"), GIB);
    assert_eq!(number(&values, "refusal"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(number(&values, "mem_total"), GIB);
    // The region is the run's own, under the root.
    let regions: Vec<String> = std::fs::read_dir(&local.root)
        .expect("root made")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(regions.len(), 1, "{regions:?}");
    assert!(regions[0].starts_with("local-run-"), "{regions:?}");
}

#[test]
fn a_run_holds_its_compute_share() {
    let local = Local::new("cli-share", "16Gi");
    let mut meter = BusyMeter::new(&local.sandbox);
    let mut reference = reference(4.5);
    let workload = local.workload(&["--cores", "30"], 4.5);
    // The first second settles the throttling; the next three are measured.
    measure(&mut meter, &mut reference, 1.0);
    let (steady, uncapped) = measure(&mut meter, &mut reference, 3.0);
    eprintln!("--cores 30: measured {steady:.2} % (uncapped beside it {uncapped:.2} %)");
    assert_near("--cores 30", steady, 30.0, uncapped);
    workload.finish();
    reference.finish();
}

#[test]
fn runs_with_one_name_share_one_cap_and_other_limits_are_refused() {
    let local = Local::new("cli-name", "8Gi");
    let team = ["--name", "team", "--memory", "1g"];
    let mut holder = spawn_until_ready(&mut local.probe(&team, &["hold", "805306368"]));
    // 768 MiB of the shared 1 GiB is taken: 4 chunks of 64 MiB are left.
    let values = key_values(&run_ok(&mut local.probe(&team, &["fill", "67108864"])));
    assert_eq!(number(&values, "chunks"), 4, "{values:?}");
    assert_eq!(number(&values, "free_after"), 256 * MIB, "{values:?}");

    let refused = local
        .run(
            &["--name", "team", "--memory", "2g"],
            Path::new("true"),
            &[],
        )
        .output()
        .expect("run vgpu");
    assert_eq!(refused.status.code(), Some(125), "{}", stderr(&refused));
    let message = stderr(&refused);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains("other limits"), "{message}");
    assert!(message.contains("memory 1 GiB"), "{message}");

    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());
    // Idle now: a run with other limits takes the name over.
    let values = key_values(&run_ok(&mut local.probe(
        &["--name", "team", "--memory", "512m"],
        &["fill", "67108864"],
    )));
    assert_eq!(number(&values, "chunks"), 8, "{values:?}");
}

#[test]
fn invalid_values_are_one_line_and_exit_2() {
    let local = Local::new("cli-usage", "1Gi");
    let cases: &[(&[&str], &str)] = &[
        (&["run", "--memory", "8x", "--", "true"], "8x"),
        (&["run", "--cores", "101", "--", "true"], "101"),
        (&["run", "--cores", "0", "--", "true"], "0"),
        (&["run", "--memory", "1g"], "COMMAND"),
        (&["run", "--devices", "0,0", "--", "true"], "twice"),
        (&["run", "--name", "a_b", "--", "true"], "a_b"),
        (&["run", "--burst", "50", "--", "true"], "--cores"),
        (
            &["run", "--library", "/nonexistent/libvgpu.so", "--", "true"],
            "/nonexistent",
        ),
        (&["set", "x"], "nothing to change"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, mentions) in cases {
        let output = local.vgpu(args).output().expect("run vgpu");
        let message = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {message}");
        assert_eq!(message.lines().count(), 1, "{args:?}: {message:?}");
        assert!(message.starts_with("vgpu: "), "{args:?}: {message:?}");
        assert!(message.contains(mentions), "{args:?}: {message:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
    assert!(!local.root.exists(), "nothing was set up");
}

#[test]
fn the_commands_status_and_output_are_passed_through() {
    let local = Local::new("cli-status", "1Gi");
    let sh = Path::new("sh");
    let status = |command: &mut Command| command.output().expect("run vgpu");

    let seven = status(&mut local.run(&[], sh, &["-c", "exit 7"]));
    assert_eq!(seven.status.code(), Some(7));
    assert!(seven.stderr.is_empty(), "{}", stderr(&seven));

    let missing = status(&mut local.run(&[], Path::new("no-such-program-here"), &[]));
    assert_eq!(missing.status.code(), Some(127));
    assert!(
        stderr(&missing).contains("not found"),
        "{}",
        stderr(&missing)
    );

    let plain = local.sandbox.dir.join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\n").expect("write");
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let denied = status(&mut local.run(&[], &plain, &[]));
    assert_eq!(denied.status.code(), Some(126), "{}", stderr(&denied));

    let killed = status(&mut local.run(&[], sh, &["-c", "kill -TERM $$"]));
    assert_eq!(killed.status.code(), Some(128 + 15));

    // stdout is the command's alone; the limits reach it through the
    // shim's variables, replacing inherited ones.
    let mut echo = local.run(
        &["--memory", "1g", "--cores", "30", "--devices", "1,0"],
        sh,
        &[
            "-c",
            "echo $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER $CUDA_DEVICE_MEMORY_LIMIT_0 \
             $CUDA_DEVICE_MEMORY_LIMIT_3 $CUDA_DEVICE_SM_LIMIT_0",
        ],
    );
    echo.env("CUDA_DEVICE_MEMORY_LIMIT_3", "5g");
    let echoed = run_ok(&mut echo);
    assert_eq!(
        String::from_utf8_lossy(&echoed.stdout),
        "1,0 PCI_BUS_ID 1024m 1024m 30\n"
    );
}

/// The first device of the region named `name` in `vgpu ls --json`.
fn listed<'a>(list: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    list.as_array()
        .expect("an array")
        .iter()
        .find(|entry| entry["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {list}"))
}

#[test]
fn ls_and_inspect_show_limits_and_processes() {
    let local = Local::new("cli-ls", "8Gi");
    let known = [
        "--name", "known", "--memory", "1g", "--cores", "30", "--burst", "60",
    ];
    let mut holder = spawn_until_ready(&mut local.probe(&known, &["hold", "268435456"]));
    let holder_pid = holder.id();

    let list = local.json(&["ls", "--json"]);
    let region = listed(&list, "known");
    assert_eq!(region["origin"], "local");
    let device = &region["devices"][0];
    assert_eq!(device["limits"]["memory"], 1u64 << 30);
    assert_eq!(device["limits"]["cores"], 30);
    assert_eq!(device["limits"]["burst"], 60);
    assert_eq!(device["memory_used"], 256u64 << 20);
    assert_eq!(device["effective_cores"], 30.0);
    let processes = region["processes"].as_array().expect("processes");
    assert_eq!(processes.len(), 1, "{region}");
    assert_eq!(processes[0]["live"], true);
    assert_eq!(processes[0]["memory"][0]["bytes"], 256u64 << 20);
    // The probe is vgpu's child: its PID is not vgpu's.
    assert_ne!(processes[0]["pid"], holder_pid);

    let inspected = local.json(&["inspect", "known", "--json"]);
    assert_eq!(inspected["devices"], region["devices"]);
    assert_eq!(inspected["path"], region["path"]);
    let text = run_ok(&mut local.vgpu(&["inspect", "known"]));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("cores 30 %, burst 60 %"), "{text}");
    let table = run_ok(&mut local.vgpu(&["ls"]));
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.lines().any(|line| line.starts_with("known ")),
        "{table}"
    );

    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());
    let after = local.json(&["inspect", "known", "--json"]);
    assert_eq!(after["devices"][0]["memory_used"], 0);

    let missing = local.vgpu(&["inspect", "nobody"]).output().expect("vgpu");
    assert_eq!(missing.status.code(), Some(1));
    assert_eq!(stderr(&missing).lines().count(), 1);
}

#[test]
fn set_changes_a_running_share_and_refuses_what_it_must() {
    let local = Local::new("cli-set", "8Gi");
    let mut meter = BusyMeter::new(&local.sandbox);
    let mut reference = reference(8.0);
    let workload = local.workload(&["--name", "live", "--cores", "60"], 8.0);
    measure(&mut meter, &mut reference, 1.0);
    let (before, uncapped_before) = measure(&mut meter, &mut reference, 2.0);
    run_ok(&mut local.vgpu(&["set", "live", "--cores", "20"]));
    // The shim reads the share from the region at every throttling period:
    // half a second is ample for the debt of the old share to be paid.
    measure(&mut meter, &mut reference, 0.5);
    let (after, uncapped_after) = measure(&mut meter, &mut reference, 2.0);
    eprintln!(
        "set --cores 60 -> 20: measured {before:.2} % -> {after:.2} % \
         (uncapped beside it {uncapped_before:.2} % -> {uncapped_after:.2} %)"
    );
    assert_near("before set", before, 60.0, uncapped_before);
    assert_near("after set", after, 20.0, uncapped_after);
    let region = local.json(&["inspect", "live", "--json"]);
    assert_eq!(region["devices"][0]["limits"]["cores"], 20);
    drop(workload);
    drop(reference);

    // A cap below what is held now is refused; at or above, it applies.
    let mut holder = spawn_until_ready(
        &mut local.probe(&["--name", "mem", "--memory", "1g"], &["hold", "536870912"]),
    );
    let refused = local
        .vgpu(&["set", "mem", "--memory", "256m"])
        .output()
        .expect("vgpu");
    assert_eq!(refused.status.code(), Some(1));
    assert!(stderr(&refused).contains("refused"), "{}", stderr(&refused));
    run_ok(&mut local.vgpu(&["set", "mem", "--memory", "768m"]));
    let region = local.json(&["inspect", "mem", "--json"]);
    assert_eq!(region["devices"][0]["limits"]["memory"], 768u64 << 20);
    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());

    // A Kubernetes container's region keeps the pod's limits.
    let pod_dir = local.root.join("1b4e28ba-2fa1-11d2_main");
    std::fs::create_dir_all(&pod_dir).expect("pod dir");
    let mut limits = RegionLimits::default();
    limits.sm_limit[0] = 50;
    drop(Region::open_or_create(&pod_dir.join("region.cache"), &limits).expect("pod region"));
    let refused = local
        .vgpu(&["set", "1b4e28ba-2fa1-11d2_main", "--cores", "20"])
        .output()
        .expect("vgpu");
    assert_eq!(refused.status.code(), Some(1));
    let message = stderr(&refused);
    assert!(message.contains("pod's scheduling decision"), "{message}");
    let list = local.json(&["ls", "--json"]);
    let pod = listed(&list, "1b4e28ba-2fa1-11d2_main");
    assert_eq!(pod["origin"], "kubernetes");
    assert_eq!(pod["devices"][0]["limits"]["cores"], 50);
}

#[test]
fn an_unprivileged_user_runs_in_its_runtime_directory() {
    if places_writable_by_nobody().is_none() {
        eprintln!("skipped: not root, or setpriv missing");
        return;
    }
    let mut local = Local::new("cli-nobody", "8Gi");
    // The simulated GPU keeps its state in the sandbox: let the user in.
    std::fs::set_permissions(&local.sandbox.dir, std::fs::Permissions::from_mode(0o777))
        .expect("chmod");
    let runtime = local.sandbox.dir.join("run-user");
    std::fs::create_dir(&runtime).expect("runtime dir");
    std::os::unix::fs::chown(&runtime, Some(NOBODY), Some(NOBODY)).expect("chown");
    local
        .sandbox
        .set("XDG_RUNTIME_DIR", &runtime.display().to_string());
    let mut command = Command::new("setpriv");
    let inner = local.probe(&["--name", "mine", "--memory", "1g"], &["fill", "67108864"]);
    command
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(inner.get_program())
        .args(inner.get_args())
        .env_clear()
        .envs(inner.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .env_remove("VGPU_ROOT")
        .stdin(Stdio::null());
    let output = command.output().expect("setpriv");
    assert!(output.status.success(), "{}", stderr(&output));
    let values = key_values(&output);
    assert_eq!(number(&values, "chunks"), 16, "{values:?}");
    let region = runtime.join("vgpu/local-mine/region.cache");
    let meta = std::fs::metadata(&region).expect("region in $XDG_RUNTIME_DIR/vgpu");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), NOBODY);
    let dir_mode = std::fs::metadata(runtime.join("vgpu"))
        .expect("root")
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700);
    let _ = std::io::stderr().flush();
}

const NOBODY: u32 = 65534;

/// Whether this test can switch to `nobody`: it runs as root and
/// `setpriv` exists, and `nobody` can reach the built programs.
fn places_writable_by_nobody() -> Option<()> {
    let root = std::fs::metadata("/proc/self").ok()?;
    if std::os::unix::fs::MetadataExt::uid(&root) != 0 {
        return None;
    }
    let probe = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(programs_dir().join("probe"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    // The probe prints its usage and exits 2 when it could be executed.
    (probe.code() == Some(2)).then_some(())
}

#[test]
fn top_once_measures_each_regions_gpu_over_its_interval() {
    let local = Local::new("cli-top", "16Gi");
    // An idle region: a run that allocated, freed and ended.
    run_ok(&mut local.probe(&["--name", "idle", "--memory", "1g"], &["fill", "67108864"]));
    let mut reference = reference(6.0);
    let workload = local.workload(&["--name", "busy", "--cores", "30"], 6.0);
    let mut meter = BusyMeter::new(&local.sandbox);
    // The first second settles the throttling.
    measure(&mut meter, &mut reference, 1.0);
    let from = meter.read(0, 0);
    let reference_from = reference.read(0);
    let output =
        run_ok(&mut local.vgpu(&["top", "--once", "--interval-ms", "2000", "--sort", "util"]));
    // What the simulated GPU recorded over the window top measured in (its
    // 2 s, and its own start and exit around them).
    let recorded = device_share(from, meter.read(0, 0));
    let uncapped = process_share(reference_from, reference.read(0));
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    workload.finish();
    reference.finish();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("NAME"), "{text}");
    assert!(
        lines[1].starts_with("busy "),
        "sorted by utilization: {text}"
    );
    assert!(lines[2].starts_with("idle "), "{text}");
    assert!(
        lines[3].contains("2 region GPU(s)") && lines[3].contains("over 2000 ms"),
        "{text}"
    );
    let busy: Vec<&str> = lines[1].split_whitespace().collect();
    // NAME GPU MEMORY/CAP SWAP SHARE EFF UTIL THROT LAUNCHES OOM
    assert_eq!(busy[4], "30%", "{text}");
    let utilization: f64 = busy[6].trim_end_matches('%').parse().expect("UTIL");
    eprintln!(
        "vgpu top: busy at {utilization:.1} % (share 30; the simulated GPU recorded \
         {recorded:.1} %, uncapped beside it {uncapped:.1} %)"
    );
    // top reports what the device did, and the device held the share.
    assert!(
        (utilization - recorded).abs() <= TOLERANCE,
        "vgpu top's UTIL {utilization:.1} % against {recorded:.1} % recorded"
    );
    assert_near(
        "vgpu top's UTIL for a run at 30 %",
        utilization,
        30.0,
        uncapped,
    );
    assert!(busy[8].parse::<u64>().expect("LAUNCHES") > 0, "{text}");
    let idle: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(idle[2], "0B/1GiB", "{text}");
    assert_eq!(idle[6], "0.0%", "{text}");

    // The live view needs a terminal; a pipe is told to use --once.
    let refused = local.vgpu(&["top"]).output().expect("vgpu");
    assert_eq!(refused.status.code(), Some(2));
    let message = stderr(&refused);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(
        message.contains("not a terminal") && message.contains("--once"),
        "{message}"
    );
    assert!(refused.stdout.is_empty());
}

/// A tmux server of the test's own (its own socket and no user
/// configuration) with one session, `top`, running a shell command in a
/// terminal of 200 x 50.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    const SESSION: &'static str = "top";

    fn start(dir: &Path, command: &str) -> Self {
        match Command::new("tmux").arg("-V").output() {
            Ok(output) if output.status.success() => {}
            _ => panic!(
                "tmux is missing: the live `vgpu top` is tested in a real terminal through tmux; \
                 install it (apt-get install tmux)"
            ),
        }
        let tmux = Self {
            socket: dir.join("tmux.socket"),
        };
        let started = tmux
            .command()
            .args([
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-x",
                "200",
                "-y",
                "50",
                "-s",
                Self::SESSION,
            ])
            .arg(command)
            .status()
            .expect("run tmux");
        assert!(started.success(), "tmux new-session failed");
        tmux
    }

    fn command(&self) -> Command {
        let mut command = Command::new("tmux");
        command.arg("-S").arg(&self.socket);
        command
    }

    fn send_keys(&self, keys: &str) {
        let sent = self
            .command()
            .args(["send-keys", "-t", Self::SESSION, keys])
            .status()
            .expect("tmux send-keys");
        assert!(sent.success());
    }

    /// What the pane shows now.
    fn screen(&self) -> String {
        let output = self
            .command()
            .args(["capture-pane", "-p", "-t", Self::SESSION])
            .output()
            .expect("tmux capture-pane");
        assert!(output.status.success(), "{}", stderr(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// A `#{...}` format of the pane (`alternate_on`, `pane_dead`).
    fn format(&self, format: &str) -> String {
        let output = self
            .command()
            .args(["display-message", "-p", "-t", Self::SESSION, format])
            .output()
            .expect("tmux display-message");
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    /// Polls the pane until `condition` holds on it, for at most 20 s.
    fn wait_for(&self, what: &str, condition: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let screen = self.screen();
            if condition(&screen) {
                return screen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the pane never showed {what}; it shows:\n{screen}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.command().arg("kill-server").status();
    }
}

/// The line of the live table that shows region `name`, and its place.
fn table_line<'a>(screen: &'a str, name: &str) -> Option<(usize, &'a str)> {
    screen
        .lines()
        .enumerate()
        .find(|(_, line)| line.split_whitespace().next() == Some(name))
}

/// Whether the regions' lines come in this order, each shown.
fn in_order(screen: &str, names: &[&str]) -> bool {
    let places: Option<Vec<usize>> = names
        .iter()
        .map(|name| table_line(screen, name).map(|(at, _)| at))
        .collect();
    places.is_some_and(|places| places.windows(2).all(|pair| pair[0] < pair[1]))
}

/// The header line of the live table.
fn header(screen: &str) -> &str {
    screen
        .lines()
        .find(|line| line.trim_start().starts_with("NAME"))
        .unwrap_or("")
}

/// The UTIL column of a row of the live table, in percent.
fn utilization(line: &str) -> f64 {
    // NAME GPU MEMORY/CAP SWAP SHARE EFF UTIL THROT LAUNCHES OOM
    line.split_whitespace()
        .nth(6)
        .and_then(|value| value.trim_end_matches('%').parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn top_live_shows_regions_sorts_by_key_drops_a_vanished_region_and_quits() {
    let local = Local::new("cli-top-live", "16Gi");
    let probe = |name: &str| {
        run_ok(&mut local.probe(&["--name", name, "--memory", "512m"], &["fill", "67108864"]));
    };
    probe("alpha");
    probe("gone");
    let mut holder = spawn_until_ready(&mut local.probe(
        &["--name", "zeta", "--memory", "1g", "--cores", "30"],
        &["hold", "268435456"],
    ));
    let busy = local.workload(&["--name", "busy", "--cores", "30"], 30.0);

    // After vgpu: its status and whether the terminal is back in canonical
    // (cooked) mode, then `cat` keeps the pane open to be read (output
    // written just before a pane's last process ends can be lost).
    let command = format!(
        "VGPU_ROOT='{}' '{}' top --interval-ms 250; \
         echo EXIT=$? MODE=$(stty -a | tr ' ' '\\n' | grep -x -- '-*icanon'); exec cat",
        local.root.display(),
        env!("CARGO_BIN_EXE_vgpu")
    );
    let tmux = Tmux::start(&local.sandbox.dir, &command);

    // Every region, by name, once the first interval has been measured.
    let screen = tmux.wait_for("every region, sorted by name, busy measured", |screen| {
        in_order(screen, &["alpha", "busy", "gone", "zeta"])
            && table_line(screen, "busy").is_some_and(|(_, line)| utilization(line) > 0.0)
    });
    assert!(header(&screen).contains("NAME*"), "{screen}");
    assert!(screen.contains("sorted by NAME"), "{screen}");
    assert!(screen.contains("q quit"), "{screen}");
    assert_eq!(tmux.format("#{alternate_on}"), "1", "the alternate screen");
    let (_, zeta) = table_line(&screen, "zeta").expect("zeta");
    assert!(zeta.contains("256MiB/1GiB"), "{screen}");
    assert_eq!(zeta.split_whitespace().nth(4), Some("30%"), "{screen}");
    let (_, busy_line) = table_line(&screen, "busy").expect("busy");
    eprintln!("live vgpu top, busy at --cores 30: {busy_line}");

    // m: by memory, most first: zeta holds 256 MiB, the others next to
    // nothing (busy's module image, a few bytes).
    tmux.send_keys("m");
    let screen = tmux.wait_for("the rows by memory", |screen| {
        header(screen).contains("MEMORY/CAP*")
            && ["alpha", "busy", "gone"]
                .iter()
                .all(|other| in_order(screen, &["zeta", other]))
    });
    assert!(!header(&screen).contains("NAME*"), "{screen}");

    // s: the next column, utilization: busy runs, the others do not.
    tmux.send_keys("s");
    let screen = tmux.wait_for("the rows by utilization", |screen| {
        header(screen).contains("UTIL*") && in_order(screen, &["busy", "alpha", "gone", "zeta"])
    });
    assert!(screen.contains("sorted by UTIL"), "{screen}");

    // A region removed under it disappears at the next refresh.
    std::fs::remove_dir_all(local.root.join("local-gone")).expect("remove a region");
    let screen = tmux.wait_for("the removed region gone", |screen| {
        table_line(screen, "gone").is_none() && in_order(screen, &["busy", "alpha", "zeta"])
    });
    assert!(screen.contains("3 region GPU(s)"), "{screen}");

    // q quits with status 0, the terminal back to its normal screen and
    // out of raw mode.
    tmux.send_keys("q");
    let screen = tmux.wait_for("the exit status", |screen| screen.contains("EXIT="));
    assert!(screen.contains("EXIT=0 MODE=icanon"), "{screen}");
    assert!(
        table_line(&screen, "busy").is_none(),
        "the table is gone: {screen}"
    );
    assert_eq!(tmux.format("#{alternate_on}"), "0", "the normal screen");

    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder").success());
    // vgpu run passes SIGTERM on to the workload.
    let mut busy = busy;
    let killed = Command::new("kill")
        .args(["-TERM", &busy.pid().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = busy.child.wait().expect("busy's run");
    assert_eq!(status.code(), Some(128 + 15), "{status}");
}

#[test]
fn demo_on_the_simulated_gpu_shows_the_cap_holding_and_the_share_measured() {
    // The demo's workload, uncapped on a simulated GPU of its own for as
    // long as the demo runs (stopped when dropped): what it can reach under
    // the load the demo runs under.
    let mut reference = Reference::start(&[], "burst", "k1ms", 600.0, 1);
    let reference_from = reference.read(0);
    let demo = Command::new(env!("CARGO_BIN_EXE_vgpu"))
        .args(["demo", "--simulated"])
        .env("VGPU_LIBRARY", shim_library())
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vgpu demo");
    let demo_pid = demo.id();
    let output = demo.wait_with_output().expect("vgpu demo's output");
    let uncapped = process_share(reference_from, reference.read(0));
    drop(reference);
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{text}\n{}", stderr(&output));
    eprintln!("{text}");
    assert!(text.contains("runs on the simulated GPU"), "{text}");
    assert!(text.contains("--simulated"), "says why: {text}");
    // The cap: allocations under `vgpu run --memory 4g` stop at it.
    let capped = text
        .lines()
        .find(|line| line.trim_start().starts_with("under vgpu run --memory 4g:"))
        .unwrap_or_else(|| panic!("no capped line: {text}"));
    let allocated: u64 = capped
        .split("allocated ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no allocation in {capped:?}"));
    assert!(allocated > 0 && allocated <= 4096, "{text}");
    assert!(capped.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{text}");
    assert!(capped.contains("cuMemGetInfo total 4096 MiB"), "{text}");
    assert!(
        text.contains(&format!("The 4096 MiB cap held: {allocated} MiB allocated")),
        "{text}"
    );
    // The share: what the simulated GPU recorded under --cores 30.
    let measured: f64 = text
        .split("The 30 % share measured ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no measured share: {text}"));
    eprintln!("uncapped beside the demo: {uncapped:.1} %");
    assert_near("vgpu demo's share at --cores 30", measured, 30.0, uncapped);
    let alone: f64 = text
        .split(" % without vgpu)")
        .next()
        .and_then(|before| before.rsplit('(').next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no share without vgpu: {text}"));
    // Where the machine lets the loop go past the share, it did without vgpu.
    if uncapped > 30.0 + 2.0 * TOLERANCE {
        assert!(
            alone > measured + TOLERANCE,
            "without vgpu the loop takes more than its share: {text}"
        );
    }
    let demo_dirs = std::fs::read_dir(std::env::temp_dir())
        .expect("temporary directory")
        .filter_map(Result::ok)
        .filter(|entry| {
            entry
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("vgpu-demo-{demo_pid}-"))
        })
        .count();
    assert_eq!(demo_dirs, 0, "the demo removed its directory");
}
