//! `vgpu-demo`: shows the memory cap holding on the simulated GPU.
//!
//! A 16 GiB simulated device is shared; the container is capped at 4 GiB.
//! The same CUDA program fills the device in 256 MiB steps without and then
//! with `libvgpu.so`, and an NVML client reports what it sees.

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::process::Output;
use std::time::Duration;
use vgpu_testkit::compute::{measure_single, measure_without_shim};
use vgpu_testkit::{key_values, programs_dir, Sandbox};

fn values(output: Output) -> Result<HashMap<String, String>> {
    if !output.status.success() {
        bail!(
            "demo program failed: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(key_values(&output))
}

fn mib(values: &HashMap<String, String>, key: &str) -> Result<u64> {
    let bytes: u64 = values
        .get(key)
        .with_context(|| format!("missing {key}"))?
        .parse()?;
    Ok(bytes >> 20)
}

fn main() -> Result<()> {
    if std::env::args().any(|a| a == "-h" || a == "--help") {
        println!(
            "vgpu-demo: runs CUDA programs on the simulated GPU without and with the shim:\n\
             a 4 GiB memory cap, then a 30 % compute share."
        );
        return Ok(());
    }
    let mut sandbox = Sandbox::new("demo", 1, "16Gi");
    sandbox
        .set("CUDA_DEVICE_MEMORY_LIMIT", "4Gi")
        .set("VGPU_CONTEXT_RESERVE", "256Mi");
    println!("Simulated GPU: 1 device, 16384 MiB. Container cap: CUDA_DEVICE_MEMORY_LIMIT=4Gi.\n");

    let probe = programs_dir().join("probe");
    let mut alone = sandbox.command_without_shim(&probe);
    alone.args(["procaddr", "fill", "268435456"]);
    let without = values(alone.output().context("run probe")?)?;
    println!(
        "without libvgpu.so: allocated {} MiB before the device ran out; cuMemGetInfo total {} MiB",
        mib(&without, "allocated")?,
        mib(&without, "mem_total")?
    );

    let with = values(sandbox.probe("procaddr", &["fill", "268435456"]).output()?)?;
    println!(
        "with libvgpu.so:    allocated {} MiB, then error {} (CUDA_ERROR_OUT_OF_MEMORY); cuMemGetInfo total {} MiB, free {} MiB",
        mib(&with, "allocated")?,
        with.get("refusal").map(String::as_str).unwrap_or("?"),
        mib(&with, "mem_total")?,
        mib(&with, "mem_free")?
    );
    println!("                    (4096 MiB cap = 3840 MiB of buffers + 256 MiB charged for the CUDA context)");

    let nvml = values(sandbox.probe("dlsym", &["nvml"]).output()?)?;
    println!(
        "NVML under the shim: total {} MiB, used {} MiB (no process holds memory now)",
        mib(&nvml, "nvml_total")?,
        mib(&nvml, "nvml_used")?
    );

    println!("\nCompute: a loop of 1 ms kernels, measured by the simulated GPU over 3 s.");
    let alone = measure_without_shim("burst", "k1ms", Duration::from_secs(3));
    println!("without libvgpu.so:                  {alone:.1} % of the device");
    let capped = measure_single(30, "burst", "k1ms", Duration::from_secs(3));
    println!(
        "with CUDA_DEVICE_SM_LIMIT=30:        {:.1} % of the device ({:.1} % in its first second)",
        capped.steady, capped.first_second
    );
    Ok(())
}
