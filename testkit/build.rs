//! Builds the C test programs in `programs/` with the system C compiler.
//!
//! `probe_linked` links against a stub `libcuda.so` (soname `libcuda.so.1`),
//! the way CUDA programs link against the toolkit's stub library; at run time
//! the dynamic linker loads whatever `libcuda.so.1` the test puts on
//! `LD_LIBRARY_PATH` (the simulated GPU).

use std::path::{Path, PathBuf};
use std::process::Command;

fn compile(args: &[&str], what: &str) {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&compiler)
        .args(args)
        .status()
        .unwrap_or_else(|error| panic!("cannot run {compiler} to build {what}: {error}"));
    assert!(status.success(), "{compiler} failed to build {what}");
}

fn main() {
    let source =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir")).join("programs");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir")).join("programs");
    let stub_dir = out.join("stub");
    std::fs::create_dir_all(&stub_dir).expect("create output directories");
    println!("cargo:rerun-if-changed={}", source.display());
    let src = |name: &str| source.join(name).display().to_string();
    let dst = |dir: &Path, name: &str| dir.join(name).display().to_string();
    let include = format!("-I{}", source.display());
    let common = ["-O2", "-Wall", "-Werror", "-Wno-deprecated-declarations"];

    let mut stub = vec!["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"];
    let stub_out = dst(&stub_dir, "libcuda.so");
    stub.push(&stub_out);
    stub.push(&include);
    let stub_src = src("cuda_stub.c");
    stub.push(&stub_src);
    // The stub's functions are declared without prototypes on purpose.
    stub.push("-w");
    compile(&stub, "the CUDA link stub");

    let probe_src = src("probe.c");
    let probe_out = dst(&out, "probe");
    let mut probe: Vec<&str> = common.to_vec();
    probe.extend([include.as_str(), "-o", &probe_out, &probe_src, "-ldl"]);
    compile(&probe, "probe");

    let linked_out = dst(&out, "probe_linked");
    let stub_flag = format!("-L{}", stub_dir.display());
    let mut linked: Vec<&str> = common.to_vec();
    linked.extend([
        "-DVGPU_LINKED",
        include.as_str(),
        "-o",
        &linked_out,
        &probe_src,
        &stub_flag,
        "-lcuda",
        "-ldl",
    ]);
    compile(&linked, "probe_linked");

    let bench_src = src("bench.c");
    let bench_out = dst(&out, "bench");
    let mut bench: Vec<&str> = common.to_vec();
    bench.extend([include.as_str(), "-o", &bench_out, &bench_src, "-ldl"]);
    compile(&bench, "bench");

    for (name, libraries) in [
        ("workload", vec!["-ldl", "-lpthread"]),
        ("simtool", vec!["-ldl"]),
    ] {
        let program_src = src(&format!("{name}.c"));
        let program_out = dst(&out, name);
        let mut args: Vec<&str> = common.to_vec();
        args.extend([include.as_str(), "-o", &program_out, &program_src]);
        args.extend(libraries);
        compile(&args, name);
    }

    let interposer_out = dst(&out, "next_interposer.so");
    let interposer_src = src("next_interposer.c");
    let mut interposer: Vec<&str> = common.to_vec();
    interposer.extend([
        "-shared",
        "-fPIC",
        "-o",
        &interposer_out,
        &interposer_src,
        "-ldl",
    ]);
    compile(&interposer, "next_interposer.so");

    println!("cargo:rustc-env=VGPU_TEST_PROGRAMS={}", out.display());
}
