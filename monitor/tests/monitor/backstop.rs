//! The memory backstop, end to end: a container the node set up (region,
//! grant and mounts from the node agent's own plan), on the simulated GPU,
//! whose NVML counts every process's memory as the driver does. A process
//! that finds the driver's entry points itself (never asking `dlsym` or
//! `cuGetProcAddress`, so the shim cannot see its allocations) and holds
//! more than the container's grant is killed soon after; the container's
//! shim processes are not.

use crate::common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use vgpu_testkit::node_container::NodeContainer;
use vgpu_testkit::Sandbox;

const POD: &str = "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f";

/// Starts `command` and waits for its "ready" line.
fn until_ready(mut command: std::process::Command) -> Child {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|line| line == "ready");
    assert!(ready, "the program never held its memory");
    child
}

/// A node container of 1 GiB on an 8 GiB simulated GPU, one of its shim
/// processes holding 512 MiB, and the monitor over it with `args`.
fn setup(name: &str, args: &[&str]) -> (Sandbox, HostDir, NodeContainer, Child, MonitorProcess) {
    let sandbox = Sandbox::new(name, 1, "8Gi");
    let uuid = sandbox.gpu_uuid();
    let host = HostDir::new(name);
    let node = NodeContainer::prepare(&host.root, POD, "main", &[(&uuid, 1 << 30, 30)]);
    let mut holder = sandbox.probe("dlsym", &["hold", &(512 * MIB).to_string()]);
    node.give_env(&mut holder);
    let shim = until_ready(node.wrap(&holder));
    let mut all = vec!["--no-kubernetes"];
    all.extend_from_slice(args);
    let monitor = MonitorProcess::on_simulated_gpu(&sandbox, &host, &all);
    let container = [("pod", POD), ("container", "main")];
    monitor.wait_for_metrics(Duration::from_secs(15), |samples| {
        (value(samples, "vgpu_container_gpu_memory_bytes", &container) >= Some((512 * MIB) as f64))
            .then_some(())
    });
    (sandbox, host, node, shim, monitor)
}

/// The attacker: 3 GiB held through entry points from the driver's own
/// symbol table, in the same container.
fn attacker(sandbox: &Sandbox, node: &NodeContainer) -> Child {
    let mut attacker = sandbox.probe("elf", &["hold", &(3072 * MIB).to_string()]);
    node.give_env(&mut attacker);
    until_ready(node.wrap(&attacker))
}

#[test]
fn a_process_that_finds_the_driver_itself_is_killed_soon_after_it_passes_its_grant() {
    let (sandbox, _host, node, mut shim, monitor) = setup("backstop-kill", &[]);
    let mut attacker = attacker(&sandbox, &node);
    let holding = Instant::now();
    let status = wait_for(Duration::from_secs(10), || {
        attacker.try_wait().expect("wait")
    })
    .unwrap_or_else(|| panic!("not killed within 10 s:\n{}", monitor.log()));
    let took = holding.elapsed();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    // Three passes of 100 ms over the cap, from its first sample.
    assert!(took < Duration::from_millis(1500), "killed after {took:?}");
    eprintln!("killed {took:?} after it held its memory");
    let container = [("pod", POD), ("container", "main")];
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_container_over_cap_kills_total", &container) == Some(1.0))
            .then_some(())
    });
    let log = monitor.log();
    assert!(
        log.contains(&format!("process {} killed", attacker.id())),
        "{log}"
    );
    assert!(
        log.contains("of which the vgpu shim charged 0 MiB"),
        "{log}"
    );
    // The shim's own process, within the grant, runs on.
    assert!(shim.try_wait().expect("wait").is_none(), "{log}");
    drop(shim.stdin.take());
    assert!(shim.wait().expect("exit").success());
}

#[test]
fn with_action_report_the_process_is_reported_and_left_running() {
    let (sandbox, _host, node, mut shim, monitor) =
        setup("backstop-report", &["--over-cap-action", "report"]);
    let mut attacker = attacker(&sandbox, &node);
    wait_for(Duration::from_secs(10), || {
        monitor.log().contains("reported only").then_some(())
    })
    .unwrap_or_else(|| panic!("not reported:\n{}", monitor.log()));
    assert!(attacker.try_wait().expect("wait").is_none(), "left running");
    let log = monitor.log();
    assert_eq!(log.matches("reported only").count(), 1, "once:\n{log}");
    for child in [&mut attacker, &mut shim] {
        drop(child.stdin.take());
        assert!(child.wait().expect("exit").success());
    }
}

/// The one host file a container may write is its region. Its root grows
/// it, past its end and with blocks preallocated beyond it, to fill the
/// node's disk; a region the node cannot read would also take the
/// container out of its grant's backstops. The monitor repairs it within
/// passes, tells it as an Event, and the container's processes are held to
/// their grant as before.
#[test]
fn a_region_its_container_grows_is_repaired_and_the_container_still_held() {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;
    use vgpu_node_contract::region::{FileExtent, REGION_BYTES};
    let (sandbox, _host, node, mut shim, monitor) = setup("backstop-region", &[]);
    let extent = || FileExtent::from(&std::fs::metadata(node.region()).expect("stat"));
    let mut region = std::fs::OpenOptions::new()
        .write(true)
        .open(node.region())
        .expect("the container's own region, writable");
    region
        .seek(SeekFrom::Start(REGION_BYTES as u64 + MIB))
        .expect("seek");
    region
        .write_all(&vec![7u8; 64 * MIB as usize])
        .expect("write");
    region.sync_all().expect("sync");
    let grown = Instant::now();
    // Past the shim, over the grant, while the region is grown.
    let mut attacker = attacker(&sandbox, &node);
    let status = wait_for(Duration::from_secs(10), || {
        attacker.try_wait().expect("wait")
    })
    .unwrap_or_else(|| panic!("not killed within 10 s:\n{}", monitor.log()));
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    wait_for(Duration::from_secs(5), || extent().intact().then_some(()))
        .unwrap_or_else(|| panic!("still {:?}:\n{}", extent(), monitor.log()));
    eprintln!("killed and repaired {:?} after it grew", grown.elapsed());

    // Blocks past the end, the size left alone.
    // SAFETY: fallocate on a file this test opened.
    let rc = unsafe { libc::fallocate(region.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 64 << 20) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    assert_eq!(extent().size, REGION_BYTES as u64);
    wait_for(Duration::from_secs(5), || extent().intact().then_some(()))
        .unwrap_or_else(|| panic!("still {:?}:\n{}", extent(), monitor.log()));
    monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_monitor_regions_repaired_total", &[]) == Some(2.0)).then_some(())
    });
    let log = monitor.log();
    assert_eq!(
        log.matches("its container damaged the region file").count(),
        2,
        "{log}"
    );
    // The shim's own process kept its region (the header was never
    // touched) and runs on within its grant.
    assert!(shim.try_wait().expect("wait").is_none(), "{log}");
    drop(shim.stdin.take());
    assert!(shim.wait().expect("exit").success());
}
