//! `describe` against the simulated GPU, through nvml-wrapper as on a node.
//!
//! The simulation reads its configuration once per process, so each case
//! re-runs this test executable as a child with the case's environment.

use std::path::PathBuf;
use std::process::Command;

/// Names the case a child process runs.
const CASE: &str = "NVML_HOST_TEST_CASE";

/// `libsimgpu.so`, built beside this test by the dev-dependency.
fn simulated_gpu() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("target/<profile>/deps");
    let path = deps.join("libsimgpu.so");
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// Runs the case `case` in a child with `vars`, and asserts it passed.
fn run_case(case: &str, vars: &[(&str, &str)]) {
    let state = std::env::temp_dir().join(format!(
        "vgpu-nvml-host-{case}-{}.state",
        std::process::id()
    ));
    let exe = std::env::current_exe().expect("test executable");
    let output = Command::new(exe)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .env("SIMGPU_STATE", &state)
        .envs(vars.iter().copied())
        .output()
        .expect("run the child");
    let _ = std::fs::remove_file(&state);
    assert!(
        output.status.success(),
        "case {case} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // The child names its case, so a filter that ran nothing cannot pass.
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(&format!("case {case} done")),
        "case {case} did not run"
    );
}

/// Entry point of the children; does nothing in a normal run.
#[test]
fn child_entry() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    let nvml = vgpu_nvml_host::open(Some(&simulated_gpu())).expect("load the simulated GPU");
    let gpus = vgpu_nvml_host::describe(&nvml).expect("describe");
    let numa: Vec<Option<u32>> = gpus.iter().map(|g| g.numa).collect();
    let islands: Vec<Option<u32>> = gpus.iter().map(|g| g.nvlink_island).collect();
    let peers: Vec<Vec<u32>> = gpus.iter().map(|g| g.nvlink_peers.clone()).collect();
    match case.as_str() {
        "islands" => {
            assert_eq!(numa, vec![Some(0), Some(0), Some(1), Some(1), Some(1)]);
            assert_eq!(islands, vec![Some(0), Some(1), Some(0), Some(1), None]);
            assert_eq!(peers, vec![vec![2], vec![3], vec![0], vec![1], vec![]]);
        }
        "chain" => {
            assert_eq!(islands, vec![None, Some(1), Some(1), Some(1)]);
            assert_eq!(peers, vec![vec![], vec![2], vec![1, 3], vec![2]]);
        }
        "flat" => {
            assert_eq!(islands, vec![None, None]);
            assert!(peers.iter().all(Vec::is_empty), "{peers:?}");
        }
        other => panic!("unknown case {other}"),
    }
    println!("case {case} done");
}

#[test]
fn numa_nodes_and_nvlink_islands_come_from_nvml() {
    run_case(
        "islands",
        &[
            ("SIMGPU_DEVICES", "5"),
            ("SIMGPU_NUMA", "0,0,1,1,1"),
            // Two links between 0 and 2 (bonded): still one peer.
            ("SIMGPU_NVLINK", "0,2;1,3;0,2"),
        ],
    );
    run_case(
        "chain",
        &[("SIMGPU_DEVICES", "4"), ("SIMGPU_NVLINK", "1,2;2,3")],
    );
    run_case("flat", &[("SIMGPU_DEVICES", "2")]);
}
