//! Host memory as swap (`CUDA_OVERSUBSCRIBE`): allocations beyond the cap
//! are served from mapped host memory, up to the swap allowance.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Stdio};
use vgpu_node_contract::region::Region;
use vgpu_testkit::*;

/// Starts `probe ACCESS spill TOTAL CHUNK`, reads its report up to "ready".
fn spill(
    sandbox: &Sandbox,
    access: &str,
    total: &str,
    chunk: &str,
) -> (Child, BufReader<ChildStdout>, HashMap<String, String>) {
    let mut child = sandbox
        .probe(access, &["spill", total, chunk])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn spill probe");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut values = HashMap::new();
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).expect("read") > 0,
            "probe ended early: {values:?}"
        );
        if line.trim() == "ready" {
            break;
        }
        if let Some((k, v)) = line.trim().split_once('=') {
            values.insert(k.to_string(), v.to_string());
        }
    }
    (child, reader, values)
}

/// Closes the probe's stdin and returns what it printed after "ready".
fn finish(mut child: Child, mut reader: BufReader<ChildStdout>) -> HashMap<String, String> {
    drop(child.stdin.take());
    let mut rest = String::new();
    reader.read_to_string(&mut rest).expect("read rest");
    assert!(child.wait().expect("exit").success());
    rest.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The simulated driver's own figure for device memory in use (NVML, read
/// without the shim).
fn driver_used(sandbox: &Sandbox) -> i128 {
    let mut command = sandbox.command_without_shim(&programs_dir().join("probe"));
    command.args(["dlsym", "nvml"]);
    number(&key_values(&run_ok(&mut command)), "nvml_used")
}

fn oversubscribed(name: &str) -> Sandbox {
    let mut sandbox = Sandbox::new(name, 1, "16Gi");
    sandbox
        .set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi")
        .set("CUDA_OVERSUBSCRIBE", "true")
        .set("VGPU_SWAP_LIMIT", "1Gi");
    sandbox
}

#[test]
fn one_and_a_half_times_the_cap_fits_and_every_byte_reads_back() {
    for access in ["dlsym", "procaddr"] {
        let sandbox = oversubscribed("spill");
        let (child, reader, values) = spill(&sandbox, access, "1610612736", "67108864");
        assert_eq!(
            number(&values, "chunks"),
            24,
            "{access}: 1.5 GiB in 64 MiB buffers: {values:?}"
        );
        assert_eq!(
            number(&values, "equal"),
            1,
            "{access}: data written through every buffer reads back"
        );
        assert_eq!(
            number(&values, "host_chunks"),
            8,
            "{access}: the 8 beyond the cap live in host memory"
        );
        assert_eq!(
            number(&values, "mem_total"),
            2048 * MIB,
            "{access}: cap + swap"
        );
        assert_eq!(number(&values, "mem_free"), 512 * MIB, "{access}");
        let used = driver_used(&sandbox);
        assert!(
            used <= 1024 * MIB,
            "{access}: device-resident {used} bytes exceed the cap"
        );
        assert_eq!(used, 1024 * MIB, "{access}: the device part is full");
        let region = Region::open_existing(&sandbox.region).expect("region");
        assert_eq!(region.device_swap_used(0), 512 << 20);
        let after = finish(child, reader);
        assert_eq!(
            number(&after, "free_after"),
            2048 * MIB,
            "{access}: everything returned"
        );
        assert_eq!(region.device_swap_used(0), 0);
    }
}

#[test]
fn without_oversubscription_the_same_program_stops_at_the_cap() {
    let mut sandbox = oversubscribed("nospill");
    sandbox.unset("CUDA_OVERSUBSCRIBE");
    let (child, reader, values) = spill(&sandbox, "dlsym", "1610612736", "67108864");
    assert_eq!(number(&values, "chunks"), 16, "{values:?}");
    assert_eq!(number(&values, "refusal"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(number(&values, "host_chunks"), 0);
    assert_eq!(
        number(&values, "mem_total"),
        1024 * MIB,
        "no swap without the flag"
    );
    finish(child, reader);
}

#[test]
fn the_swap_allowance_holds_across_processes_and_comes_back_after_a_kill() {
    let sandbox = oversubscribed("swaplimit");
    // The first process takes the cap and 768 MiB of swap.
    let (mut first, _first_reader, values) = spill(&sandbox, "dlsym", "1879048192", "67108864");
    assert_eq!(number(&values, "chunks"), 28);
    assert_eq!(number(&values, "host_chunks"), 12);
    // The second finds 256 MiB of swap left, and nothing on the device.
    let (second, second_reader, values) = spill(&sandbox, "dlsym", "1073741824", "67108864");
    assert_eq!(number(&values, "chunks"), 4, "{values:?}");
    assert_eq!(
        number(&values, "refusal"),
        2,
        "swap full: CUDA_ERROR_OUT_OF_MEMORY"
    );
    finish(second, second_reader);
    // SIGKILL the first: its device memory and swap come back.
    first.kill().expect("SIGKILL");
    first.wait().expect("reap");
    let (third, third_reader, values) = spill(&sandbox, "dlsym", "2147483648", "67108864");
    assert_eq!(
        number(&values, "chunks"),
        32,
        "cap + whole swap again: {values:?}"
    );
    finish(third, third_reader);
}

/// The environment the device plugin gives a container granted `grant`
/// bytes of one GPU on a node at device memory scaling `scaling`: the
/// same conversion (`region_limits`) and the same writer (`to_env`).
fn scaled_grant_env(scaling: &str, grant: u64) -> Vec<(String, String)> {
    use vgpu_cluster::decision::DeviceGrant;
    use vgpu_node_contract::region::limits::granted::region_limits;
    use vgpu_node_contract::region::limits::granted::NodeLimits;
    use vgpu_node_contract::shim_env::ShimConfig;
    let node = NodeLimits {
        memory_scaling: scaling.parse().expect("scaling"),
        ..NodeLimits::default()
    };
    let grant = DeviceGrant {
        uuid: "GPU-simulated".into(),
        memory_bytes: grant,
        cores_percent: 100,
        burst_percent: None,
    };
    let config = ShimConfig {
        oversubscribe: node.oversubscribes(),
        limits: region_limits([grant.share()], None, &node),
        // The sandbox charges contexts nothing (VGPU_CONTEXT_RESERVE=0),
        // so the whole grant is the workload's.
        measure_contexts: true,
        ..ShimConfig::default()
    };
    config.to_env(1)
}

#[test]
fn at_scaling_two_two_containers_each_fill_the_whole_card_and_read_every_byte_back() {
    // A 2 GiB card stands for a 24 GiB one: both containers' memory is
    // real host memory here (device memory in the simulated GPU, and the
    // swap), and this machine cannot hold 48 GiB of it.
    let card = 2048 * MIB;
    let env = scaled_grant_env("2", card as u64);
    let value = |key: &str| env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    assert_eq!(value("CUDA_DEVICE_MEMORY_LIMIT_0"), Some("1024m"));
    assert_eq!(value("VGPU_SWAP_LIMIT_0"), Some("1024m"));
    assert_eq!(value("CUDA_OVERSUBSCRIBE"), Some("true"));

    let mut sandbox = Sandbox::new("scaled", 1, "2Gi");
    for (key, value) in &env {
        sandbox.set(key, value);
    }
    let mut running = Vec::new();
    for container in ["a", "b"] {
        // Each container has its own region, as the plugin gives it.
        let region = sandbox.dir.join(format!("region-{container}.cache"));
        sandbox.set(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            region.to_str().expect("utf8"),
        );
        // One 64 MiB buffer more than the grant is asked for.
        let (child, reader, values) = spill(&sandbox, "dlsym", "2214592512", "67108864");
        assert_eq!(
            number(&values, "chunks"),
            32,
            "{container}: the whole grant, 2 GiB: {values:?}"
        );
        assert_eq!(number(&values, "refusal"), 2, "{container}: not more");
        assert_eq!(
            number(&values, "equal"),
            1,
            "{container}: every byte written reads back"
        );
        assert_eq!(
            number(&values, "host_chunks"),
            16,
            "{container}: half of it in host memory"
        );
        assert_eq!(number(&values, "mem_total"), card, "{container}");
        let region = Region::open_existing(&region).expect("region");
        assert_eq!(region.device_swap_used(0), 1 << 30, "{container}");
        running.push((child, reader, region));
    }
    // The two device parts fill the card and no more.
    assert_eq!(driver_used(&sandbox), card, "two 1 GiB device parts");
    for (child, reader, region) in running {
        let after = finish(child, reader);
        assert_eq!(number(&after, "free_after"), card, "everything returned");
        assert_eq!(region.device_swap_used(0), 0);
    }
}
