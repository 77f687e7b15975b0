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
