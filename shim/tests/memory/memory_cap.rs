//! The memory cap, end to end: real C programs under the shim on the
//! simulated GPU, reaching the driver each way programs do.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use vgpu_node_contract::region::Region;
use vgpu_testkit::namespaces::{forked_child, in_new_pid_namespace};
use vgpu_testkit::*;

const ACCESS_MODES: [&str; 3] = ["linked", "dlsym", "procaddr"];

#[test]
fn cap_holds_for_every_way_of_reaching_the_driver() {
    for access in ACCESS_MODES {
        let mut sandbox = Sandbox::new("fill", 1, "8Gi");
        sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
        let values = key_values(&run_ok(&mut sandbox.probe(access, &["fill", "67108864"])));
        assert_eq!(number(&values, "chunks"), 16, "{access}: {values:?}");
        assert_eq!(
            number(&values, "refusal"),
            2,
            "{access}: CUDA_ERROR_OUT_OF_MEMORY"
        );
        assert_eq!(number(&values, "mem_total"), 1024 * MIB, "{access}");
        assert_eq!(number(&values, "mem_free"), 0, "{access}");
        assert_eq!(number(&values, "device_total"), 1024 * MIB, "{access}");
        assert_eq!(number(&values, "free_after"), 1024 * MIB, "{access}");
    }
}

#[test]
fn without_the_shim_the_simulated_gpu_is_not_capped() {
    let mut sandbox = Sandbox::new("nocap", 1, "2Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
    let program = programs_dir().join("probe");
    let mut command = sandbox.command_without_shim(&program);
    command.args(["dlsym", "fill", "67108864"]);
    let values = key_values(&run_ok(&mut command));
    assert_eq!(
        number(&values, "chunks"),
        32,
        "the whole 2 GiB device: {values:?}"
    );
}

#[test]
fn every_allocation_kind_is_charged_and_returned() {
    for access in ACCESS_MODES {
        let mut sandbox = Sandbox::new("kinds", 1, "8Gi");
        sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi");
        let values = key_values(&run_ok(&mut sandbox.probe(access, &["kinds"])));
        let pitch = number(&values, "pitch");
        assert!(pitch >= 1000, "{access}: pitch {pitch}");
        let expected = [
            ("context", 0),
            ("alloc", 64 * MIB),
            ("pitched", pitch * 100),
            ("managed", 32 * MIB),
            ("vmm", 16 * MIB),
            ("array", 4 * MIB),
            ("module", number(&values, "module_image")),
            ("library", number(&values, "module_image")),
            ("library_file", number(&values, "module_image")),
            ("async", 10 * MIB),
        ];
        for (key, bytes) in expected {
            assert_eq!(
                number(&values, key),
                bytes,
                "{access}: {key} charged: {values:?}"
            );
            if key != "context" {
                let back = format!("{key}_back");
                assert_eq!(number(&values, &back), 0, "{access}: {back}: {values:?}");
            }
        }
    }
}

#[test]
fn each_context_is_charged_its_reservation() {
    let mut sandbox = Sandbox::new("context", 1, "8Gi");
    sandbox
        .set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi")
        .set("VGPU_CONTEXT_RESERVE", "128Mi");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["kinds"])));
    assert_eq!(number(&values, "context"), 128 * MIB);
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["fill", "67108864"])));
    assert_eq!(
        number(&values, "chunks"),
        14,
        "1 GiB less one context: {values:?}"
    );
}

#[test]
fn without_a_reserve_a_context_is_charged_what_it_measures_to_hold() {
    // A device whose contexts hold 300 MiB: more than the 256 MiB floor.
    let mut sandbox = Sandbox::new("measured", 1, "8Gi");
    sandbox
        .set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi")
        .set("SIMGPU_CONTEXT_BYTES", "300Mi")
        .unset("VGPU_CONTEXT_RESERVE");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["kinds"])));
    assert_eq!(number(&values, "context"), 300 * MIB, "{values:?}");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["fill", "67108864"])));
    assert_eq!(
        number(&values, "chunks"),
        11,
        "1 GiB less 300 MiB: {values:?}"
    );
    assert_eq!(
        number(&values, "free_after"),
        724 * MIB,
        "the context alone: {values:?}"
    );
    for access in ["dlsym", "procaddr"] {
        let values = key_values(&run_ok(&mut sandbox.probe(access, &["primary"])));
        assert_eq!(number(&values, "held"), 364 * MIB, "{access}: {values:?}");
        assert_eq!(
            number(&values, "after_release"),
            300 * MIB,
            "{access}: the new primary context, charged as measured: {values:?}"
        );
    }

    // Contexts smaller than the floor are charged the floor (some of their
    // memory is allocated later, out of sight).
    sandbox.set("SIMGPU_CONTEXT_BYTES", "100Mi");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["kinds"])));
    assert_eq!(number(&values, "context"), 256 * MIB, "{values:?}");

    // A reserve set by the operator is charged as it is, unmeasured.
    sandbox
        .set("SIMGPU_CONTEXT_BYTES", "300Mi")
        .set("VGPU_CONTEXT_RESERVE", "128Mi");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["kinds"])));
    assert_eq!(number(&values, "context"), 128 * MIB, "{values:?}");
}

#[test]
fn allocations_are_returned_with_the_last_primary_context_release() {
    for access in ["dlsym", "procaddr"] {
        let mut sandbox = Sandbox::new("primary", 1, "8Gi");
        sandbox
            .set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi")
            .set("VGPU_CONTEXT_RESERVE", "32Mi");
        let values = key_values(&run_ok(&mut sandbox.probe(access, &["primary"])));
        assert_eq!(
            number(&values, "held"),
            96 * MIB,
            "{access}: context + buffer"
        );
        assert_eq!(
            number(&values, "after_release"),
            32 * MIB,
            "{access}: only the new context"
        );
    }
}

#[test]
fn get_proc_address_returns_our_hook_for_the_requested_variant() {
    let mut sandbox = Sandbox::new("procaddr", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
    let values = key_values(&run_ok(&mut sandbox.probe("procaddr", &["getprocaddress"])));
    let expect =
        |key: &str, value: i128| assert_eq!(number(&values, key), value, "{key}: {values:?}");
    expect("launch_default_is_hook", 1);
    expect("launch_default_status", 0);
    expect("launch_default_rc", 0);
    expect("launch_ptsz_is_hook", 1);
    expect("launch_ptsz_status", 0);
    expect("alloc_is_hook", 1);
    expect("unhooked_is_driver", 1);
    expect("unhooked_ptsz_is_driver", 1);
    expect("unknown_rc", 500);
    expect("unknown_status", 1);
    expect("unknown_null", 1);
    expect("too_old_rc", 500);
    expect("too_old_status", 2);
    expect("too_old_null", 1);
    expect("self_is_hook", 1);
    expect("rtld_next_is_hook", 1);
    expect("handle_lookup_is_hook", 1);
}

#[test]
fn rtld_next_stays_correct_with_a_second_interposer() {
    let sandbox = Sandbox::new("rtldnext", 1, "8Gi");
    let mut command = sandbox.probe("dlsym", &["rtld-next"]);
    let preload = format!(
        "{} {}",
        shim_library().display(),
        programs_dir().join("next_interposer.so").display()
    );
    command.env("LD_PRELOAD", preload);
    let output = run_ok(&mut command);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("through-the-interposer"), "{stdout}");
    assert_eq!(number(&key_values(&output), "interposer_calls"), 1);
}

/// Starts `probe ACCESS hold BYTES` and waits until it holds the memory.
fn hold(sandbox: &Sandbox, bytes: &str) -> Child {
    spawn_until_ready(&mut sandbox.probe("linked", &["hold", bytes]))
}

#[test]
fn nvml_shows_the_cap_and_the_containers_use() {
    let mut sandbox = Sandbox::new("nvml", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi");
    let mut holder = hold(&sandbox, "314572800");
    let values = key_values(&run_ok(&mut sandbox.probe("dlsym", &["nvml"])));
    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder exit").success());
    let expect =
        |key: &str, value: i128| assert_eq!(number(&values, key), value, "{key}: {values:?}");
    expect("nvml_rc", 0);
    expect("nvml_total", 4096 * MIB);
    expect("nvml_used", 300 * MIB);
    expect("nvml_free", 3796 * MIB);
    expect("nvml_v2_rc", 0);
    expect("nvml_v2_total", 4096 * MIB);
    expect("nvml_v2_used", 300 * MIB);
    expect("processes_rc", 0);
    expect("processes", 1);
    expect("processes_memory", 300 * MIB);
}

#[test]
fn nvml_lists_the_containers_processes_by_host_pid_inside_pid_namespaces() {
    let mut sandbox = Sandbox::new("pidns", 1, "16Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi");
    let mut holder = spawn_until_ready(&mut in_new_pid_namespace(
        &sandbox.probe("linked", &["hold", "314572800"]),
    ));
    let holder_host_pid = forked_child(holder.id());
    assert_ne!(holder_host_pid, 1);

    // The simulated GPU, like NVML, lists the holder by its host PID.
    let mut plain = sandbox.command_without_shim(&programs_dir().join("probe"));
    plain.args(["dlsym", "nvml"]);
    let seen = key_values(&run_ok(&mut in_new_pid_namespace(&plain)));
    assert_eq!(
        seen.get("process_pids").map(String::as_str),
        Some(holder_host_pid.to_string().as_str()),
        "{seen:?}"
    );

    // Under the shim, another process of the container (in a PID namespace
    // too) sees the holder listed with the memory charged to it.
    let shown = key_values(&run_ok(&mut in_new_pid_namespace(
        &sandbox.probe("dlsym", &["nvml"]),
    )));
    drop(holder.stdin.take());
    assert!(holder.wait().expect("holder exit").success());
    assert_eq!(number(&shown, "processes"), 1, "{shown:?}");
    assert_eq!(
        shown.get("process_pids").map(String::as_str),
        Some(holder_host_pid.to_string().as_str())
    );
    assert_eq!(number(&shown, "processes_memory"), 300 * MIB);
}

#[test]
fn sixteen_processes_never_exceed_the_cap() {
    let mut sandbox = Sandbox::new("sixteen", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "512Mi");
    // The sampler reads the simulated driver's own figure through NVML,
    // outside the shim.
    let sampler_program = programs_dir().join("probe");
    let mut sampler = sandbox
        .command_without_shim(&sampler_program)
        .args(["dlsym", "sample"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn sampler");
    let mut sampler_out = BufReader::new(sampler.stdout.take().expect("sampler stdout"));
    let mut line = String::new();
    sampler_out.read_line(&mut line).expect("sampler ready");
    assert_eq!(line.trim(), "ready");

    let workers: Vec<Child> = (0..16)
        .map(|seed| {
            sandbox
                .probe("linked", &["random", "3000", &seed.to_string(), "67108864"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    let mut refused = 0;
    for worker in workers {
        let output = worker.wait_with_output().expect("worker");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        refused += number(&key_values(&output), "refused");
    }
    drop(sampler.stdin.take());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut sampler_out, &mut rest).expect("sampler output");
    assert!(sampler.wait().expect("sampler exit").success());
    let values: std::collections::HashMap<String, String> = rest
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let max_used = number(&values, "max_used");
    assert!(number(&values, "samples") > 100, "{values:?}");
    assert!(refused > 0, "the workload must press against the cap");
    assert!(
        max_used <= 512 * MIB,
        "driver saw {max_used} bytes, cap is 512 MiB"
    );
    let region = Region::open_existing(&sandbox.region).expect("region");
    // The fill is read from the region's exact peak: the sampler, polling
    // from outside, may miss short peaks on a loaded machine.
    let peak = region.layout().devices[0]
        .peak_used
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (256 << 20) < peak && peak <= 512 << 20,
        "the workload should fill the cap: peak {peak}"
    );
    region.reclaim_dead_slots(None).expect("sweep");
    assert_eq!(region.device_used(0), 0, "accounting returns to zero");
}

#[test]
fn memory_of_killed_processes_is_reclaimed() {
    let mut sandbox = Sandbox::new("sigkill", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "512Mi");
    for round in 0..3 {
        let mut churners: Vec<Child> = (0..4)
            .map(|_| {
                sandbox
                    .probe("linked", &["churn", "33554432"])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("spawn churner")
            })
            .collect();
        for churner in &mut churners {
            let mut line = String::new();
            BufReader::new(churner.stdout.as_mut().expect("stdout"))
                .read_line(&mut line)
                .expect("churner ready");
            assert_eq!(line.trim(), "ready", "round {round}");
        }
        // Let them churn in and out of the region lock before the kill.
        let until = Instant::now() + Duration::from_millis(50);
        while Instant::now() < until {
            std::thread::yield_now();
        }
        for churner in &mut churners {
            churner.kill().expect("SIGKILL");
            churner.wait().expect("reap");
        }
        // A new process gets the whole cap back and does not hang.
        let started = Instant::now();
        let values = key_values(&run_ok(&mut sandbox.probe("linked", &["fill", "67108864"])));
        assert_eq!(number(&values, "chunks"), 8, "round {round}: {values:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "round {round} took too long"
        );
    }
    let region = Region::open_existing(&sandbox.region).expect("region");
    region.reclaim_dead_slots(None).expect("sweep");
    assert_eq!(region.device_used(0), 0);
}

#[test]
fn a_forked_child_has_its_own_slot() {
    let mut sandbox = Sandbox::new("fork", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["fork", "67108864"])));
    assert_eq!(number(&values, "child_status"), 0, "{values:?}");
    assert_eq!(number(&values, "child_alloc"), 64 * MIB);
    assert_eq!(number(&values, "parent_before"), 64 * MIB);
    assert_eq!(
        number(&values, "parent_after"),
        64 * MIB,
        "the child's exit left the parent intact"
    );
}

#[test]
fn memcpy_round_trips_return_the_bytes_written() {
    for access in ACCESS_MODES {
        let mut sandbox = Sandbox::new("memcpy", 1, "8Gi");
        sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
        let values = key_values(&run_ok(&mut sandbox.probe(access, &["memcpy", "1048583"])));
        assert_eq!(number(&values, "equal"), 1, "{access}");
    }
}

#[test]
fn invalid_configuration_fails_closed_with_one_clear_line() {
    for (var, value) in [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1.5g"),
        ("CUDA_DEVICE_SM_LIMIT", "150"),
        ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
    ] {
        let mut sandbox = Sandbox::new("badenv", 1, "8Gi");
        sandbox.set(var, value);
        let output = sandbox
            .probe("linked", &["fill", "67108864"])
            .output()
            .expect("run");
        assert!(
            !output.status.success(),
            "{var}={value} must not run uncapped"
        );
        assert!(output.stdout.is_empty(), "nothing on stdout");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| l.contains(var)).collect();
        assert_eq!(lines.len(), 1, "one line naming {var}: {stderr}");
    }
}

#[test]
fn a_corrupt_region_is_refused_and_left_alone() {
    let mut sandbox = Sandbox::new("corrupt", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
    std::fs::write(&sandbox.region, b"not a region").expect("write");
    let output = sandbox
        .probe("linked", &["fill", "67108864"])
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("region"), "{stderr}");
    assert_eq!(
        std::fs::read(&sandbox.region).expect("read"),
        b"not a region"
    );
}

#[test]
fn refusals_are_logged_rate_limited_on_stderr_only() {
    let mut sandbox = Sandbox::new("oomlog", 1, "8Gi");
    sandbox
        .set("CUDA_DEVICE_MEMORY_LIMIT", "64Mi")
        .set("LIBCUDA_LOG_LEVEL", "4");
    let started = Instant::now();
    let output = run_ok(&mut sandbox.probe("linked", &["random", "20000", "7", "33554432"]));
    let seconds = started.elapsed().as_secs() as usize;
    let values = key_values(&output);
    assert!(number(&values, "refused") > 100, "{values:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.lines().all(|l| l.contains('=')),
        "only the program's lines: {stdout}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let refusals = stderr.lines().filter(|l| l.contains("refused")).count();
    assert!(
        refusals >= 1 && refusals <= seconds + 1,
        "{refusals} lines in {seconds}s"
    );
    assert!(stderr.contains("64 MiB cap"), "names the cap: {stderr}");
}

#[test]
fn without_configuration_the_shim_only_forwards() {
    let mut sandbox = Sandbox::new("passthrough", 1, "2Gi");
    sandbox.unset("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    let values = key_values(&run_ok(&mut sandbox.probe("linked", &["fill", "67108864"])));
    assert_eq!(number(&values, "chunks"), 32);
    assert!(!sandbox.region.exists());
}

#[test]
fn holder_stdin_protocol_is_sound() {
    // Guards the helper used above: a holder must release on stdin EOF.
    let mut sandbox = Sandbox::new("holder", 1, "8Gi");
    sandbox.set("CUDA_DEVICE_MEMORY_LIMIT", "1Gi");
    let mut holder = hold(&sandbox, "1048576");
    holder
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"x")
        .expect("write");
    drop(holder.stdin.take());
    assert!(holder.wait().expect("exit").success());
    let region = Region::open_existing(&sandbox.region).expect("region");
    assert_eq!(region.device_used(0), 0);
}
