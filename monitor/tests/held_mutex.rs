//! A container that holds its region's mutex for ever, and replaces the
//! region file again and again while it does, costs the monitor no thread:
//! the janitor waits a bounded time for the mutex, leaves the region alone
//! for a while, and replacing the file does not buy another wait. (Alone in
//! its test binary: it counts the process's janitor threads.)

mod common;

use common::*;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};
use vgpu_monitor::daemon::{Monitor, MonitorConfig};
use vgpu_monitor::names::PodDirectory;
use vgpu_node_contract::region::{Region, RegionLimits};

const KEY: &str = "a-held_c";

/// Threads of this process named as the monitor names its janitor.
fn janitor_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(Result::ok)
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|name| name.trim() == "vgpu-janitor")
        })
        .count()
}

/// Writes at `path` a region with a dead process slot holding memory and
/// its mutex held by a process that does not exist.
fn held_region(path: &std::path::Path) {
    let region = Region::open_or_create(path, &RegionLimits::default()).expect("region");
    region.set_device_uuid(0, "GPU-held");
    let other = Region::open_existing(path).expect("second handle");
    charge(&other, 0, 0, 0, 7 * MIB);
    drop(other); // its owner "dies": the slot is dead, its memory charged
                 // The robust mutex sits right after the 56-byte header, cache-line
                 // aligned; a lock word naming some other owner is held as far as
                 // pthread_mutex_lock can tell.
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open")
        .write_at(&0x3039u32.to_le_bytes(), 64)
        .expect("hold the mutex");
}

#[test]
fn a_region_replaced_100_times_under_a_held_mutex_costs_no_thread() {
    let host = HostDir::new("held-mutex");
    let path = host.region_path(KEY);
    held_region(&path);
    let config = MonitorConfig {
        cleanup_grace: None,
        ..MonitorConfig::for_root(host.root.clone())
    };
    let mut monitor = Monitor::new(config, PodDirectory::disabled());
    // The janitor names itself once it runs, which on a busy machine can
    // be after `Monitor::new` returns.
    let deadline = Instant::now() + Duration::from_secs(10);
    while janitor_threads() == 0 {
        assert!(
            Instant::now() < deadline,
            "the janitor thread never started"
        );
        std::thread::yield_now();
    }
    let threads = janitor_threads();
    assert_eq!(threads, 1, "one janitor thread to start with");
    let held = |monitor: &Monitor| monitor.shared().snapshot().reclaims_held_total;
    let deadline = Instant::now() + Duration::from_secs(10);
    while held(&monitor) == 0 {
        assert!(
            Instant::now() < deadline,
            "the janitor never gave up on the held mutex"
        );
        monitor.tick();
        std::thread::yield_now();
    }
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for round in 0..100 {
        let fresh = path.with_file_name(format!("region.cache.{round}"));
        held_region(&fresh);
        std::fs::rename(&fresh, &path).expect("replace the region");
        for _ in 0..2 {
            let tick = Instant::now();
            monitor.tick();
            slowest = slowest.max(tick.elapsed());
        }
    }
    assert_eq!(
        janitor_threads(),
        threads,
        "no janitor thread was added (or left blocked)"
    );
    assert_eq!(
        held(&monitor),
        1,
        "replacing the file bought no further wait on its mutex"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "no pass waited on the mutex (slowest {slowest:?}, 200 passes in {:?})",
        started.elapsed()
    );
    let region = Region::open_existing(&path).expect("region");
    assert_eq!(
        region.device_used(0),
        7 * MIB,
        "the held region is left alone"
    );
}
