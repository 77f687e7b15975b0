//! Kernel and graph launches, and stream capture.
//!
//! Each launch is admitted by the compute limiter (which may make the
//! calling thread wait for its container's share) before the real launch.
//! Without a compute cap on the launch's device the limiter returns at once
//! and the launch is forwarded with nothing else done.

use crate::driver::cuda as real;
use crate::driver::cuda::signature;
use crate::enforcer::{mode, Mode};
use crate::limiter::{Flavour, LaunchKey};
use std::ffi::c_void;
use vgpu_cuda_abi::cuda::*;
use vgpu_interpose::Real;

/// Runs `launch` under the container's compute share.
#[inline(always)]
fn limited(
    key: LaunchKey,
    stream: CUstream,
    flavour: Flavour,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    if let Mode::Enforce(enforcer) = mode() {
        if let Some(admission) = enforcer
            .limiter
            .admit(&enforcer.region, key, stream, flavour)
        {
            let code = launch();
            enforcer
                .limiter
                .finish(&enforcer.region, admission, stream, flavour, code);
            return code;
        }
    }
    launch()
}

fn kernel_key(
    function: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
) -> LaunchKey {
    LaunchKey {
        function: function as usize,
        grid: [gx, gy, gz],
        block: [bx, by, bz],
        shared_bytes: shared,
    }
}

#[inline(always)]
pub(crate) unsafe fn cuLaunchKernel(
    driver: Real<signature::cuLaunchKernel>,
    function: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
    limited(key, stream, Flavour::of(driver.per_thread), || {
        // SAFETY: forwarded unchanged.
        unsafe {
            (driver.call)(
                function, gx, gy, gz, bx, by, bz, shared, stream, params, extra,
            )
        }
    })
}

/// Key and stream of a `cuLaunchKernelEx` configuration.
///
/// # Safety
/// `config` must be null or point to a valid launch configuration.
unsafe fn config_key(
    config: *const CUlaunchConfig,
    function: CUfunction,
) -> Option<(LaunchKey, CUstream)> {
    // SAFETY: null or valid per the caller.
    let config = unsafe { config.as_ref() }?;
    Some((
        kernel_key(
            function,
            config.grid_dim_x,
            config.grid_dim_y,
            config.grid_dim_z,
            config.block_dim_x,
            config.block_dim_y,
            config.block_dim_z,
            config.shared_mem_bytes,
        ),
        config.h_stream,
    ))
}

#[inline(always)]
pub(crate) unsafe fn cuLaunchKernelEx(
    driver: Real<signature::cuLaunchKernelEx>,
    config: *const CUlaunchConfig,
    function: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let launch = || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(config, function, params, extra) }
    };
    // SAFETY: the caller's configuration.
    match unsafe { config_key(config, function) } {
        Some((key, stream)) => limited(key, stream, Flavour::of(driver.per_thread), launch),
        None => launch(),
    }
}

#[inline(always)]
pub(crate) unsafe fn cuLaunchCooperativeKernel(
    driver: Real<signature::cuLaunchCooperativeKernel>,
    function: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
    limited(key, stream, Flavour::of(driver.per_thread), || {
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(function, gx, gy, gz, bx, by, bz, shared, stream, params) }
    })
}

/// One kernel per device, each on its own stream: every device is charged
/// for its part (at the learned price; these launches are not timed).
#[inline(always)]
pub(crate) unsafe fn cuLaunchCooperativeKernelMultiDevice(
    driver: Real<signature::cuLaunchCooperativeKernelMultiDevice>,
    launches: *mut CUDA_LAUNCH_PARAMS,
    count: u32,
    flags: u32,
) -> CUresult {
    if let (Mode::Enforce(enforcer), false) = (mode(), launches.is_null()) {
        // SAFETY: the caller passes `count` launch descriptions.
        let entries = unsafe { std::slice::from_raw_parts(launches, count as usize) };
        for entry in entries {
            let mut context: CUcontext = std::ptr::null_mut();
            // SAFETY: the caller's stream; valid out-pointer.
            if unsafe { real::cuStreamGetCtx(entry.h_stream, &mut context) } != CUDA_SUCCESS {
                continue;
            }
            if let Some(device) = enforcer.device_of_context(context as usize) {
                let key = kernel_key(
                    entry.function,
                    entry.grid_dim_x,
                    entry.grid_dim_y,
                    entry.grid_dim_z,
                    entry.block_dim_x,
                    entry.block_dim_y,
                    entry.block_dim_z,
                    entry.shared_mem_bytes,
                );
                enforcer
                    .limiter
                    .charge_untimed(&enforcer.region, device, key);
            }
        }
    }
    // SAFETY: forwarded unchanged.
    unsafe { (driver.call)(launches, count, flags) }
}

#[inline(always)]
pub(crate) unsafe fn cuGraphLaunch(
    driver: Real<signature::cuGraphLaunch>,
    exec: CUgraphExec,
    stream: CUstream,
) -> CUresult {
    limited(
        LaunchKey::graph(exec as usize),
        stream,
        Flavour::of(driver.per_thread),
        || {
            // SAFETY: forwarded unchanged.
            unsafe { (driver.call)(exec, stream) }
        },
    )
}

// ---- Stream capture: while any capture is in progress the limiter checks
// each launch's stream and leaves captured launches alone. ----

fn capture_began(code: CUresult) -> CUresult {
    if let (CUDA_SUCCESS, Mode::Enforce(enforcer)) = (code, mode()) {
        enforcer.limiter.capture_started();
    }
    code
}

fn capture_over(code: CUresult) -> CUresult {
    // A capture ends with success or with one of the capture errors (it is
    // over either way); other errors mean there was no capture to end.
    let ended =
        code == CUDA_SUCCESS || (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED..=908).contains(&code);
    if let (true, Mode::Enforce(enforcer)) = (ended, mode()) {
        enforcer.limiter.capture_ended();
    }
    code
}

/// The CUDA 10.0 form (global capture mode), still exported by CUDA 13's
/// driver and resolved by its runtime: a capture begun through it must stop
/// event timing like any other.
#[inline(always)]
pub(crate) unsafe fn cuStreamBeginCapture(
    driver: Real<signature::cuStreamBeginCapture>,
    stream: CUstream,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    capture_began(unsafe { (driver.call)(stream) })
}

#[inline(always)]
pub(crate) unsafe fn cuStreamBeginCapture_v2(
    driver: Real<signature::cuStreamBeginCapture_v2>,
    stream: CUstream,
    capture_mode: i32,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    capture_began(unsafe { (driver.call)(stream, capture_mode) })
}

#[inline(always)]
pub(crate) unsafe fn cuStreamBeginCaptureToGraph(
    driver: Real<signature::cuStreamBeginCaptureToGraph>,
    stream: CUstream,
    graph: CUgraph,
    dependencies: *const CUgraphNode,
    edges: *const c_void,
    count: usize,
    capture_mode: i32,
) -> CUresult {
    capture_began(
        // SAFETY: forwarded unchanged.
        unsafe { (driver.call)(stream, graph, dependencies, edges, count, capture_mode) },
    )
}

#[inline(always)]
pub(crate) unsafe fn cuStreamEndCapture(
    driver: Real<signature::cuStreamEndCapture>,
    stream: CUstream,
    graph: *mut CUgraph,
) -> CUresult {
    // SAFETY: forwarded unchanged.
    capture_over(unsafe { (driver.call)(stream, graph) })
}
