//! The device plugin's integration tests that may share a process, in one
//! test binary (each release test binary costs a thin-LTO link of its
//! own). `health` (which sets the simulated GPU's environment) and
//! `container` (which measures compute shares) keep binaries of their own.

mod burst;
mod kubelet;
mod records;
#[path = "../support/mod.rs"]
mod support;
