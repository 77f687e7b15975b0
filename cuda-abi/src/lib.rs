//! C ABI of the CUDA driver API and NVML, as far as vgpu uses it.
//!
//! Both sides of the driver boundary use these definitions: the shim
//! (`libvgpu.so`), which sits between programs and the driver, and the
//! simulated GPU, which stands in for the driver in tests. Values and layouts
//! follow `cuda.h` and `nvml.h` for x86_64 Linux; only what vgpu touches is
//! declared.

#![no_std]
// The names are the C API's own.
#![allow(non_camel_case_types, non_snake_case)]

pub mod cuda;
pub mod nvml;
