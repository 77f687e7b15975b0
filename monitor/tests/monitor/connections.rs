//! The monitor's port is a host port (`0.0.0.0:31992`) every pod of the
//! node reaches. Tens of thousands of connections held open from several
//! addresses, each with half a request, take none of its memory or file
//! descriptors beyond its connection limits, and its passes and
//! Prometheus' scrape go on as before.

use crate::common::*;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use vgpu_node_contract::region::RegionLimits;

/// The monitor's resident memory, in bytes.
fn resident(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .expect("VmRSS");
    kib << 10
}

/// The monitor's open file descriptors.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd")
        .count()
}

/// As many connections as this process may open, up to `wanted`: the
/// soft limit raised to the hard one, less some for the test itself.
fn connections_allowed(wanted: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid pointer to an rlimit.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(read, 0);
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: as above; raising the soft limit to the hard one is allowed.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    (limit.rlim_max as usize).saturating_sub(512).min(wanted)
}

/// A connection to `to` from `source`, with half a request sent.
async fn half_request(source: IpAddr, to: SocketAddr) -> TcpStream {
    use std::io::Write;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    // The source port picked at connect, not at bind: a bind to port 0
    // searches every port of the address, slower with each one held.
    let on: libc::c_int = 1;
    // SAFETY: a socket this function owns, and a c_int option of the size
    // given.
    let set = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
    socket.bind(SocketAddr::new(source, 0)).expect("bind");
    let stream = socket.connect(to).await.expect("connect");
    let mut stream = stream.into_std().expect("std stream");
    stream.set_nonblocking(false).expect("blocking");
    // The server may have closed it already (over its limits).
    let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: monitor\r\n");
    stream
}

/// `count` of [`half_request`], from `sources` in turn, 500 at a time (a
/// connection whose first SYN is dropped waits a second for its next).
fn half_requests(count: usize, sources: &[IpAddr], to: SocketAddr) -> Vec<TcpStream> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut held = Vec::with_capacity(count);
    while held.len() < count {
        let batch = (count - held.len()).min(500);
        let first = held.len();
        let opened: Vec<TcpStream> = runtime.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for index in first..first + batch {
                set.spawn(half_request(sources[index % sources.len()], to));
            }
            set.join_all().await
        });
        held.extend(opened);
    }
    held
}

#[test]
fn tens_of_thousands_of_held_connections_change_nothing_in_its_passes() {
    let host = HostDir::new("connections");
    let region = host.create_region("u-conn_c", &RegionLimits::default());
    region.set_device_uuid(0, "GPU-conn");
    let monitor = MonitorProcess::start(
        MonitorProcess::command(),
        &[
            "--no-kubernetes",
            "--no-nvml",
            "--containers-dir",
            host.root.to_str().expect("utf8"),
        ],
    );
    let pid = monitor.child.id();
    let samples = monitor.wait_for_metrics(Duration::from_secs(10), |samples| {
        (value(samples, "vgpu_monitor_regions", &[]) == Some(1.0)).then(|| samples.to_vec())
    });
    let pass_before = value(&samples, "vgpu_monitor_loop_duration_seconds", &[]).expect("a pass");
    let (memory_before, descriptors_before) = (resident(pid), descriptors(pid));

    let wanted = connections_allowed(15_000);
    assert!(wanted >= 4_000, "too few open files allowed: {wanted}");
    let sources: Vec<IpAddr> = (2..27)
        .map(|last| IpAddr::from([127, 0, 0, last]))
        .collect();
    let started = Instant::now();
    let held = half_requests(wanted, &sources, monitor.addr);
    let opened = started.elapsed();

    // Prometheus (another address) is answered while they are held.
    let scraped = Instant::now();
    let (status, text) = http_get(monitor.addr, "/metrics").expect("scrape");
    let scrape_took = scraped.elapsed();
    assert_eq!(status, 200, "{text}");
    let samples = parse_metrics(&text);
    let pass_after = value(&samples, "vgpu_monitor_loop_duration_seconds", &[]).expect("a pass");
    assert_eq!(value(&samples, "vgpu_monitor_regions", &[]), Some(1.0));
    let (memory_after, descriptors_after) = (resident(pid), descriptors(pid));
    eprintln!(
        "{} connections from {} addresses opened in {opened:?}: the monitor's memory {} -> {} MiB, \
         its descriptors {descriptors_before} -> {descriptors_after}, a pass {:.2} -> {:.2} ms, \
         a scrape answered in {scrape_took:?}",
        held.len(),
        sources.len(),
        memory_before >> 20,
        memory_after >> 20,
        pass_before * 1e3,
        pass_after * 1e3,
    );
    // At most --max-connections (64 by default) of them kept, and a few
    // being replaced.
    assert!(
        descriptors_after <= descriptors_before + 72,
        "{descriptors_before} -> {descriptors_after} descriptors"
    );
    assert!(
        memory_after <= memory_before + (16 << 20),
        "{} -> {} MiB",
        memory_before >> 20,
        memory_after >> 20
    );
    assert!(scrape_took < Duration::from_secs(2), "{scrape_took:?}");
    assert!(pass_after < 0.1, "a pass took {pass_after} s");
    drop(held);
    assert!(monitor.stop().success());
}
