//! Modules (text images) and kernel launches on the shared timeline.
//!
//! A simulated module image is text:
//!
//! ```text
//! SIMGPU-MODULE
//! # comments and blank lines are ignored
//! add_one 20us
//! busy_20ms 20ms
//! ```
//!
//! Each line declares a kernel and how long it occupies the device. A module
//! costs device memory equal to its image length.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_cuda_abi::cuda::*;

use super::{inp, out};
use crate::clock::{self, parse_duration};
use crate::config::LateReturns;
use crate::driver::{
    self, charge, check_init, lock, new_handle, Function, KernelNode, Module, NodeOp, QUEUE_DEPTH,
};
use crate::executor::{executor, spend_launch_overhead, Op};
use crate::ffi::cstr;

const MAGIC: &[u8] = b"SIMGPU-MODULE";

/// Parses an image into (kernel name, duration ns) pairs.
pub fn parse_image(image: &[u8]) -> Option<Vec<(String, u64)>> {
    let text = std::str::from_utf8(image).ok()?;
    let mut lines = text.lines();
    if lines.next()?.trim() != "SIMGPU-MODULE" {
        return None;
    }
    let mut kernels = Vec::new();
    for line in lines {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let name = parts.next()?;
        let duration = parse_duration(parts.next()?)?;
        if parts.next().is_some() {
            return None;
        }
        kernels.push((name.to_string(), duration));
    }
    Some(kernels)
}

/// Reads an in-memory image: only a NUL-terminated text image that starts
/// with the magic is accepted. Stops at the first mismatching byte, so
/// binary images of any length are never over-read.
///
/// # Safety
/// `image` must be NULL or point to a readable image.
unsafe fn read_image(image: *const c_void) -> Result<Vec<u8>, CUresult> {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = image.cast::<u8>();
    for (i, &want) in MAGIC.iter().enumerate() {
        // SAFETY: bytes before `i` matched the magic (none were NUL), so the
        // image extends at least to byte `i`.
        if unsafe { p.add(i).read() } != want {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
    }
    // SAFETY: a text image is NUL-terminated by contract.
    let text = unsafe { std::ffi::CStr::from_ptr(p.cast::<c_char>()) };
    Ok(text.to_bytes().to_vec())
}

/// Reads an image file (`cuModuleLoad`, `cuLibraryLoadFromFile`).
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string.
unsafe fn read_image_file(path: *const c_char) -> Result<Vec<u8>, CUresult> {
    // SAFETY: per the caller.
    let path = unsafe { cstr(path) }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let image = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CUDA_ERROR_FILE_NOT_FOUND)
        }
        Err(_) => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if !image.starts_with(MAGIC) {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    Ok(image)
}

fn load(module: *mut CUmodule, image: &[u8]) -> Result<(), CUresult> {
    let cfg = check_init()?;
    if module.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let kernels = parse_image(image).ok_or(CUDA_ERROR_INVALID_IMAGE)?;
    let mut inner = lock();
    let (ctx, device) = inner.current()?;
    let bytes = image.len() as u64;
    charge(device, bytes)?;
    let handle = new_handle();
    let mut functions = Vec::with_capacity(kernels.len());
    for (name, declared_ns) in kernels {
        let duration_ns = cfg.kernel_duration(&name, declared_ns);
        let f = new_handle();
        inner.functions.insert(
            f,
            Function {
                module: handle,
                name,
                duration_ns,
            },
        );
        functions.push(f);
    }
    inner.modules.insert(
        handle,
        Module {
            ctx,
            device,
            bytes,
            functions,
        },
    );
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(module, handle as CUmodule) }
}

cuda_fn! {
    fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) {
        check_init()?;
        // SAFETY: C string from the caller.
        let image = unsafe { read_image_file(fname) }?;
        load(module, &image)
    }
}

cuda_fn! {
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) {
        check_init()?;
        // SAFETY: image pointer from the caller.
        let bytes = unsafe { read_image(image) }?;
        load(module, &bytes)
    }
}

cuda_fn! {
    /// JIT options are accepted and ignored.
    fn cuModuleLoadDataEx(
        module: *mut CUmodule,
        image: *const c_void,
        num_options: c_uint,
        options: *mut c_int,
        option_values: *mut *mut c_void,
    ) {
        let _ = (num_options, options, option_values);
        check_init()?;
        // SAFETY: image pointer from the caller.
        let bytes = unsafe { read_image(image) }?;
        load(module, &bytes)
    }
}

cuda_fn! {
    fn cuModuleLoadFatBinary(module: *mut CUmodule, fat_cubin: *const c_void) {
        check_init()?;
        // SAFETY: image pointer from the caller.
        let bytes = unsafe { read_image(fat_cubin) }?;
        load(module, &bytes)
    }
}

cuda_fn! {
    fn cuModuleUnload(module: CUmodule) {
        check_init()?;
        if lock().unload_module(module as u64) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

// Library management (CUDA 12): a library's kernels are usable in every
// context. The simulated GPU loads a library into the context current at
// load time, as a module whose handle is also the library's, which is what
// a single-context program sees.

cuda_fn! {
    /// JIT and library options are accepted and ignored.
    fn cuLibraryLoadData(
        library: *mut CUlibrary,
        code: *const c_void,
        jit_options: *mut c_int,
        jit_values: *mut *mut c_void,
        jit_count: c_uint,
        library_options: *mut c_int,
        library_values: *mut *mut c_void,
        library_count: c_uint,
    ) {
        let _ = (jit_options, jit_values, jit_count, library_options, library_values, library_count);
        check_init()?;
        // SAFETY: image pointer from the caller.
        let bytes = unsafe { read_image(code) }?;
        load(library.cast::<CUmodule>(), &bytes)
    }
}

cuda_fn! {
    /// JIT and library options are accepted and ignored.
    fn cuLibraryLoadFromFile(
        library: *mut CUlibrary,
        file_name: *const c_char,
        jit_options: *mut c_int,
        jit_values: *mut *mut c_void,
        jit_count: c_uint,
        library_options: *mut c_int,
        library_values: *mut *mut c_void,
        library_count: c_uint,
    ) {
        let _ = (jit_options, jit_values, jit_count, library_options, library_values, library_count);
        check_init()?;
        // SAFETY: C string from the caller.
        let image = unsafe { read_image_file(file_name) }?;
        load(library.cast::<CUmodule>(), &image)
    }
}

cuda_fn! {
    fn cuLibraryUnload(library: CUlibrary) {
        check_init()?;
        if lock().unload_module(library as u64) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

cuda_fn! {
    fn cuLibraryGetModule(module: *mut CUmodule, library: CUlibrary) {
        check_init()?;
        if !lock().modules.contains_key(&(library as u64)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        // SAFETY: C API out-pointer, checked by `out`.
        unsafe { out(module, library as CUmodule) }
    }
}

cuda_fn! {
    fn cuModuleGetFunction(hfunc: *mut CUfunction, module: CUmodule, name: *const c_char) {
        check_init()?;
        // SAFETY: C string from the caller.
        let name = unsafe { cstr(name) }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let inner = lock();
        let m = inner
            .modules
            .get(&(module as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let f = m
            .functions
            .iter()
            .copied()
            .find(|f| inner.functions.get(f).is_some_and(|x| x.name == name))
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: C API out-pointer.
        unsafe { out(hfunc, f as CUfunction) }
    }
}

cuda_fn! {
    /// Simulated modules have no globals.
    fn cuModuleGetGlobal_v2(
        dptr: *mut CUdeviceptr,
        bytes: *mut usize,
        module: CUmodule,
        name: *const c_char,
    ) {
        let _ = (dptr, bytes, name);
        check_init()?;
        if !lock().modules.contains_key(&(module as u64)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        Err(CUDA_ERROR_NOT_FOUND)
    }
}

cuda_fn! {
    /// Attributes of simulated kernels: 1024 threads per block, else 0.
    fn cuFuncGetAttribute(pi: *mut c_int, attrib: c_int, func: CUfunction) {
        check_init()?;
        if !lock().functions.contains_key(&(func as u64)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let v = match attrib {
            0 => 1024, // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
            5 | 6 => 90, // PTX_VERSION / BINARY_VERSION
            a if (0..20).contains(&a) => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: C API out-pointer.
        unsafe { out(pi, v) }
    }
}

cuda_fn! {
    fn cuFuncSetAttribute(func: CUfunction, attrib: c_int, value: c_int) {
        let _ = (attrib, value);
        check_init()?;
        if lock().functions.contains_key(&(func as u64)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

cuda_fn! {
    fn cuFuncSetCacheConfig(func: CUfunction, config: c_int) {
        let _ = config;
        check_init()?;
        if lock().functions.contains_key(&(func as u64)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

cuda_fn! {
    fn cuFuncGetModule(hmod: *mut CUmodule, func: CUfunction) {
        check_init()?;
        let m = lock()
            .functions
            .get(&(func as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .module;
        // SAFETY: C API out-pointer.
        unsafe { out(hmod, m as CUmodule) }
    }
}

/// Launch geometry check: grid ≥ 1, block ≤ 1024 threads (z ≤ 64).
fn check_dims(grid: [c_uint; 3], block: [c_uint; 3]) -> Result<(), CUresult> {
    if grid.contains(&0) || block.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let threads = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
    if threads > 1024 || block[0] > 1024 || block[1] > 1024 || block[2] > 64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if grid[1] > 65535 || grid[2] > 65535 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Launches a kernel on a stream, or records it when the stream is
/// capturing (the kernel then does not run).
fn launch(
    func: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    stream: CUstream,
) -> Result<(), CUresult> {
    let cfg = check_init()?;
    let node = kernel_node(func, grid, block, shared_mem, kernel_params, extra, stream)?;
    spend_launch_overhead(cfg.launch_overhead_ns);
    if enqueue(stream, &node, 0)?.is_some() {
        super::stream::finish_if_blocking(stream)?;
    }
    if let Some(late) = cfg.late_returns {
        return_late(&late);
    }
    Ok(())
}

/// Kernel launch calls this process has made (`SIMGPU_LATE_RETURNS`).
static LAUNCH_CALLS: AtomicU64 = AtomicU64::new(0);

/// Holds the calling thread after its kernel was handed over, when this
/// launch call is one `late` names.
fn return_late(late: &LateReturns) {
    let call = LAUNCH_CALLS.fetch_add(1, Ordering::Relaxed) + 1;
    let delay_ns = late.delay_of(call);
    if delay_ns > 0 {
        std::thread::sleep(std::time::Duration::from_nanos(delay_ns));
    }
}

/// Validates a launch and describes it as a graph would hold it.
fn kernel_node(
    func: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem: c_uint,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
    stream: CUstream,
) -> Result<KernelNode, CUresult> {
    check_dims(grid, block)?;
    let inner = lock();
    let duration_ns = inner
        .functions
        .get(&(func as u64))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?
        .duration_ns;
    let (_, ctx, _) = inner.stream(stream)?;
    Ok(KernelNode {
        func: func as u64,
        grid,
        block,
        shared_mem,
        kernel_params: kernel_params as usize,
        extra: extra as usize,
        kern: 0,
        ctx,
        duration_ns,
    })
}

/// A kernel node's launch description for a graph (`cuGraphAddKernelNode`):
/// the function must exist; the context defaults to the current one.
pub(crate) fn graph_kernel_node(p: &CUDA_KERNEL_NODE_PARAMS_v2) -> Result<KernelNode, CUresult> {
    let grid = [p.grid_dim_x, p.grid_dim_y, p.grid_dim_z];
    let block = [p.block_dim_x, p.block_dim_y, p.block_dim_z];
    check_dims(grid, block)?;
    if p.func.is_null() {
        // CUkernel (library) handles do not exist in the simulation.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let inner = lock();
    let duration_ns = inner
        .functions
        .get(&(p.func as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?
        .duration_ns;
    let ctx = if p.ctx.is_null() {
        inner.current().map_or(0, |(c, _)| c)
    } else {
        p.ctx as u64
    };
    Ok(KernelNode {
        func: p.func as u64,
        grid,
        block,
        shared_mem: p.shared_mem_bytes,
        kernel_params: p.kernel_params as usize,
        extra: p.extra as usize,
        kern: p.kern as usize,
        ctx,
        duration_ns,
    })
}

/// Queues a kernel: it occupies its device exclusively for its duration,
/// after everything already queued on the device, on its stream, and
/// `not_before_ns`. The call returns at once unless the stream already has
/// `QUEUE_DEPTH` kernels outstanding, in which case it sleeps until one
/// finishes. On a capturing stream the kernel is appended to the capture's
/// graph instead (`Ok(None)`); otherwise returns when it ends.
pub(crate) fn enqueue(
    stream: CUstream,
    node: &KernelNode,
    not_before_ns: u64,
) -> Result<Option<u64>, CUresult> {
    if driver::wall_timing() {
        return wall_enqueue(stream, node);
    }
    loop {
        let mut inner = lock();
        let (sref, _, device) = inner.stream(stream)?;
        if let Some(id) = inner.capture_of(sref) {
            inner.capture_append(id, NodeOp::Kernel(*node))?;
            return Ok(None);
        }
        let now = clock::now_ns();
        let timeline = inner.timeline(sref).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        timeline.prune(now);
        if timeline.queue.len() >= QUEUE_DEPTH {
            let first = timeline.queue.front().copied().unwrap_or(now);
            drop(inner);
            driver::wait_until(first);
            continue;
        }
        let not_before = timeline.last_end.max(not_before_ns);
        let duration_ns = crate::config::get()
            .map_or(node.duration_ns, |cfg| cfg.draw_duration(node.duration_ns));
        let (_, end) = driver::shared()?
            .run_kernel(device, not_before, duration_ns)
            .map_err(|_| CUDA_ERROR_LAUNCH_FAILED)?;
        let timeline = inner.timeline(sref).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        timeline.last_end = timeline.last_end.max(end);
        timeline.queue.push_back(end);
        return Ok(Some(end));
    }
}

/// Wall timing: queues a kernel for its device's thread (or appends it to
/// the stream's capture). Returns the device thread's sequence number of
/// the kernel.
pub(crate) fn wall_enqueue(stream: CUstream, node: &KernelNode) -> Result<Option<u64>, CUresult> {
    let device = {
        let mut inner = lock();
        let (sref, _, device) = inner.stream(stream)?;
        if let Some(id) = inner.capture_of(sref) {
            inner.capture_append(id, NodeOp::Kernel(*node))?;
            return Ok(None);
        }
        device
    };
    let device_thread = executor(device).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
    device_thread.wait_for_room();
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    if let Some(id) = inner.capture_of(sref) {
        inner.capture_append(id, NodeOp::Kernel(*node))?;
        return Ok(None);
    }
    let seq = device_thread.submit(Op::Kernel {
        duration_ns: node.duration_ns,
    })?;
    let timeline = inner.timeline(sref).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    timeline.last_seq = seq;
    Ok(Some(seq))
}

twin!(cuLaunchKernel, cuLaunchKernel_ptsz, (
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) {
    launch(
        f,
        [grid_x, grid_y, grid_z],
        [block_x, block_y, block_z],
        shared_mem_bytes,
        kernel_params,
        extra,
        stream,
    )
});

twin!(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, (
    config: *const CUlaunchConfig,
    f: CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) {
    // SAFETY: the caller passes a valid launch config (NULL rejected).
    let c = unsafe { inp(config) }?;
    launch(
        f,
        [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z],
        [c.block_dim_x, c.block_dim_y, c.block_dim_z],
        c.shared_mem_bytes,
        kernel_params,
        extra,
        c.h_stream,
    )
});

twin!(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, (
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
) {
    launch(
        f,
        [grid_x, grid_y, grid_z],
        [block_x, block_y, block_z],
        shared_mem_bytes,
        kernel_params,
        std::ptr::null_mut(),
        stream,
    )
});

cuda_fn! {
    /// One kernel per entry, each on its own stream, on distinct devices.
    /// Unless the flags say otherwise, every kernel starts after the work
    /// queued on all the entries' streams (pre-launch sync) and every
    /// stream's later work waits for all the kernels (post-launch sync).
    /// Capturing streams are not supported (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`).
    fn cuLaunchCooperativeKernelMultiDevice(
        launch_params_list: *mut CUDA_LAUNCH_PARAMS,
        num_devices: c_uint,
        flags: c_uint,
    ) {
        let cfg = check_init()?;
        let known = CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC
            | CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC;
        if launch_params_list.is_null()
            || num_devices == 0
            || num_devices as usize > cfg.devices
            || flags & !known != 0
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut entries = Vec::with_capacity(num_devices as usize);
        for i in 0..num_devices as usize {
            // SAFETY: the caller passes `num_devices` entries.
            entries.push(unsafe { inp(launch_params_list.add(i)) }?);
        }
        let mut nodes = Vec::with_capacity(entries.len());
        let mut devices = Vec::with_capacity(entries.len());
        let mut ready = 0;
        for e in &entries {
            let node = kernel_node(
                e.function,
                [e.grid_dim_x, e.grid_dim_y, e.grid_dim_z],
                [e.block_dim_x, e.block_dim_y, e.block_dim_z],
                e.shared_mem_bytes,
                e.kernel_params,
                std::ptr::null_mut(),
                e.h_stream,
            )?;
            let mut inner = lock();
            let (sref, _, device) = inner.stream(e.h_stream)?;
            if devices.contains(&device) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            devices.push(device);
            if let Some(id) = inner.capture_of(sref) {
                inner.invalidate_capture(id);
                return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            ready = ready.max(inner.timeline(sref).map_or(0, |t| t.last_end));
            nodes.push(node);
        }
        spend_launch_overhead(cfg.launch_overhead_ns);
        if driver::wall_timing() {
            wall_multi_device(&entries, &nodes, &devices, flags)?;
            for e in &entries {
                super::stream::finish_if_blocking(e.h_stream)?;
            }
            return Ok(());
        }
        if flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC != 0 {
            ready = 0;
        }
        let mut done = 0;
        for (e, node) in entries.iter().zip(&nodes) {
            if let Some(end) = enqueue(e.h_stream, node, ready)? {
                done = done.max(end);
            }
        }
        if flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC == 0 {
            let mut inner = lock();
            for e in &entries {
                let (sref, _, _) = inner.stream(e.h_stream)?;
                if let Some(t) = inner.timeline(sref) {
                    t.last_end = t.last_end.max(done);
                }
            }
        }
        for e in &entries {
            super::stream::finish_if_blocking(e.h_stream)?;
        }
        Ok(())
    }
}

/// Wall timing: `cuLaunchCooperativeKernelMultiDevice`'s kernels, each
/// queued for its device's thread; the syncs its flags ask for become waits
/// of each device thread for the others'.
fn wall_multi_device(
    entries: &[CUDA_LAUNCH_PARAMS],
    nodes: &[KernelNode],
    devices: &[usize],
    flags: c_uint,
) -> Result<(), CUresult> {
    let threads = devices
        .iter()
        .map(|&device| executor(device).ok_or(CUDA_ERROR_INVALID_DEVICE))
        .collect::<Result<Vec<_>, _>>()?;
    for thread in &threads {
        thread.wait_for_room();
    }
    let mut inner = lock();
    let mut earlier = Vec::with_capacity(entries.len());
    for e in entries {
        let (sref, _, _) = inner.stream(e.h_stream)?;
        earlier.push(inner.timeline(sref).map_or(0, |t| t.last_seq));
    }
    let pre_sync = flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_PRE_LAUNCH_SYNC == 0;
    let post_sync = flags & CUDA_COOPERATIVE_LAUNCH_MULTI_DEVICE_NO_POST_LAUNCH_SYNC == 0;
    let mut kernels = Vec::with_capacity(entries.len());
    for (i, node) in nodes.iter().enumerate() {
        if pre_sync {
            for (j, &seq) in earlier.iter().enumerate() {
                if j != i && seq > 0 {
                    threads[i].submit(Op::Wait {
                        device: devices[j],
                        seq,
                    })?;
                }
            }
        }
        kernels.push(threads[i].submit(Op::Kernel {
            duration_ns: node.duration_ns,
        })?);
    }
    for (i, e) in entries.iter().enumerate() {
        let mut last = kernels[i];
        if post_sync {
            for (j, &seq) in kernels.iter().enumerate() {
                if j != i {
                    last = threads[i].submit(Op::Wait {
                        device: devices[j],
                        seq,
                    })?;
                }
            }
        }
        let (sref, _, _) = inner.stream(e.h_stream)?;
        if let Some(t) = inner.timeline(sref) {
            t.last_seq = last;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images() {
        let k = parse_image(b"SIMGPU-MODULE\n# c\n\nadd 20us\nbusy 30ms\n").expect("valid");
        assert_eq!(k, vec![("add".into(), 20_000), ("busy".into(), 30_000_000)]);
        assert!(parse_image(b"SIMGPU-MODULE").expect("empty ok").is_empty());
        assert!(parse_image(b"ELF\x7f").is_none());
        assert!(parse_image(b"SIMGPU-MODULE\nadd\n").is_none());
        assert!(parse_image(b"SIMGPU-MODULE\nadd 20 us\n").is_none());
        assert!(parse_image(b"SIMGPU-MODULE\nadd 20parsecs\n").is_none());
    }

    #[test]
    fn dims() {
        assert!(check_dims([1, 1, 1], [1024, 1, 1]).is_ok());
        assert!(check_dims([1, 1, 1], [1025, 1, 1]).is_err());
        assert!(check_dims([0, 1, 1], [1, 1, 1]).is_err());
        assert!(check_dims([1, 1, 1], [32, 32, 2]).is_err());
    }
}
