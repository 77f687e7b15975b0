//! Scenarios for stream capture, graphs, the multi-device cooperative
//! launch and the busy-time test hooks (see `scenarios.rs` for how they run).

use std::ffi::{c_char, c_void, CString};
use std::ptr::{null, null_mut};

use vgpu_cuda_abi::cuda::*;

use crate::common::*;
use crate::scenarios::{alloc, context, env_u64, function, launch, load, load_module};

const MS: u64 = 1_000_000;

fn stream(cu: &Cu) -> CUstream {
    let mut s = null_mut();
    ok(cu.cuStreamCreate(&mut s, 0), "cuStreamCreate");
    s
}

fn event(cu: &Cu) -> CUevent {
    let mut e = null_mut();
    ok(cu.cuEventCreate(&mut e, 0), "cuEventCreate");
    e
}

fn capturing(cu: &Cu, s: CUstream) -> CUstreamCaptureStatus {
    let mut st = -1;
    ok(cu.cuStreamIsCapturing(s, &mut st), "cuStreamIsCapturing");
    st
}

fn nodes(cu: &Cu, g: CUgraph) -> Vec<CUgraphNode> {
    let mut n = 0;
    ok(cu.cuGraphGetNodes(g, null_mut(), &mut n), "cuGraphGetNodes");
    let mut v = vec![null_mut(); n];
    ok(
        cu.cuGraphGetNodes(g, v.as_mut_ptr(), &mut n),
        "cuGraphGetNodes",
    );
    v.truncate(n);
    v
}

fn node_type(cu: &Cu, n: CUgraphNode) -> CUgraphNodeType {
    let mut t = -1;
    ok(cu.cuGraphNodeGetType(n, &mut t), "cuGraphNodeGetType");
    t
}

fn read_u32(cu: &Cu, p: CUdeviceptr, n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    ok(
        cu.cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, n * 4),
        "cuMemcpyDtoH",
    );
    v
}

/// Capture three 10 ms kernels and a memset, replay the graph: nothing runs
/// during capture, the replay takes 30 ms of device time, events around it
/// measure it. Then invalidation, the default stream, and fork/join.
pub fn graph_capture() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk10 10ms\nk1 1ms\n");
    let (k10, k1) = (function(&cu, m, "k10"), function(&cu, m, "k1"));
    let s = stream(&cu);
    let me = std::process::id();
    let p = alloc(&cu, 4096);
    ok(cu.cuMemsetD32_v2(p, 0, 1024), "cuMemsetD32");

    assert_eq!(capturing(&cu, s), CU_STREAM_CAPTURE_STATUS_NONE);
    let mut st = -1;
    let mut id = 99u64;
    let mut graph: CUgraph = std::ptr::dangling_mut();
    let mut deps: *const CUgraphNode = std::ptr::dangling();
    let mut ndeps = 99usize;
    ok(
        cu.cuStreamGetCaptureInfo_v2(s, &mut st, &mut id, &mut graph, &mut deps, &mut ndeps),
        "cuStreamGetCaptureInfo_v2",
    );
    assert_eq!((st, id, graph, deps, ndeps), (0, 0, null_mut(), null(), 0));

    let busy_before = cu.simgpu_device_busy_ns(0);
    let mine_before = cu.simgpu_process_busy_ns(0, me);
    ok(
        cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
        "cuStreamBeginCapture_v2",
    );
    assert_eq!(
        cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
        CUDA_ERROR_ILLEGAL_STATE,
        "already capturing"
    );
    assert_eq!(capturing(&cu, s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    let start = mono_ns();
    for _ in 0..3 {
        ok(launch(&cu, k10, s), "captured launch");
    }
    ok(cu.cuMemsetD32Async(p, 7, 1024, s), "captured memset");
    ok(
        cu.cuStreamGetCaptureInfo_v2(s, &mut st, &mut id, &mut graph, &mut deps, &mut ndeps),
        "cuStreamGetCaptureInfo_v2",
    );
    assert_eq!(st, CU_STREAM_CAPTURE_STATUS_ACTIVE);
    assert_ne!(id, 0);
    assert!(!graph.is_null());
    assert_eq!(ndeps, 1);
    // SAFETY: one dependency, valid until the next capture call.
    let last = unsafe { *deps };
    std::thread::sleep(std::time::Duration::from_millis(15));
    assert!(mono_ns() - start >= 15 * MS);
    assert_eq!(
        cu.simgpu_device_busy_ns(0),
        busy_before,
        "captured kernels do not run"
    );
    assert_eq!(cu.simgpu_process_busy_ns(0, me), mine_before);
    assert_eq!(
        read_u32(&cu, p, 4),
        [0; 4],
        "a captured memset does not run"
    );

    let mut g = null_mut();
    ok(cu.cuStreamEndCapture(s, &mut g), "cuStreamEndCapture");
    assert_eq!(g, graph);
    assert_eq!(capturing(&cu, s), CU_STREAM_CAPTURE_STATUS_NONE);
    assert_eq!(
        cu.cuStreamEndCapture(s, &mut g),
        CUDA_ERROR_ILLEGAL_STATE,
        "not capturing any more"
    );
    let list = nodes(&cu, g);
    assert_eq!(list.len(), 4);
    assert_eq!(list[3], last);
    let types: Vec<_> = list.iter().map(|&n| node_type(&cu, n)).collect();
    assert_eq!(
        types,
        [
            CU_GRAPH_NODE_TYPE_KERNEL,
            CU_GRAPH_NODE_TYPE_KERNEL,
            CU_GRAPH_NODE_TYPE_KERNEL,
            CU_GRAPH_NODE_TYPE_MEMSET
        ]
    );
    let mut kp: CUDA_KERNEL_NODE_PARAMS_v2 = params(null_mut());
    ok(
        cu.cuGraphKernelNodeGetParams_v2(list[0], &mut kp),
        "cuGraphKernelNodeGetParams_v2",
    );
    assert_eq!(kp.func, k10);
    assert_eq!(
        (kp.grid_dim_x, kp.block_dim_x, kp.block_dim_y),
        (1, 32, 1),
        "the launch's dimensions"
    );

    let mut exec = null_mut();
    ok(
        cu.cuGraphInstantiateWithFlags(&mut exec, g, 0),
        "cuGraphInstantiateWithFlags",
    );
    let (e0, e1) = (event(&cu), event(&cu));
    ok(cu.cuEventRecord(e0, s), "record");
    let t0 = mono_ns();
    ok(cu.cuGraphLaunch(exec, s), "cuGraphLaunch");
    assert!(mono_ns() - t0 < 10 * MS, "graph launch is asynchronous");
    ok(cu.cuEventRecord(e1, s), "record");
    ok(cu.cuEventSynchronize(e1), "cuEventSynchronize");
    assert!(mono_ns() - t0 >= 30 * MS, "three 10 ms kernels");
    let mut ms = 0f32;
    ok(cu.cuEventElapsedTime(&mut ms, e0, e1), "cuEventElapsedTime");
    assert!((29.9..=35.0).contains(&ms), "graph took {ms} ms");
    assert_eq!(cu.simgpu_device_busy_ns(0) - busy_before, 30 * MS);
    assert_eq!(cu.simgpu_process_busy_ns(0, me) - mine_before, 30 * MS);
    assert_eq!(read_u32(&cu, p, 4), [7; 4], "the memset node ran");

    // Replays queue behind each other like ordinary launches.
    ok(cu.cuGraphLaunch(exec, s), "cuGraphLaunch");
    ok(cu.cuGraphLaunch(exec, s), "cuGraphLaunch");
    ok(cu.cuStreamSynchronize(s), "cuStreamSynchronize");
    assert_eq!(cu.simgpu_device_busy_ns(0) - busy_before, 90 * MS);

    // Synchronising a capturing stream fails and invalidates the capture.
    ok(
        cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_RELAXED),
        "begin",
    );
    ok(launch(&cu, k1, s), "captured launch");
    assert_eq!(
        cu.cuStreamSynchronize(s),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(capturing(&cu, s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    assert_eq!(launch(&cu, k1, s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    let mut bad: CUgraph = std::ptr::dangling_mut();
    assert_eq!(
        cu.cuStreamEndCapture(s, &mut bad),
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    );
    assert!(bad.is_null());
    assert_eq!(capturing(&cu, s), CU_STREAM_CAPTURE_STATUS_NONE);
    ok(launch(&cu, k1, s), "the stream works again");
    ok(cu.cuStreamSynchronize(s), "sync");

    // The default stream cannot be captured.
    assert_eq!(
        cu.cuStreamBeginCapture_v2(null_mut(), CU_STREAM_CAPTURE_MODE_GLOBAL),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(capturing(&cu, null_mut()), CU_STREAM_CAPTURE_STATUS_NONE);

    // Fork and join through events: the second stream joins the capture.
    let s2 = stream(&cu);
    let (fork, join) = (event(&cu), event(&cu));
    let busy = cu.simgpu_device_busy_ns(0);
    ok(
        cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
        "begin",
    );
    ok(launch(&cu, k1, s), "launch");
    ok(cu.cuEventRecord(fork, s), "record fork");
    assert_eq!(cu.cuEventQuery(fork), CUDA_ERROR_CAPTURED_EVENT);
    ok(cu.cuStreamWaitEvent(s2, fork, 0), "wait fork");
    assert_eq!(capturing(&cu, s2), CU_STREAM_CAPTURE_STATUS_ACTIVE);
    ok(launch(&cu, k10, s2), "launch on the forked stream");
    ok(cu.cuEventRecord(join, s2), "record join");
    ok(cu.cuStreamWaitEvent(s, join, 0), "wait join");
    let mut unmatched = null_mut();
    assert_eq!(
        cu.cuStreamEndCapture(s2, &mut unmatched),
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
    );
    let mut g2 = null_mut();
    ok(cu.cuStreamEndCapture(s, &mut g2), "end");
    assert_eq!(capturing(&cu, s2), CU_STREAM_CAPTURE_STATUS_NONE);
    assert_eq!(nodes(&cu, g2).len(), 2);
    assert_eq!(cu.simgpu_device_busy_ns(0), busy, "nothing ran");
    let mut exec2 = null_mut();
    ok(
        cu.cuGraphInstantiateWithFlags(&mut exec2, g2, 0),
        "instantiate",
    );
    ok(cu.cuGraphLaunch(exec2, s2), "launch");
    ok(cu.cuStreamSynchronize(s2), "sync");
    assert_eq!(cu.simgpu_device_busy_ns(0) - busy, 11 * MS);

    ok(cu.cuGraphExecDestroy(exec), "cuGraphExecDestroy");
    ok(cu.cuGraphExecDestroy(exec2), "cuGraphExecDestroy");
    assert_eq!(cu.cuGraphLaunch(exec, s), CUDA_ERROR_INVALID_VALUE);
    ok(cu.cuGraphDestroy(g), "cuGraphDestroy");
    ok(cu.cuGraphDestroy(g2), "cuGraphDestroy");
    assert_eq!(cu.cuGraphDestroy(g), CUDA_ERROR_INVALID_VALUE);
}

fn params(func: CUfunction) -> CUDA_KERNEL_NODE_PARAMS_v2 {
    CUDA_KERNEL_NODE_PARAMS_v2 {
        func,
        grid_dim_x: 1,
        grid_dim_y: 1,
        grid_dim_z: 1,
        block_dim_x: 1,
        block_dim_y: 1,
        block_dim_z: 1,
        shared_mem_bytes: 0,
        kernel_params: null_mut(),
        extra: null_mut(),
        kern: null_mut(),
        ctx: null_mut(),
    }
}

/// An explicit graph of two kernel nodes: nodes, types and parameters
/// round-trip; launching it runs both. Also the cuGetProcAddress entries.
pub fn graph_explicit() {
    let (lib, cu) = load();
    let ctx = context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk10 10ms\nk1 1ms\n");
    let (k10, k1) = (function(&cu, m, "k10"), function(&cu, m, "k1"));
    let mut g = null_mut();
    assert_eq!(cu.cuGraphCreate(&mut g, 1), CUDA_ERROR_INVALID_VALUE);
    ok(cu.cuGraphCreate(&mut g, 0), "cuGraphCreate");
    assert!(nodes(&cu, g).is_empty());

    let mut arg = 5u32;
    let mut args: [*mut c_void; 1] = [(&mut arg as *mut u32).cast()];
    let p1 = CUDA_KERNEL_NODE_PARAMS_v2 {
        grid_dim_x: 2,
        grid_dim_y: 3,
        grid_dim_z: 4,
        block_dim_x: 32,
        block_dim_y: 2,
        shared_mem_bytes: 128,
        kernel_params: args.as_mut_ptr(),
        ..params(k10)
    };
    let mut n1 = null_mut();
    ok(
        cu.cuGraphAddKernelNode_v2(&mut n1, g, null(), 0, &p1),
        "cuGraphAddKernelNode_v2",
    );
    let mut n2 = null_mut();
    ok(
        cu.cuGraphAddKernelNode_v2(&mut n2, g, &n1, 1, &params(k1)),
        "cuGraphAddKernelNode_v2",
    );
    let bad_dims = CUDA_KERNEL_NODE_PARAMS_v2 {
        block_dim_x: 2048,
        ..params(k1)
    };
    let mut n3 = null_mut();
    assert_eq!(
        cu.cuGraphAddKernelNode_v2(&mut n3, g, null(), 0, &bad_dims),
        CUDA_ERROR_INVALID_VALUE
    );
    let mut other = null_mut();
    ok(cu.cuGraphCreate(&mut other, 0), "cuGraphCreate");
    assert_eq!(
        cu.cuGraphAddKernelNode_v2(&mut n3, other, &n1, 1, &params(k1)),
        CUDA_ERROR_INVALID_VALUE,
        "a dependency from another graph"
    );

    let mut n = 0;
    ok(cu.cuGraphGetNodes(g, null_mut(), &mut n), "count");
    assert_eq!(n, 2);
    let mut room: [CUgraphNode; 3] = [std::ptr::dangling_mut(); 3];
    n = 3;
    ok(cu.cuGraphGetNodes(g, room.as_mut_ptr(), &mut n), "nodes");
    assert_eq!((n, room), (2, [n1, n2, null_mut()]));
    n = 1;
    ok(cu.cuGraphGetNodes(g, room.as_mut_ptr(), &mut n), "one node");
    assert_eq!((n, room[0]), (1, n1));
    assert_eq!(node_type(&cu, n1), CU_GRAPH_NODE_TYPE_KERNEL);
    assert_eq!(node_type(&cu, n2), CU_GRAPH_NODE_TYPE_KERNEL);

    let mut back = params(null_mut());
    ok(
        cu.cuGraphKernelNodeGetParams_v2(n1, &mut back),
        "cuGraphKernelNodeGetParams_v2",
    );
    assert_eq!(back.func, k10);
    assert_eq!(
        (back.grid_dim_x, back.grid_dim_y, back.grid_dim_z),
        (2, 3, 4)
    );
    assert_eq!(
        (back.block_dim_x, back.block_dim_y, back.block_dim_z),
        (32, 2, 1)
    );
    assert_eq!(back.shared_mem_bytes, 128);
    assert_eq!(back.kernel_params, args.as_mut_ptr());
    assert!(back.extra.is_null() && back.kern.is_null());
    assert_eq!(back.ctx, ctx, "the current context");
    ok(cu.cuGraphKernelNodeGetParams_v2(n2, &mut back), "params");
    assert_eq!(back.func, k1);

    let mut exec = null_mut();
    let mut err_node: CUgraphNode = std::ptr::dangling_mut();
    let mut log = [b'x' as c_char; 16];
    ok(
        cu.cuGraphInstantiate_v2(&mut exec, g, &mut err_node, log.as_mut_ptr(), log.len()),
        "cuGraphInstantiate_v2",
    );
    assert!(err_node.is_null());
    assert_eq!(log[0], 0, "empty log");
    let s = stream(&cu);
    let before = cu.simgpu_device_busy_ns(0);
    let t0 = mono_ns();
    ok(cu.cuGraphLaunch(exec, s), "cuGraphLaunch");
    ok(cu.cuStreamSynchronize(s), "sync");
    assert!(mono_ns() - t0 >= 11 * MS);
    assert_eq!(cu.simgpu_device_busy_ns(0) - before, 11 * MS);
    ok(cu.cuGraphExecDestroy(exec), "destroy exec");
    ok(cu.cuGraphDestroy(g), "destroy");
    ok(cu.cuGraphDestroy(other), "destroy");
    assert_eq!(
        cu.cuGraphNodeGetType(n1, &mut 0),
        CUDA_ERROR_INVALID_VALUE,
        "nodes go with their graph"
    );

    // cuGetProcAddress resolves the graph API by version.
    let resolve = |name: &str, version: i32, flags: u64| {
        let sym = CString::new(name).expect("name");
        let mut pfn = null_mut();
        ok(
            cu.cuGetProcAddress_v2(sym.as_ptr(), &mut pfn, version, flags, null_mut()),
            name,
        );
        pfn as usize
    };
    for (name, version, flags, want) in [
        ("cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture"),
        ("cuStreamBeginCapture", 12080, 0, "cuStreamBeginCapture_v2"),
        (
            "cuStreamBeginCapture",
            12080,
            2,
            "cuStreamBeginCapture_v2_ptsz",
        ),
        ("cuStreamGetCaptureInfo", 11020, 0, "cuStreamGetCaptureInfo"),
        (
            "cuStreamGetCaptureInfo",
            12000,
            0,
            "cuStreamGetCaptureInfo_v2",
        ),
        (
            "cuStreamGetCaptureInfo",
            12080,
            2,
            "cuStreamGetCaptureInfo_v3_ptsz",
        ),
        ("cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"),
        ("cuGraphInstantiate", 11080, 0, "cuGraphInstantiate_v2"),
        (
            "cuGraphInstantiate",
            12000,
            0,
            "cuGraphInstantiateWithFlags",
        ),
        (
            "cuGraphInstantiateWithFlags",
            11040,
            0,
            "cuGraphInstantiateWithFlags",
        ),
        ("cuGraphAddKernelNode", 11080, 0, "cuGraphAddKernelNode"),
        ("cuGraphAddKernelNode", 12080, 0, "cuGraphAddKernelNode_v2"),
        (
            "cuGraphKernelNodeGetParams",
            12080,
            0,
            "cuGraphKernelNodeGetParams_v2",
        ),
        ("cuGraphLaunch", 12080, 2, "cuGraphLaunch_ptsz"),
        ("cuStreamEndCapture", 12080, 2, "cuStreamEndCapture_ptsz"),
        (
            "cuLaunchCooperativeKernelMultiDevice",
            12080,
            0,
            "cuLaunchCooperativeKernelMultiDevice",
        ),
    ] {
        assert_eq!(
            resolve(name, version, flags),
            lib.addr(want),
            "{name}@{version} flags {flags} should be {want}"
        );
    }
}

/// Loads a module with one kernel of KERNEL_MS, reports READY with its pid;
/// on "go" launches it and reports LAUNCHED (clock before and after); on
/// "sync" synchronises and reports DONE; exits on the next line.
pub fn busy_kernel() {
    let (_lib, cu) = load();
    context(&cu);
    let ms = env_u64("KERNEL_MS");
    let m = load_module(&cu, &format!("SIMGPU-MODULE\nk {ms}ms\n"));
    let k = function(&cu, m, "k");
    report("READY", std::process::id());
    wait_parent();
    let before = mono_ns();
    ok(launch(&cu, k, null_mut()), "launch");
    let after = mono_ns();
    report("LAUNCHED", format!("{before} {after}"));
    wait_parent();
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize");
    report("DONE", mono_ns());
    wait_parent();
}

fn parse_u64s(line: &str) -> Vec<u64> {
    line.split_whitespace()
        .map(|x| x.parse().expect("number"))
        .collect()
}

/// Never calls cuInit: reads the busy-time hooks from the shared state.
/// First line: "A_PID B_PID A_LAUNCH_BEFORE A_LAUNCH_AFTER" (A runs a 50 ms
/// kernel from then, B a 30 ms one queued behind it): sampled 25 ms into A's
/// kernel. Second line: after both finished.
pub fn busy_probe() {
    let lib = Lib::open();
    let cu = Cu::load(&lib);
    assert_eq!(cu.simgpu_device_busy_ns(0), 0, "a fresh device");
    assert_eq!(cu.simgpu_device_busy_ns(1), u64::MAX, "no such device");
    assert_eq!(cu.simgpu_device_busy_ns(-1), u64::MAX, "no such device");
    report("READY", std::process::id());
    let v = parse_u64s(&wait_parent());
    let (a, b, before, after) = (v[0] as u32, v[1] as u32, v[2], v[3]);
    let deadline = before + 25 * MS;
    while mono_ns() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    let t1 = mono_ns();
    let busy_a = cu.simgpu_process_busy_ns(0, a);
    let busy_b = cu.simgpu_process_busy_ns(0, b);
    let busy = cu.simgpu_device_busy_ns(0);
    let t2 = mono_ns();
    // A's kernel started between `before` and `after`; the sample was taken
    // between t1 and t2.
    assert!(
        busy_a >= t1 - after && busy_a <= t2 - before,
        "A busy {busy_a} outside [{}, {}]",
        t1 - after,
        t2 - before
    );
    if t1 - deadline < 3 * MS && after - before < 2 * MS {
        // Sampled on time (not descheduled): 25 ms into the kernel.
        assert!(
            (20 * MS..=30 * MS).contains(&busy_a),
            "A busy {busy_a} ns at ~25 ms"
        );
    }
    assert_eq!(busy_b, 0, "B's kernel is queued behind A's");
    assert!(
        busy >= busy_a && busy <= busy_a + (t2 - t1),
        "device {busy} vs A {busy_a}"
    );
    report("SAMPLED", busy_a);
    wait_parent();
    assert_eq!(cu.simgpu_process_busy_ns(0, a), 50 * MS, "A in full");
    assert_eq!(cu.simgpu_process_busy_ns(0, b), 30 * MS, "B in full");
    assert_eq!(cu.simgpu_device_busy_ns(0), 80 * MS, "the device");
    assert_eq!(
        cu.simgpu_process_busy_ns(0, std::process::id()),
        0,
        "a pid that never used the device"
    );
    assert_eq!(cu.simgpu_process_busy_ns(0, 0), 0);
    report("CHECKED", 1);
}

/// Two devices: one cooperative multi-device launch runs a 20 ms kernel on
/// each device's stream, after the streams' earlier work.
pub fn multi_device() {
    let (_lib, cu) = load();
    ok(cu.cuInit(0), "cuInit");
    let image = "SIMGPU-MODULE\nk20 20ms\n";
    let mut ctxs = [null_mut(); 2];
    let mut streams = [null_mut(); 2];
    let mut funcs = [null_mut(); 2];
    for d in 0..2 {
        ok(
            cu.cuCtxCreate_v2(&mut ctxs[d], 0, d as i32),
            "cuCtxCreate_v2",
        );
        streams[d] = stream(&cu);
        let m = load_module(&cu, image);
        funcs[d] = function(&cu, m, "k20");
    }
    let entry = |d: usize| CUDA_LAUNCH_PARAMS {
        function: funcs[d],
        grid_dim_x: 4,
        grid_dim_y: 1,
        grid_dim_z: 1,
        block_dim_x: 64,
        block_dim_y: 1,
        block_dim_z: 1,
        shared_mem_bytes: 0,
        h_stream: streams[d],
        kernel_params: null_mut(),
    };
    let mut list = [entry(0), entry(1)];
    let mut same = [entry(0), entry(0)];
    assert_eq!(
        cu.cuLaunchCooperativeKernelMultiDevice(same.as_mut_ptr(), 2, 0),
        CUDA_ERROR_INVALID_VALUE,
        "two kernels on one device"
    );
    assert_eq!(
        cu.cuLaunchCooperativeKernelMultiDevice(list.as_mut_ptr(), 0, 0),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        cu.cuLaunchCooperativeKernelMultiDevice(list.as_mut_ptr(), 2, 4),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        cu.cuLaunchCooperativeKernelMultiDevice(null_mut(), 2, 0),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(cu.simgpu_device_busy_ns(0), 0, "nothing ran");

    let t0 = mono_ns();
    ok(
        cu.cuLaunchCooperativeKernelMultiDevice(list.as_mut_ptr(), 2, 0),
        "cuLaunchCooperativeKernelMultiDevice",
    );
    assert!(mono_ns() - t0 < 20 * MS, "asynchronous");
    for s in streams {
        ok(cu.cuStreamSynchronize(s), "sync");
    }
    assert!(mono_ns() - t0 >= 20 * MS);
    assert_eq!(cu.simgpu_device_busy_ns(0), 20 * MS, "ran on device 0");
    assert_eq!(cu.simgpu_device_busy_ns(1), 20 * MS, "ran on device 1");

    // Pre-launch sync: behind 20 ms of work on device 1's stream, device 0's
    // kernel starts only when that is done.
    let t1 = mono_ns();
    ok(
        cu.cuLaunchKernel(
            funcs[1],
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            streams[1],
            null_mut(),
            null_mut(),
        ),
        "launch",
    );
    ok(
        cu.cuLaunchCooperativeKernelMultiDevice(list.as_mut_ptr(), 2, 0),
        "cuLaunchCooperativeKernelMultiDevice",
    );
    ok(cu.cuStreamSynchronize(streams[0]), "sync");
    assert!(mono_ns() - t1 >= 40 * MS, "waited for the other stream");
    ok(cu.cuStreamSynchronize(streams[1]), "sync");
    assert_eq!(cu.simgpu_device_busy_ns(0), 40 * MS);
    assert_eq!(cu.simgpu_device_busy_ns(1), 60 * MS);
}

/// More kernels than the 65536-record ring holds (a captured graph of 1000
/// 1 µs kernels, launched 70 times): the busy hooks stay exact.
pub fn busy_long() {
    let (_lib, cu) = load();
    context(&cu);
    let m = load_module(&cu, "SIMGPU-MODULE\nk 1us\n");
    let k = function(&cu, m, "k");
    let s = stream(&cu);
    ok(
        cu.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        "begin",
    );
    for _ in 0..1000 {
        ok(launch(&cu, k, s), "captured launch");
    }
    let mut g = null_mut();
    ok(cu.cuStreamEndCapture(s, &mut g), "end");
    let mut exec = null_mut();
    ok(
        cu.cuGraphInstantiateWithFlags(&mut exec, g, 0),
        "instantiate",
    );
    for _ in 0..70 {
        ok(cu.cuGraphLaunch(exec, s), "cuGraphLaunch");
    }
    ok(cu.cuStreamSynchronize(s), "sync");
    let want = 70_000 * 1_000;
    assert_eq!(cu.simgpu_device_busy_ns(0), want);
    assert_eq!(cu.simgpu_process_busy_ns(0, std::process::id()), want);
}
