//! `vgpu doctor`: what vgpu sees on this machine, section by section, each
//! finding marked ok, warn or fail, and what to do when it is wrong.
//!
//! Each section reads through the code of the part it speaks for, so it
//! shows what that part would see rather than a second opinion:
//!
//! - [`node`]: NVML (`vgpu-nvml-host`, as the device plugin and DRA driver
//!   load it), the GPUs as the node agents publish them
//!   (`vgpu_node_agent::inventory`, health by their probe and tracker),
//!   and the DRA driver's ResourceSlice (`vgpu_dra::slice`);
//! - [`probe`]: the shim in a CUDA program, run by `vgpu run` itself;
//! - [`monitor`]: the node monitor's `/metrics`.
//!
//! Each section adds to the [`findings`], which this module writes out.

pub mod findings;
pub mod monitor;
pub mod node;
pub mod probe;

use crate::args::{DoctorArgs, MonitorUrl};
use findings::{Finding, Findings, Section, Status};
use serde::Serialize;
use std::io::Write;

/// Counts of the findings; `ok` when none failed.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub ok: bool,
    pub passed: usize,
    pub warnings: usize,
    pub failed: usize,
}

/// Everything `--json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    pub summary: Summary,
    pub driver: node::DriverFacts,
    pub gpus: Vec<node::GpuReport>,
    /// The ResourceSlice object as vgpu-dra would send it to the API server
    /// (its pool generation is 0 here: the driver's is one more than the
    /// published slice's).
    pub resource_slice: Option<serde_json::Value>,
    pub probe: probe::ProbeReport,
    pub monitor: monitor::MonitorReport,
    pub findings: Vec<Finding>,
}

/// Runs every check and writes the report; true when a check failed.
pub fn run(args: &DoctorArgs, out: &mut impl Write) -> std::io::Result<bool> {
    let mut findings = Findings::default();
    let node = node::read(args, &mut findings);
    let (url, given) = match &args.monitor {
        Some(url) => (url.clone(), true),
        None => (MonitorUrl::default_url(), false),
    };
    let uuids: Vec<&str> = node.gpus.iter().map(|gpu| gpu.uuid.as_str()).collect();
    // Scraped before the probe runs: the probe's program is in a region
    // the monitor does not read, so a pass of the monitor while it runs
    // counts it as a process without the shim; what is reported is the
    // node as it was before doctor touched it.
    let monitor = monitor::check(&url, given, &uuids, &mut findings);
    let probe = probe::run(args.library.as_deref(), &mut findings);
    let failed = findings.count(Status::Fail);
    let summary = Summary {
        ok: failed == 0,
        passed: findings.count(Status::Ok),
        warnings: findings.count(Status::Warn),
        failed,
    };
    if args.json {
        let report = Report {
            summary,
            driver: node.driver,
            gpus: node.gpus,
            resource_slice: node.slice,
            probe,
            monitor,
            findings: findings.0,
        };
        serde_json::to_writer_pretty(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        write_text(&findings.0, &summary, &url, out)?;
    }
    Ok(failed > 0)
}

/// Width of the marker column.
const MARKER_WIDTH: usize = 6;

fn write_text(
    findings: &[Finding],
    summary: &Summary,
    url: &MonitorUrl,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let indent = " ".repeat(2 + MARKER_WIDTH);
    for section in Section::ALL {
        if section == Section::Monitor {
            writeln!(out, "{} ({})", section.title(), url.text)?;
        } else {
            writeln!(out, "{}", section.title())?;
        }
        for finding in findings.iter().filter(|f| f.section == section) {
            writeln!(
                out,
                "  {:<MARKER_WIDTH$}{}",
                finding.status.marker(),
                finding.message
            )?;
            for line in &finding.details {
                writeln!(out, "{indent}{line}")?;
            }
            if let Some(hint) = &finding.hint {
                writeln!(out, "{indent}hint: {hint}")?;
            }
        }
        writeln!(out)?;
    }
    let plural =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    writeln!(
        out,
        "{}, {}, {}.",
        plural(summary.passed, "check passed", "checks passed"),
        plural(summary.warnings, "warning", "warnings"),
        plural(summary.failed, "failure", "failures")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_groups_findings_by_section_with_hints() {
        let mut findings = Findings::default();
        findings.fail(Section::Shim, "no shim", "build it");
        findings.ok(Section::Driver, "NVML loaded");
        findings
            .ok(Section::Dra, "gpu-0")
            .details
            .push("capacity: memory".into());
        let summary = Summary {
            ok: false,
            passed: findings.count(Status::Ok),
            warnings: findings.count(Status::Warn),
            failed: findings.count(Status::Fail),
        };
        let mut out = Vec::new();
        write_text(&findings.0, &summary, &MonitorUrl::default_url(), &mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        let driver = text.find("Driver (NVML)\n  ok    NVML loaded\n");
        let shim = text.find("  fail  no shim\n        hint: build it\n");
        assert!(driver.is_some() && shim.is_some(), "{text}");
        // Sections keep their order whatever order the findings came in.
        assert!(driver < shim, "{text}");
        assert!(
            text.contains("  ok    gpu-0\n        capacity: memory\n"),
            "{text}"
        );
        assert!(
            text.contains("Node monitor (http://127.0.0.1:31992/metrics)"),
            "{text}"
        );
        assert!(
            text.ends_with("2 checks passed, 0 warnings, 1 failure.\n"),
            "{text}"
        );
    }
}
