//! Stream capture and CUDA graphs.
//!
//! A graph is a list of operations in the order they were added; launching
//! an instantiated graph runs them in that order on the launch stream, each
//! exactly as if it had been issued at that moment: a kernel occupies its
//! device for its duration after everything queued (by any process), copies
//! and fills happen at once, an event-record node records its event, a
//! wait-event node makes the rest wait. The order is a valid one for every
//! graph: nodes can only depend on nodes added before them, and the device
//! runs one kernel at a time anyway.
//!
//! While a stream captures, kernel launches, async copies and fills on it
//! (and on streams that joined the capture by waiting on an event recorded
//! in it) become nodes and do not run. Synchronising or querying a
//! capturing stream, and stream-ordered allocation on it, fail with
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidate the capture
//! (`cuStreamEndCapture` then fails with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
//! Default streams cannot be captured.
//!
//! Kernel nodes run on the launch stream's device; their `kernelParams` and
//! `extra` arrays are kept as given, not copied.

use std::cell::Cell;
use std::ffi::{c_char, c_uint};
use std::sync::atomic::{AtomicU64, Ordering};

use vgpu_cuda_abi::cuda::*;

use super::module::{enqueue, graph_kernel_node};
use super::{inp, out};
use crate::clock;
use crate::driver::{
    self, check_init, lock, new_handle, Capture, Graph, GraphExec, NodeOp, StreamRef,
};
use crate::executor::{executor, spend_launch_overhead, Executor, Op};
use crate::ffi::write_cstr;

/// Capture sequence ids, unique over the process's life.
static NEXT_CAPTURE_ID: AtomicU64 = AtomicU64::new(1);
/// The edge data handed out with a capture's dependency (all-zero: a plain
/// dependency), `CUgraphEdgeData` is 8 bytes.
static DEFAULT_EDGE: [u8; 8] = [0; 8];

thread_local! {
    /// `cuThreadExchangeStreamCaptureMode`'s per-thread mode.
    static THREAD_MODE: Cell<CUstreamCaptureMode> = const { Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

fn begin_capture(stream: CUstream, mode: CUstreamCaptureMode) -> Result<(), CUresult> {
    check_init()?;
    if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&mode) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let handle = match inner.stream(stream)?.0 {
        StreamRef::Default(_) => return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
        StreamRef::Created(h) => h,
    };
    if inner
        .streams
        .get(&handle)
        .is_some_and(|s| s.capture.is_some())
    {
        return Err(CUDA_ERROR_ILLEGAL_STATE);
    }
    let graph = new_handle();
    inner.graphs.insert(graph, Graph::default());
    let id = NEXT_CAPTURE_ID.fetch_add(1, Ordering::Relaxed);
    inner.captures.insert(
        id,
        Capture {
            graph,
            origin: handle,
            mode,
            thread: std::thread::current().id(),
            invalidated: false,
            last: Box::new(0),
        },
    );
    if let Some(s) = inner.streams.get_mut(&handle) {
        s.capture = Some(id);
    }
    Ok(())
}

twin!(cuStreamBeginCapture, cuStreamBeginCapture_ptsz, (stream: CUstream) {
    begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL)
});

twin!(cuStreamBeginCapture_v2, cuStreamBeginCapture_v2_ptsz, (stream: CUstream, mode: CUstreamCaptureMode) {
    begin_capture(stream, mode)
});

fn end_capture(stream: CUstream, graph_out: *mut CUgraph) -> Result<(), CUresult> {
    check_init()?;
    if graph_out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    let id = inner.capture_of(sref).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    let c = inner.captures.get(&id).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    if StreamRef::Created(c.origin) != sref {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    if c.mode != CU_STREAM_CAPTURE_MODE_RELAXED && c.thread != std::thread::current().id() {
        return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    }
    let c = inner.end_capture(id).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
    if c.invalidated {
        inner.destroy_graph(c.graph);
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(graph_out, std::ptr::null_mut()) }?;
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(graph_out, c.graph as CUgraph) }
}

twin!(cuStreamEndCapture, cuStreamEndCapture_ptsz, (stream: CUstream, graph: *mut CUgraph) {
    end_capture(stream, graph)
});

/// What `cuStreamGetCaptureInfo*` report: (status, id, graph, last node).
fn capture_info(
    stream: CUstream,
) -> Result<(CUstreamCaptureStatus, u64, u64, Option<*const u64>), CUresult> {
    check_init()?;
    let (status, id) = super::stream::capture_status(stream)?;
    let inner = lock();
    match inner.captures.get(&id) {
        Some(c) if status != CU_STREAM_CAPTURE_STATUS_NONE => {
            let last = (*c.last != 0).then_some(&*c.last as *const u64);
            Ok((status, id, c.graph, last))
        }
        _ => Ok((status, 0, 0, None)),
    }
}

/// Writes the optional outputs of `cuStreamGetCaptureInfo_v2`/`_v3`.
///
/// # Safety
/// Every pointer must be NULL or valid for writing one value.
unsafe fn write_capture_info(
    stream: CUstream,
    status_out: *mut CUstreamCaptureStatus,
    id_out: *mut u64,
    graph_out: *mut CUgraph,
    deps_out: *mut *const CUgraphNode,
    edges_out: *mut *const u8,
    count_out: *mut usize,
) -> Result<(), CUresult> {
    if status_out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (status, id, graph, last) = capture_info(stream)?;
    let deps = last.map_or(std::ptr::null(), |p| p.cast::<CUgraphNode>());
    let edges = last.map_or(std::ptr::null(), |_| DEFAULT_EDGE.as_ptr());
    // SAFETY: C API out-pointers; each optional one is written only when
    // non-NULL (the caller's contract).
    unsafe {
        out(status_out, status)?;
        if !id_out.is_null() {
            out(id_out, id)?;
        }
        if !graph_out.is_null() {
            out(graph_out, graph as CUgraph)?;
        }
        if !deps_out.is_null() {
            out(deps_out, deps)?;
        }
        if !edges_out.is_null() {
            out(edges_out, edges)?;
        }
        if !count_out.is_null() {
            out(count_out, usize::from(last.is_some()))?;
        }
    }
    Ok(())
}

twin!(cuStreamGetCaptureInfo, cuStreamGetCaptureInfo_ptsz, (
    stream: CUstream,
    status: *mut CUstreamCaptureStatus,
    id: *mut u64,
) {
    let null = std::ptr::null_mut();
    // SAFETY: C API out-pointers from the caller.
    unsafe { write_capture_info(stream, status, id, null, null.cast(), null.cast(), null.cast()) }
});

twin!(cuStreamGetCaptureInfo_v2, cuStreamGetCaptureInfo_v2_ptsz, (
    stream: CUstream,
    status: *mut CUstreamCaptureStatus,
    id: *mut u64,
    graph: *mut CUgraph,
    dependencies: *mut *const CUgraphNode,
    num_dependencies: *mut usize,
) {
    // SAFETY: C API out-pointers from the caller.
    unsafe {
        write_capture_info(
            stream,
            status,
            id,
            graph,
            dependencies,
            std::ptr::null_mut(),
            num_dependencies,
        )
    }
});

twin!(cuStreamGetCaptureInfo_v3, cuStreamGetCaptureInfo_v3_ptsz, (
    stream: CUstream,
    status: *mut CUstreamCaptureStatus,
    id: *mut u64,
    graph: *mut CUgraph,
    dependencies: *mut *const CUgraphNode,
    edge_data: *mut *const u8,
    num_dependencies: *mut usize,
) {
    // SAFETY: C API out-pointers from the caller.
    unsafe {
        write_capture_info(stream, status, id, graph, dependencies, edge_data, num_dependencies)
    }
});

cuda_fn! {
    /// Swaps the calling thread's capture mode (kept, not enforced).
    fn cuThreadExchangeStreamCaptureMode(mode: *mut CUstreamCaptureMode) {
        // SAFETY: C API in/out pointer (NULL rejected).
        let new = unsafe { inp(mode) }?;
        if !(CU_STREAM_CAPTURE_MODE_GLOBAL..=CU_STREAM_CAPTURE_MODE_RELAXED).contains(&new) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let old = THREAD_MODE.with(|m| m.replace(new));
        // SAFETY: as above.
        unsafe { out(mode, old) }
    }
}

cuda_fn! {
    fn cuGraphCreate(graph: *mut CUgraph, flags: c_uint) {
        check_init()?;
        if graph.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = new_handle();
        lock().graphs.insert(handle, Graph::default());
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(graph, handle as CUgraph) }
    }
}

cuda_fn! {
    fn cuGraphDestroy(graph: CUgraph) {
        check_init()?;
        if lock().destroy_graph(graph as u64) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

fn add_kernel_node(
    node_out: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    num_deps: usize,
    params: CUDA_KERNEL_NODE_PARAMS_v2,
) -> Result<(), CUresult> {
    check_init()?;
    if node_out.is_null() || (deps.is_null() && num_deps > 0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let node = graph_kernel_node(&params)?;
    let mut inner = lock();
    if !inner.graphs.contains_key(&(graph as u64)) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for i in 0..num_deps {
        // SAFETY: the caller passes `num_deps` node handles.
        let dep = unsafe { inp(deps.add(i)) }? as u64;
        if inner
            .graph_nodes
            .get(&dep)
            .is_none_or(|n| n.graph != graph as u64)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    }
    let handle = inner.add_node(graph as u64, NodeOp::Kernel(node))?;
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(node_out, handle as CUgraphNode) }
}

cuda_fn! {
    fn cuGraphAddKernelNode(
        node: *mut CUgraphNode,
        graph: CUgraph,
        dependencies: *const CUgraphNode,
        num_dependencies: usize,
        params: *const CUDA_KERNEL_NODE_PARAMS_v1,
    ) {
        // SAFETY: C API in-pointer (NULL rejected).
        let p = unsafe { inp(params) }?;
        let v2 = CUDA_KERNEL_NODE_PARAMS_v2 {
            func: p.func,
            grid_dim_x: p.grid_dim_x,
            grid_dim_y: p.grid_dim_y,
            grid_dim_z: p.grid_dim_z,
            block_dim_x: p.block_dim_x,
            block_dim_y: p.block_dim_y,
            block_dim_z: p.block_dim_z,
            shared_mem_bytes: p.shared_mem_bytes,
            kernel_params: p.kernel_params,
            extra: p.extra,
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        add_kernel_node(node, graph, dependencies, num_dependencies, v2)
    }
}

cuda_fn! {
    fn cuGraphAddKernelNode_v2(
        node: *mut CUgraphNode,
        graph: CUgraph,
        dependencies: *const CUgraphNode,
        num_dependencies: usize,
        params: *const CUDA_KERNEL_NODE_PARAMS_v2,
    ) {
        // SAFETY: C API in-pointer (NULL rejected).
        let p = unsafe { inp(params) }?;
        add_kernel_node(node, graph, dependencies, num_dependencies, p)
    }
}

cuda_fn! {
    /// Nodes in the order they run. With room for more than there are, the
    /// rest of the array is set to NULL; `num_nodes` returns how many were
    /// written (or, with a NULL array, how many there are).
    fn cuGraphGetNodes(graph: CUgraph, nodes: *mut CUgraphNode, num_nodes: *mut usize) {
        check_init()?;
        let inner = lock();
        let g = inner.graphs.get(&(graph as u64)).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if nodes.is_null() {
            // SAFETY: C API out-pointer.
            return unsafe { out(num_nodes, g.nodes.len()) };
        }
        // SAFETY: C API in/out pointer.
        let room = unsafe { inp(num_nodes) }?;
        for i in 0..room {
            let n = g.nodes.get(i).copied().unwrap_or(0);
            // SAFETY: the caller's array holds `room` entries.
            unsafe { out(nodes.add(i), n as CUgraphNode) }?;
        }
        // SAFETY: as above.
        unsafe { out(num_nodes, room.min(g.nodes.len())) }
    }
}

cuda_fn! {
    fn cuGraphNodeGetType(node: CUgraphNode, node_type: *mut CUgraphNodeType) {
        check_init()?;
        let t = lock()
            .graph_nodes
            .get(&(node as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .op
            .node_type();
        // SAFETY: C API out-pointer.
        unsafe { out(node_type, t) }
    }
}

/// The parameters of a kernel node.
fn kernel_params(node: CUgraphNode) -> Result<CUDA_KERNEL_NODE_PARAMS_v2, CUresult> {
    check_init()?;
    let inner = lock();
    let n = inner
        .graph_nodes
        .get(&(node as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let NodeOp::Kernel(k) = n.op else {
        return Err(CUDA_ERROR_INVALID_VALUE);
    };
    Ok(CUDA_KERNEL_NODE_PARAMS_v2 {
        func: k.func as CUfunction,
        grid_dim_x: k.grid[0],
        grid_dim_y: k.grid[1],
        grid_dim_z: k.grid[2],
        block_dim_x: k.block[0],
        block_dim_y: k.block[1],
        block_dim_z: k.block[2],
        shared_mem_bytes: k.shared_mem,
        kernel_params: k.kernel_params as *mut *mut std::ffi::c_void,
        extra: k.extra as *mut *mut std::ffi::c_void,
        kern: k.kern as CUkernel,
        ctx: k.ctx as CUcontext,
    })
}

cuda_fn! {
    fn cuGraphKernelNodeGetParams(node: CUgraphNode, params: *mut CUDA_KERNEL_NODE_PARAMS_v1) {
        let p = kernel_params(node)?;
        let v1 = CUDA_KERNEL_NODE_PARAMS_v1 {
            func: p.func,
            grid_dim_x: p.grid_dim_x,
            grid_dim_y: p.grid_dim_y,
            grid_dim_z: p.grid_dim_z,
            block_dim_x: p.block_dim_x,
            block_dim_y: p.block_dim_y,
            block_dim_z: p.block_dim_z,
            shared_mem_bytes: p.shared_mem_bytes,
            kernel_params: p.kernel_params,
            extra: p.extra,
        };
        // SAFETY: C API out-pointer.
        unsafe { out(params, v1) }
    }
}

cuda_fn! {
    fn cuGraphKernelNodeGetParams_v2(node: CUgraphNode, params: *mut CUDA_KERNEL_NODE_PARAMS_v2) {
        let p = kernel_params(node)?;
        // SAFETY: C API out-pointer.
        unsafe { out(params, p) }
    }
}

/// Instantiates a graph: a snapshot of its operations, in order.
fn instantiate(exec_out: *mut CUgraphExec, graph: CUgraph, flags: u64) -> Result<(), CUresult> {
    check_init()?;
    let known = CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
        | CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD
        | CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
        | CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
    if exec_out.is_null() || flags & !known != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let g = inner
        .graphs
        .get(&(graph as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let ops = g
        .nodes
        .iter()
        .filter_map(|n| inner.graph_nodes.get(n).map(|n| n.op))
        .collect();
    let handle = new_handle();
    inner.graph_execs.insert(handle, GraphExec { ops });
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(exec_out, handle as CUgraphExec) }
}

/// The CUDA 10.0 / 11.0 signature: no error node, an empty log.
fn instantiate_with_log(
    exec_out: *mut CUgraphExec,
    graph: CUgraph,
    error_node: *mut CUgraphNode,
    log: *mut c_char,
    log_size: usize,
) -> Result<(), CUresult> {
    if !error_node.is_null() {
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(error_node, std::ptr::null_mut()) }?;
    }
    // SAFETY: the caller's buffer holds `log_size` bytes (or is NULL).
    unsafe { write_cstr(log, log_size, "", true) };
    instantiate(exec_out, graph, 0)
}

cuda_fn! {
    fn cuGraphInstantiate(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        error_node: *mut CUgraphNode,
        log: *mut c_char,
        log_size: usize,
    ) {
        instantiate_with_log(exec, graph, error_node, log, log_size)
    }
}

cuda_fn! {
    fn cuGraphInstantiate_v2(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        error_node: *mut CUgraphNode,
        log: *mut c_char,
        log_size: usize,
    ) {
        instantiate_with_log(exec, graph, error_node, log, log_size)
    }
}

cuda_fn! {
    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) {
        instantiate(exec, graph, flags)
    }
}

twin!(cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz, (
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) {
    // SAFETY: C API in/out pointer (NULL rejected).
    let mut p = unsafe { inp(params) }?;
    let result = instantiate(exec, graph, p.flags);
    p.h_err_node_out = std::ptr::null_mut();
    p.result_out = if result.is_ok() {
        CUDA_GRAPH_INSTANTIATE_SUCCESS
    } else {
        CUDA_GRAPH_INSTANTIATE_ERROR
    };
    // SAFETY: as above.
    unsafe { out(params, p) }?;
    result
});

cuda_fn! {
    fn cuGraphExecDestroy(exec: CUgraphExec) {
        check_init()?;
        lock()
            .graph_execs
            .remove(&(exec as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }
}

twin!(cuGraphUpload, cuGraphUpload_ptsz, (exec: CUgraphExec, stream: CUstream) {
    check_init()?;
    let inner = lock();
    inner.stream(stream)?;
    if inner.graph_execs.contains_key(&(exec as u64)) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
});

/// Runs an instantiated graph on a stream, or, on a capturing stream,
/// appends its operations to the capture.
fn graph_launch(exec: CUgraphExec, stream: CUstream) -> Result<(), CUresult> {
    let cfg = check_init()?;
    spend_launch_overhead(cfg.launch_overhead_ns);
    let ops = {
        let mut inner = lock();
        let ops = inner
            .graph_execs
            .get(&(exec as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .ops
            .clone();
        let (sref, _, _) = inner.stream(stream)?;
        if let Some(id) = inner.capture_of(sref) {
            for op in ops {
                inner.capture_append(id, op)?;
            }
            return Ok(());
        }
        ops
    };
    if driver::wall_timing() {
        wall_graph_launch(stream, &ops)?;
        return super::stream::finish_if_blocking(stream);
    }
    for op in &ops {
        if let NodeOp::Kernel(k) = op {
            enqueue(stream, k, 0)?;
            continue;
        }
        let mut inner = lock();
        let (sref, _, _) = inner.stream(stream)?;
        match *op {
            NodeOp::Kernel(_) => {}
            NodeOp::Memcpy { dst, src, bytes } => super::mem::replay_copy(&inner, dst, src, bytes)?,
            NodeOp::Memset {
                dst,
                value,
                elem,
                count,
            } => super::mem::replay_fill(&inner, dst, value, elem, count)?,
            NodeOp::EventRecord(e) => {
                let last = inner.timeline(sref).map_or(0, |t| t.last_end);
                if let Some(ev) = inner.events.get_mut(&e) {
                    ev.time = Some(last.max(clock::now_ns()));
                    ev.captured = None;
                }
            }
            NodeOp::EventWait(e) => {
                let time = inner.events.get(&e).and_then(|ev| ev.time);
                if let (Some(t), Some(timeline)) = (time, inner.timeline(sref)) {
                    timeline.last_end = timeline.last_end.max(t);
                }
            }
        }
    }
    super::stream::finish_if_blocking(stream)
}

/// Wall timing: a graph's kernels, event records and cross-device waits
/// reach its stream's device thread together, at the end of the launch (a
/// GPU runs an uploaded graph from one submission); its copies and fills
/// are made at once, as every simulated copy is.
fn wall_graph_launch(stream: CUstream, ops: &[NodeOp]) -> Result<(), CUresult> {
    let device = lock().stream(stream)?.2;
    let thread = device_thread(device)?;
    thread.wait_for_room();
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    let mut batch = Vec::with_capacity(ops.len());
    // Each record's place in the batch, to mark the event pending once the
    // batch has its sequence numbers.
    let mut records = Vec::new();
    for op in ops {
        match *op {
            NodeOp::Kernel(k) => batch.push(Op::Kernel {
                duration_ns: k.duration_ns,
            }),
            NodeOp::Memcpy { dst, src, bytes } => super::mem::replay_copy(&inner, dst, src, bytes)?,
            NodeOp::Memset {
                dst,
                value,
                elem,
                count,
            } => super::mem::replay_fill(&inner, dst, value, elem, count)?,
            NodeOp::EventRecord(e) => {
                records.push((e, batch.len()));
                batch.push(Op::Record { event: e });
            }
            NodeOp::EventWait(e) => {
                // Work queued on one device runs in order: only another
                // device's event needs a wait.
                if let Some((event_device, seq)) = inner.events.get(&e).and_then(|ev| ev.pending) {
                    if event_device != device {
                        batch.push(Op::Wait {
                            device: event_device,
                            seq,
                        });
                    }
                }
            }
        }
    }
    if batch.is_empty() {
        return Ok(());
    }
    let last = thread.submit_all(&batch)?;
    let first = last + 1 - batch.len() as u64;
    for (event, index) in records {
        if let Some(ev) = inner.events.get_mut(&event) {
            ev.time = None;
            ev.captured = None;
            ev.pending = Some((device, first + index as u64));
        }
    }
    if let Some(timeline) = inner.timeline(sref) {
        timeline.last_seq = last;
    }
    Ok(())
}

/// Wall timing: the thread of this process's device `device`.
fn device_thread(device: usize) -> Result<&'static Executor, CUresult> {
    executor(device).ok_or(CUDA_ERROR_INVALID_DEVICE)
}

twin!(cuGraphLaunch, cuGraphLaunch_ptsz, (exec: CUgraphExec, stream: CUstream) {
    graph_launch(exec, stream)
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Exchanges the calling thread's capture mode.
    fn exchange(mode: CUstreamCaptureMode) -> (CUresult, CUstreamCaptureMode) {
        let mut m = mode;
        // SAFETY: a valid in/out pointer to a local.
        let r = unsafe { cuThreadExchangeStreamCaptureMode(&mut m) };
        (r, m)
    }

    #[test]
    fn thread_capture_mode_is_exchanged() {
        assert_eq!(
            exchange(CU_STREAM_CAPTURE_MODE_RELAXED),
            (CUDA_SUCCESS, CU_STREAM_CAPTURE_MODE_GLOBAL)
        );
        assert_eq!(
            exchange(CU_STREAM_CAPTURE_MODE_GLOBAL),
            (CUDA_SUCCESS, CU_STREAM_CAPTURE_MODE_RELAXED)
        );
        assert_eq!(exchange(7).0, CUDA_ERROR_INVALID_VALUE);
    }
}
