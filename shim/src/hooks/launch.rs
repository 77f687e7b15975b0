//! Kernel and graph launches, and stream capture.
//!
//! Each launch is admitted by the compute limiter (which may make the
//! calling thread wait for its container's share) before the real launch.
//! Without a compute cap on the launch's device the limiter returns at once
//! and the launch is forwarded with nothing else done.

use crate::driver::cuda as real;
use crate::enforcer::{mode, Mode};
use crate::limiter::{Flavour, LaunchKey};
use std::ffi::c_void;
use vgpu_cuda_abi::cuda::*;

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

#[allow(clippy::too_many_arguments)]
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
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
    guarded!(CUDA_ERROR_UNKNOWN, {
        let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
        limited(key, stream, Flavour::Legacy, || {
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuLaunchKernel(
                    function, gx, gy, gz, bx, by, bz, shared, stream, params, extra,
                )
            }
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
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
    guarded!(CUDA_ERROR_UNKNOWN, {
        let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
        limited(key, stream, Flavour::PerThread, || {
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuLaunchKernel_ptsz(
                    function, gx, gy, gz, bx, by, bz, shared, stream, params, extra,
                )
            }
        })
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    function: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        let launch = || {
            // SAFETY: forwarded unchanged.
            unsafe { real::cuLaunchKernelEx(config, function, params, extra) }
        };
        // SAFETY: the caller's configuration.
        match unsafe { config_key(config, function) } {
            Some((key, stream)) => limited(key, stream, Flavour::Legacy, launch),
            None => launch(),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    function: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        let launch = || {
            // SAFETY: forwarded unchanged.
            unsafe { real::cuLaunchKernelEx_ptsz(config, function, params, extra) }
        };
        // SAFETY: the caller's configuration.
        match unsafe { config_key(config, function) } {
            Some((key, stream)) => limited(key, stream, Flavour::PerThread, launch),
            None => launch(),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
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
    guarded!(CUDA_ERROR_UNKNOWN, {
        let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
        limited(key, stream, Flavour::Legacy, || {
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuLaunchCooperativeKernel(
                    function, gx, gy, gz, bx, by, bz, shared, stream, params,
                )
            }
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
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
    guarded!(CUDA_ERROR_UNKNOWN, {
        let key = kernel_key(function, gx, gy, gz, bx, by, bz, shared);
        limited(key, stream, Flavour::PerThread, || {
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuLaunchCooperativeKernel_ptsz(
                    function, gx, gy, gz, bx, by, bz, shared, stream, params,
                )
            }
        })
    })
}

/// One kernel per device, each on its own stream: every device is charged
/// for its part (at the learned price; these launches are not timed).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernelMultiDevice(
    launches: *mut CUDA_LAUNCH_PARAMS,
    count: u32,
    flags: u32,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
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
        unsafe { real::cuLaunchCooperativeKernelMultiDevice(launches, count, flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        limited(
            LaunchKey::graph(exec as usize),
            stream,
            Flavour::Legacy,
            || {
                // SAFETY: forwarded unchanged.
                unsafe { real::cuGraphLaunch(exec, stream) }
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        limited(
            LaunchKey::graph(exec as usize),
            stream,
            Flavour::PerThread,
            || {
                // SAFETY: forwarded unchanged.
                unsafe { real::cuGraphLaunch_ptsz(exec, stream) }
            },
        )
    })
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: CUstream, capture_mode: i32) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        capture_began(unsafe { real::cuStreamBeginCapture_v2(stream, capture_mode) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(
    stream: CUstream,
    capture_mode: i32,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        capture_began(unsafe { real::cuStreamBeginCapture_v2_ptsz(stream, capture_mode) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph(
    stream: CUstream,
    graph: CUgraph,
    dependencies: *const CUgraphNode,
    edges: *const c_void,
    count: usize,
    capture_mode: i32,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        capture_began(
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuStreamBeginCaptureToGraph(
                    stream,
                    graph,
                    dependencies,
                    edges,
                    count,
                    capture_mode,
                )
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph_ptsz(
    stream: CUstream,
    graph: CUgraph,
    dependencies: *const CUgraphNode,
    edges: *const c_void,
    count: usize,
    capture_mode: i32,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        capture_began(
            // SAFETY: forwarded unchanged.
            unsafe {
                real::cuStreamBeginCaptureToGraph_ptsz(
                    stream,
                    graph,
                    dependencies,
                    edges,
                    count,
                    capture_mode,
                )
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        capture_over(unsafe { real::cuStreamEndCapture(stream, graph) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(
    stream: CUstream,
    graph: *mut CUgraph,
) -> CUresult {
    guarded!(CUDA_ERROR_UNKNOWN, {
        // SAFETY: forwarded unchanged.
        capture_over(unsafe { real::cuStreamEndCapture_ptsz(stream, graph) })
    })
}
