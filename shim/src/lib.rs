//! `libvgpu.so`: caps the GPU memory and compute of every process of a
//! container sharing a GPU.
//!
//! The library is preloaded (`LD_PRELOAD` or `/etc/ld.so.preload`) into every
//! process of the container. It exports the CUDA driver and NVML functions it
//! needs to see, under their exact versioned names, and also catches the
//! other ways programs reach the driver: `dlopen` + `dlsym` (see [`dlsym`])
//! and `cuGetProcAddress` (see `hooks::procaddr`), through which every
//! CUDA runtime since 11.3 obtains driver entry points.
//!
//! Each container has one region file shared by all its processes (see
//! `vgpu_node_contract::region`); allocations are charged there before the driver
//! is asked, so the container's total never exceeds its cap.
//!
//! Every hook is declared once in [`driver`], which exports it under the
//! driver's symbol name and catches panics so none unwinds into C; nothing
//! is written to standard output.

mod context_size;
mod dlsym;
mod driver;
mod enforcer;
mod hooks;
mod limiter;
mod lock;
mod logging;
mod table;
mod uuid;
