//! `libsimgpu.so`: a simulated NVIDIA driver for machines without a GPU.
//!
//! The library exports a subset of the CUDA driver API (`libcuda.so.1`) and
//! of NVML (`libnvidia-ml.so.1`); tests install it under both names in a
//! directory on `LD_LIBRARY_PATH`.
//!
//! * Devices, memory sizes and SM counts come from `SIMGPU_*` environment
//!   variables (see [`config`]), read once per process.
//! * Device memory is lazily touched host memory, so copies round-trip real
//!   bytes; device pointers are host addresses.
//! * Every process using the same state file (`SIMGPU_STATE`) sees one set of
//!   devices: used memory, per-process accounting and the kernel timeline
//!   live in a shared, memory-mapped file (see [`state`]). Memory of a
//!   process that died (even by SIGKILL) is reclaimed like a real driver does.
//! * Time is real: a kernel occupies its device exclusively for the duration
//!   its (text) module declares, and NVML utilization is computed from the
//!   resulting timeline. By default each launch works its kernel's place on
//!   the timeline out at once; with `SIMGPU_TIMING=wall` a device thread
//!   runs the queued work in wall-clock time instead ([`executor`]).
//!
//! Nothing is ever printed to stdout; configuration errors are reported in
//! one line on stderr. No panic crosses the C ABI.

#![allow(
    non_snake_case,
    clippy::missing_safety_doc,
    clippy::too_many_arguments,
    clippy::not_unsafe_ptr_arg_deref
)]

#[macro_use]
mod ffi;
mod clock;
mod config;
mod cu;
mod driver;
mod executor;
mod nvml;
mod pids;
mod state;
mod topology;
