use super::*;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vgpu-region-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    dir
}

fn limits(cap: u64) -> RegionLimits {
    let mut limits = RegionLimits::default();
    limits.memory_limit[0] = cap;
    limits
}

#[test]
fn limits_changed_from_inside_are_restored_and_reported() {
    let path = temp_path("restore");
    let mut granted = limits(4 << 30);
    granted.sm_limit[0] = 30;
    granted.sm_burst[0] = 50;
    granted.priority = 3;
    let region = Region::open_or_create(&path, &granted).expect("create");
    let restore = |region: &Region| region.restore_limits(&granted).expect("writable");
    assert!(!restore(&region), "nothing to restore");
    let device = &region.layout().limits.devices[0];
    // Lent up to the burst by the monitor: allowed.
    device.sm_effective.store(5000, Ordering::Relaxed);
    assert!(!restore(&region));
    // Raised from inside.
    device.memory_limit.store(64 << 30, Ordering::Relaxed);
    region.layout().limits.policy.store(2, Ordering::Relaxed);
    assert!(restore(&region));
    assert_eq!(region.limits(), granted.as_stored());
    device
        .sm_effective
        .store(SHARE_UNLIMITED, Ordering::Relaxed);
    assert!(restore(&region));
    assert_eq!(device.sm_effective.load(Ordering::Relaxed), 3000);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn layout_size_is_stable() {
    // A change here is a layout change: bump LAYOUT_VERSION.
    assert_eq!(std::mem::size_of::<Header>(), 48);
    assert_eq!(std::mem::size_of::<SharedMutex>(), 64);
    assert_eq!(std::mem::size_of::<Limits>(), 32 + 32 * MAX_DEVICES);
    assert_eq!(std::mem::size_of::<DeviceRecord>(), 208);
    assert_eq!(std::mem::size_of::<ProcessSlot>(), 24 + 32 * MAX_DEVICES);
}

#[test]
fn reserve_respects_cap_and_release_returns() {
    let path = temp_path("cap");
    let region = Region::open_or_create(&path, &limits(1000)).expect("create");
    let slot = region.claim_slot(1, 0).expect("slot");
    assert_eq!(
        region.reserve(slot, 0, MemoryKind::Data, 600).expect("io"),
        Ok(())
    );
    let refused = region
        .reserve(slot, 0, MemoryKind::Data, 401)
        .expect("io")
        .expect_err("over cap");
    assert_eq!(
        refused,
        CapExceeded {
            limit: 1000,
            used: 600,
            requested: 401
        }
    );
    assert_eq!(
        region
            .reserve(slot, 0, MemoryKind::Module, 400)
            .expect("io"),
        Ok(())
    );
    assert_eq!(region.device_used(0), 1000);
    assert!(region.release(slot, 0, MemoryKind::Data, 600).expect("io"));
    assert!(
        !region
            .release(slot, 0, MemoryKind::Module, 500)
            .expect("io"),
        "over-release is clamped"
    );
    assert_eq!(region.device_used(0), 0);
    assert_eq!(
        region.layout().devices[0]
            .oom_events
            .load(Ordering::Relaxed),
        1
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn concurrent_creators_end_up_sharing_one_region() {
    let dir = std::env::temp_dir().join(format!("vgpu-region-race-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("region");
    let regions: Vec<Region> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|_| scope.spawn(|| Region::open_or_create(&path, &limits(1 << 30)).expect("open")))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    for (pid, region) in regions.iter().enumerate() {
        let slot = region.claim_slot(pid as u32, 0).expect("slot");
        region
            .reserve(slot, 0, MemoryKind::Data, 1)
            .expect("io")
            .expect("fits");
    }
    for region in &regions {
        assert_eq!(
            region.device_used(0),
            16,
            "every opener sees every reservation"
        );
    }
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("region")],
        "no private files left behind"
    );
    drop(regions);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_empty_file_is_initialised_in_place() {
    let path = temp_path("empty");
    std::fs::write(&path, b"").expect("create empty");
    let region = Region::open_or_create(&path, &limits(77)).expect("initialise");
    assert_eq!(region.device_limit(0), 77);
    assert_eq!(
        std::fs::metadata(&path).expect("stat").len(),
        REGION_BYTES as u64
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn swap_has_its_own_allowance_and_is_returned_with_the_slot() {
    let path = temp_path("swap");
    let mut with_swap = limits(1000);
    with_swap.swap_limit[0] = 500;
    let region = Region::open_or_create(&path, &with_swap).expect("create");
    let other = Region::open_existing(&path).expect("attach");
    let theirs = other.claim_slot(9, 0).expect("slot");
    assert_eq!(other.reserve_swap(theirs, 0, 400).expect("io"), Ok(()));
    assert!(other.reserve_swap(theirs, 0, 101).expect("io").is_err());
    assert_eq!(region.device_swap_used(0), 400);
    assert_eq!(region.device_used(0), 0, "swap is not device memory");
    drop(other);
    assert_eq!(region.reclaim_dead_slots(None).expect("sweep"), 1);
    assert_eq!(region.device_swap_used(0), 0);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn existing_region_keeps_its_limits() {
    let path = temp_path("keep");
    let first = Region::open_or_create(&path, &limits(1000)).expect("create");
    let second = Region::open_or_create(&path, &limits(5)).expect("attach");
    assert_eq!(second.device_limit(0), 1000);
    drop(first);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn refuses_truncated_foreign_and_future_files() {
    let path = temp_path("bad");
    std::fs::write(&path, b"hello").expect("write");
    assert!(matches!(
        Region::open_or_create(&path, &limits(1)),
        Err(RegionError::WrongSize { .. })
    ));
    assert_eq!(
        std::fs::read(&path).expect("read"),
        b"hello",
        "left untouched"
    );

    let mut foreign = vec![0u8; REGION_BYTES];
    foreign[..8].copy_from_slice(b"SOMEELSE");
    foreign[24] = 1; // ready
    std::fs::write(&path, &foreign).expect("write");
    assert!(matches!(
        Region::open_or_create(&path, &limits(1)),
        Err(RegionError::Foreign { .. })
    ));

    let mut future = vec![0u8; REGION_BYTES];
    future[..8].copy_from_slice(b"VGPUREGN");
    future[8] = 99;
    future[24] = 1;
    std::fs::write(&path, &future).expect("write");
    let err = Region::open_or_create(&path, &limits(1))
        .err()
        .expect("refused");
    assert!(
        matches!(err, RegionError::Version { found: 99, .. }),
        "{err}"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn slot_of_a_dead_owner_is_reclaimed() {
    let path = temp_path("dead");
    let region = Region::open_or_create(&path, &limits(1 << 20)).expect("create");
    // A second open file description stands in for another process.
    let other = Region::open_existing(&path).expect("attach");
    let theirs = other.claim_slot(2, 0).expect("slot");
    other
        .reserve(theirs, 0, MemoryKind::Data, 4096)
        .expect("io")
        .expect("fits");
    assert!(region.slot_is_live(theirs).expect("probe"));
    assert_eq!(
        region.reclaim_dead_slots(None).expect("sweep"),
        0,
        "owner alive"
    );
    drop(other); // closes its file description: the kernel drops its lock
    assert!(!region.slot_is_live(theirs).expect("probe"));
    assert_eq!(region.reclaim_dead_slots(None).expect("sweep"), 1);
    assert_eq!(region.device_used(0), 0);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_process_that_dies_holding_the_mutex_blocks_no_one() {
    let path = temp_path("owner-dead");
    let region = Region::open_or_create(&path, &limits(1000)).expect("create");
    let slot = region.claim_slot(4, 0).expect("slot");
    region
        .reserve(slot, 0, MemoryKind::Data, 100)
        .expect("io")
        .expect("fits");
    // A total that disagrees with the slots, as a holder killed between
    // its two writes would leave it.
    region.layout().devices[0]
        .used
        .store(999, Ordering::Relaxed);
    // SAFETY: the child only locks the shared mutex and exits.
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: the region's robust mutex, in shared memory.
        unsafe {
            libc::pthread_mutex_lock(region.layout().lock.raw.get());
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(child, &mut status, 0) };
    // The next locker inherits the mutex, rebuilds the totals and goes on.
    assert_eq!(
        region.reserve(slot, 0, MemoryKind::Data, 900).expect("io"),
        Ok(())
    );
    assert_eq!(region.device_used(0), 1000);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn totals_are_rebuilt_from_slots_after_a_recount() {
    let path = temp_path("recount");
    let region = Region::open_or_create(&path, &limits(0)).expect("create");
    let slot = region.claim_slot(3, 0).expect("slot");
    region
        .reserve(slot, 0, MemoryKind::Data, 100)
        .expect("io")
        .expect("fits");
    // Simulate a holder that died between updating the total and the slot.
    region.layout().devices[0]
        .used
        .store(12345, Ordering::Relaxed);
    region.recount_totals();
    assert_eq!(region.device_used(0), 100);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn limits_updated_while_running_refuse_a_cap_below_use() {
    let path = temp_path("update");
    let mut first = limits(1000);
    first.sm_limit[0] = 60;
    let region = Region::open_or_create(&path, &first).expect("create");
    let slot = region.claim_slot(4, 0).expect("slot");
    region
        .reserve(slot, 0, MemoryKind::Data, 600)
        .expect("io")
        .expect("fits");
    let mut lower = first;
    lower.memory_limit[0] = 500;
    lower.sm_limit[0] = 20;
    assert_eq!(
        region.update_limits(&lower).expect("io"),
        Err(BelowUse {
            device: 0,
            limit: 500,
            used: 600
        })
    );
    assert_eq!(region.limits(), first.as_stored(), "nothing changed");
    lower.memory_limit[0] = 600;
    region.update_limits(&lower).expect("io").expect("at use");
    assert_eq!(region.limits(), lower.as_stored());
    let device = &region.layout().limits.devices[0];
    assert_eq!(device.sm_effective.load(Ordering::Relaxed), 2000);
    lower.sm_limit[0] = 0;
    region.update_limits(&lower).expect("io").expect("uncapped");
    assert_eq!(device.sm_effective.load(Ordering::Relaxed), SHARE_UNLIMITED);
    let _ = std::fs::remove_file(&path);
}

fn grant_beside(region_path: &std::path::Path, limits: &RegionLimits) -> Grant {
    let path = region_path.with_extension("grant");
    let _ = std::fs::remove_file(&path);
    let settings = GrantSettings {
        region_path: "/usr/local/vgpu/container/region.cache".into(),
        context_reserve: 0,
        measure_contexts: false,
        oversubscribe: false,
        device_uuids: vec!["GPU-a".into()],
    };
    Grant::create(&path, &settings, limits).expect("grant")
}

#[test]
fn with_a_grant_the_regions_own_limits_bind_nothing() {
    let path = temp_path("granted");
    let granted = limits(1000);
    let grant = grant_beside(&path, &granted);
    let grant_path = grant.path().to_path_buf();
    drop(grant);
    let region = Region::open_or_create(&path, &granted)
        .expect("create")
        .with_grant(Grant::open_read_only(&grant_path).expect("read-only"));
    let slot = region.claim_slot(7, 0).expect("slot");
    // The container lifts its own copy: the grant still holds.
    let own = &region.layout().limits;
    own.devices[0]
        .memory_limit
        .store(UNCAPPED, Ordering::Relaxed);
    own.devices[0]
        .sm_effective
        .store(SHARE_UNLIMITED, Ordering::Relaxed);
    assert_eq!(
        region.reserve(slot, 0, MemoryKind::Data, 1001).expect("io"),
        Err(CapExceeded {
            limit: 1000,
            used: 0,
            requested: 1001
        })
    );
    assert_eq!(region.limits(), granted.as_stored());
    assert_eq!(region.device_limit(0), 1000);
    // Mapped read-only, the grant cannot be changed through the region.
    assert!(matches!(
        region.update_limits(&limits(5000)),
        Err(RegionError::Grant(GrantError::ReadOnly { .. }))
    ));
    // The node, with the grant writable, puts the copy back and resizes.
    let node = Region::open_existing(&path)
        .expect("open")
        .with_grant(Grant::open_writable(&grant_path).expect("writable"));
    assert!(node.restore_limits(&granted).expect("writable"));
    assert_eq!(own.load(), granted.as_stored(), "the copy is restored");
    assert!(!node.restore_limits(&granted).expect("writable"));
    node.update_limits(&limits(2000))
        .expect("io")
        .expect("above use");
    assert_eq!(
        region.device_limit(0),
        2000,
        "the container sees the resize"
    );
    region
        .reserve(slot, 0, MemoryKind::Data, 1500)
        .expect("io")
        .expect("within the new cap");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&grant_path);
}

#[test]
fn a_ceiling_lowers_the_cap_and_never_raises_it() {
    let path = temp_path("ceiling");
    let region = Region::open_or_create(&path, &limits(1000)).expect("create");
    let slot = region.claim_slot(8, 0).expect("slot");
    let refused = region
        .reserve_under(slot, 0, MemoryKind::Data, 600, 500)
        .expect("io");
    assert_eq!(refused.map_err(|e| e.limit), Err(500));
    let refused = region
        .reserve_under(slot, 0, MemoryKind::Data, 1200, 5000)
        .expect("io");
    assert_eq!(refused.map_err(|e| e.limit), Err(1000));
    region
        .reserve_under(slot, 0, MemoryKind::Data, 400, 500)
        .expect("io")
        .expect("under both");
    assert_eq!(lower_cap(UNCAPPED, 7), 7);
    assert_eq!(lower_cap(7, UNCAPPED), 7);
    assert_eq!(lower_cap(UNCAPPED, UNCAPPED), UNCAPPED);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_grant_beside_the_region_is_attached_and_none_leaves_it_as_it_was() {
    let dir = std::env::temp_dir().join(format!("vgpu-region-beside-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("region.cache");
    let mut region = Region::open_or_create(&path, &limits(1000)).expect("create");
    assert!(!region.attach_grant_beside(&dir, false).expect("none there"));
    assert!(region.grant().is_none());
    let settings = GrantSettings {
        region_path: "/usr/local/vgpu/container/region.cache".into(),
        context_reserve: 0,
        measure_contexts: false,
        oversubscribe: false,
        device_uuids: vec!["GPU-a".into()],
    };
    drop(Grant::create(&dir.join(grant_file::GRANT_FILE), &settings, &limits(500)).expect("grant"));
    assert!(region.attach_grant_beside(&dir, false).expect("there"));
    assert_eq!(region.device_limit(0), 500, "the grant's limits");
    std::fs::write(dir.join(grant_file::GRANT_FILE), b"no grant").expect("overwrite");
    let mut other = Region::open_existing(&path).expect("open");
    assert!(other.attach_grant_beside(&dir, true).is_err());
    assert_eq!(other.device_limit(0), 1000, "left as it was");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The file's extent as `stat` gives it.
fn extent(path: &std::path::Path) -> FileExtent {
    FileExtent::from(&std::fs::metadata(path).expect("stat"))
}

#[test]
fn a_region_grown_shrunk_or_scribbled_over_is_repaired_and_an_intact_one_left_alone() {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;
    let path = temp_path("repair");
    let granted = limits(1 << 30);
    let region = Region::open_or_create(&path, &granted).expect("create");
    let slot = region.claim_slot(1, 0).expect("slot");
    assert_eq!(
        region.reserve(slot, 0, MemoryKind::Data, 600).expect("io"),
        Ok(())
    );
    drop(region);
    assert!(extent(&path).intact(), "{:?}", extent(&path));
    assert!(Region::repair(&path, &granted).expect("repair").is_none());

    // Written past its end: 16 MiB on disk.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.seek(SeekFrom::Start(REGION_BYTES as u64 + (1 << 20)))
        .expect("seek");
    file.write_all(&vec![7u8; 16 << 20]).expect("write");
    file.sync_all().expect("sync");
    assert!(!extent(&path).intact());
    let (region, repaired) = Region::repair(&path, &granted)
        .expect("repair")
        .expect("was grown");
    assert!(repaired.found.allocated >= 16 << 20, "{repaired:?}");
    assert!(!repaired.reinitialised, "the header was untouched");
    assert!(extent(&path).intact(), "{:?}", extent(&path));
    assert_eq!(region.device_used(0), 600, "its accounting kept");
    drop(region);

    // Blocks preallocated past its end, its size unchanged.
    // SAFETY: fallocate on an fd we own.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 16 << 20) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    let swollen = extent(&path);
    assert_eq!(swollen.size, REGION_BYTES as u64);
    assert!(swollen.allocated >= 16 << 20, "{swollen:?}");
    let (_, repaired) = Region::repair(&path, &granted)
        .expect("repair")
        .expect("was swollen");
    assert_eq!(repaired.found, swollen);
    assert!(extent(&path).intact(), "{:?}", extent(&path));

    // Emptied, then scribbled over at the right size.
    file.set_len(0).expect("truncate");
    file.set_len(REGION_BYTES as u64).expect("extend");
    file.seek(SeekFrom::Start(0)).expect("seek");
    file.write_all(&[0xa5u8; 4096]).expect("write");
    let (region, repaired) = Region::repair(&path, &granted)
        .expect("repair")
        .expect("was scribbled over");
    assert!(repaired.reinitialised);
    assert_eq!(region.limits(), granted.as_stored());
    drop(region);
    Region::open_existing(&path).expect("a region again");
    let _ = std::fs::remove_file(&path);
}
