//! Builds the CUDA programs `vgpu demo` runs (`probe`, `workload`, and
//! `simtool`, which reads the simulated GPU's record of device time) from
//! the test programs' sources in `testkit/programs/`, with the system C
//! compiler, into this build's output directory, whose path the binary
//! keeps (`VGPU_DEMO_PROGRAMS`).
//!
//! Without a C compiler vgpu still builds: the build warns, and `vgpu demo`
//! says the programs are missing and how to build them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Each program: its source and the libraries it links.
const PROGRAMS: [(&str, &[&str]); 3] = [
    ("probe", &["-ldl"]),
    ("workload", &["-ldl", "-lpthread"]),
    ("simtool", &["-ldl"]),
];

fn compile(source_dir: &Path, out: &Path, name: &str, libraries: &[&str]) -> Result<(), String> {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&compiler)
        .args(["-O2", "-Wall", "-Werror", "-Wno-deprecated-declarations"])
        .arg(format!("-I{}", source_dir.display()))
        .arg("-o")
        .arg(out.join(name))
        .arg(source_dir.join(format!("{name}.c")))
        .args(libraries)
        .status()
        .map_err(|error| format!("cannot run {compiler}: {error}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{compiler} failed ({status})"))
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let source_dir = manifest.join("../testkit/programs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir")).join("demo-programs");
    std::fs::create_dir_all(&out).expect("create the demo programs' directory");
    println!("cargo:rerun-if-env-changed=CC");
    println!(
        "cargo:rerun-if-changed={}",
        source_dir.join("cuda_minimal.h").display()
    );
    for (name, libraries) in PROGRAMS {
        println!(
            "cargo:rerun-if-changed={}",
            source_dir.join(format!("{name}.c")).display()
        );
        // A stale copy must not stand in for one that failed to build.
        let _ = std::fs::remove_file(out.join(name));
        if let Err(why) = compile(&source_dir, &out, name, libraries) {
            println!("cargo:warning=vgpu demo's program {name} was not built: {why}");
        }
    }
    println!("cargo:rustc-env=VGPU_DEMO_PROGRAMS={}", out.display());
}
