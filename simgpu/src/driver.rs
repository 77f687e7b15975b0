//! Per-process CUDA driver state: contexts, streams, events, modules,
//! allocations, pools and virtual-memory objects.
//!
//! Everything lives in one [`Inner`] behind one mutex (simple and correct;
//! the simulated driver is not a performance target). Calls never sleep while
//! holding it. After `fork` the child starts with a fresh, empty state (the
//! parent's contexts are invalid there, as with a real driver).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

use vgpu_cuda_abi::cuda::*;

use crate::clock;
use crate::config::{self, Config};
use crate::state::{self, Shared};

/// Result of an internal driver operation.
pub type CuResult<T> = Result<T, CUresult>;

/// Allocation alignment of `cuMemAlloc`.
pub const ALLOC_ALIGN: u64 = 256;
/// Granularity of VMM and pool reservations.
pub const GRANULARITY: u64 = 2 << 20;
/// Kernels a stream may have outstanding before launches block.
pub const QUEUE_DEPTH: usize = 1024;

static INITIALIZED: AtomicBool = AtomicBool::new(false);
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// A fresh opaque handle value (never 0, 1 or 2, the special streams).
pub fn new_handle() -> u64 {
    0x5100_0000_0000 | (NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) << 4)
}

pub fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to).saturating_mul(to)
}

/// Marks the driver initialised (`cuInit` succeeded).
pub fn set_initialized() {
    INITIALIZED.store(true, Ordering::Release);
}

/// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn check_init() -> CuResult<&'static Config> {
    if !INITIALIZED.load(Ordering::Acquire) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    config::get().map_err(|()| CUDA_ERROR_NOT_INITIALIZED)
}

/// Validates a device ordinal.
pub fn check_device(cfg: &Config, dev: CUdevice) -> CuResult<usize> {
    if dev < 0 || dev as usize >= cfg.devices {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(dev as usize)
}

/// The shared state file, mapped to a CUDA error.
pub fn shared() -> CuResult<&'static Shared> {
    state::shared().map_err(|e| match e {
        state::StateError::Incompatible(_) => CUDA_ERROR_INVALID_VALUE,
        _ => CUDA_ERROR_OPERATING_SYSTEM,
    })
}

/// Charges device memory to this process or fails with OUT_OF_MEMORY.
pub fn charge(device: usize, bytes: u64) -> CuResult<()> {
    match shared()?.charge(device, bytes) {
        Ok(true) => Ok(()),
        Ok(false) => Err(CUDA_ERROR_OUT_OF_MEMORY),
        Err(_) => Err(CUDA_ERROR_OPERATING_SYSTEM),
    }
}

/// Gives device memory back.
pub fn uncharge(device: usize, bytes: u64) {
    if let Ok(s) = shared() {
        s.uncharge(device, bytes);
    }
}

/// A stream's position on the real-time timeline.
#[derive(Debug, Default)]
pub struct Timeline {
    /// When the last work queued on the stream ends (monotonic ns).
    pub last_end: u64,
    /// End times of queued kernels that may still be outstanding.
    pub queue: VecDeque<u64>,
    /// Wall timing: the device thread's sequence number of the last work
    /// queued on the stream (0: none).
    pub last_seq: u64,
}

impl Timeline {
    /// Drops finished kernels from the queue.
    pub fn prune(&mut self, now: u64) {
        while self.queue.front().is_some_and(|&end| end <= now) {
            self.queue.pop_front();
        }
    }
}

#[derive(Debug)]
pub struct Context {
    pub device: usize,
    pub flags: u32,
    pub primary: bool,
    pub active: bool,
    pub default_stream: Timeline,
}

#[derive(Debug)]
pub struct Stream {
    pub ctx: u64,
    pub flags: u32,
    pub priority: i32,
    pub timeline: Timeline,
    /// The capture sequence this stream takes part in, if any.
    pub capture: Option<u64>,
}

#[derive(Debug)]
pub struct Event {
    pub ctx: u64,
    pub flags: u32,
    /// Completion time of the recorded work, `None` until recorded.
    pub time: Option<u64>,
    /// The capture sequence it was last recorded in (`None` when its last
    /// record was an ordinary one).
    pub captured: Option<u64>,
    /// Wall timing: recorded but not reached yet by the device thread of
    /// `.0`, as its operation `.1` (`time` is set when it is).
    pub pending: Option<(usize, u64)>,
}

/// A kernel as a graph holds it: what was launched and how long it runs.
#[derive(Debug, Clone, Copy)]
pub struct KernelNode {
    pub func: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem: u32,
    /// The caller's `kernelParams` / `extra` arrays, kept as given (the
    /// simulation cannot know the argument sizes to copy them).
    pub kernel_params: usize,
    pub extra: usize,
    pub kern: usize,
    pub ctx: u64,
    pub duration_ns: u64,
}

/// What one graph node does when its graph is launched.
#[derive(Debug, Clone, Copy)]
pub enum NodeOp {
    Kernel(KernelNode),
    /// A copy (instantaneous, like every simulated copy).
    Memcpy {
        dst: u64,
        src: u64,
        bytes: u64,
    },
    /// A fill of `count` elements of `elem` bytes.
    Memset {
        dst: u64,
        value: u32,
        elem: u8,
        count: u64,
    },
    /// Records the event at this point of the launch stream.
    EventRecord(u64),
    /// Makes the rest of the launch wait for the event.
    EventWait(u64),
}

impl NodeOp {
    /// The `CUgraphNodeType` of the node.
    pub fn node_type(&self) -> CUgraphNodeType {
        match self {
            NodeOp::Kernel(_) => CU_GRAPH_NODE_TYPE_KERNEL,
            NodeOp::Memcpy { .. } => CU_GRAPH_NODE_TYPE_MEMCPY,
            NodeOp::Memset { .. } => CU_GRAPH_NODE_TYPE_MEMSET,
            NodeOp::EventRecord(_) => CU_GRAPH_NODE_TYPE_EVENT_RECORD,
            NodeOp::EventWait(_) => CU_GRAPH_NODE_TYPE_WAIT_EVENT,
        }
    }
}

#[derive(Debug)]
pub struct GraphNode {
    pub graph: u64,
    pub op: NodeOp,
}

/// A graph: its nodes in the order they were added, which is also the order
/// they run in (every dependency is added before its dependents).
#[derive(Debug, Default)]
pub struct Graph {
    pub nodes: Vec<u64>,
}

/// An instantiated graph: a snapshot of the graph's operations.
#[derive(Debug)]
pub struct GraphExec {
    pub ops: Vec<NodeOp>,
}

/// A stream capture sequence.
#[derive(Debug)]
pub struct Capture {
    /// The graph being built.
    pub graph: u64,
    /// The stream that began the capture (the one that must end it).
    pub origin: u64,
    pub mode: CUstreamCaptureMode,
    pub thread: std::thread::ThreadId,
    /// Set by an operation the capture cannot hold; ending it then fails.
    pub invalidated: bool,
    /// The last captured node (the capture's dependency set, handed out by
    /// `cuStreamGetCaptureInfo`; boxed so the address stays put).
    pub last: Box<u64>,
}

#[derive(Debug)]
pub struct Module {
    pub ctx: u64,
    pub device: usize,
    pub bytes: u64,
    pub functions: Vec<u64>,
}

#[derive(Debug)]
pub struct Function {
    pub module: u64,
    pub name: String,
    pub duration_ns: u64,
}

#[derive(Debug)]
pub struct Array {
    pub ctx: u64,
    pub device: usize,
    pub bytes: u64,
    pub mipmapped: bool,
}

#[derive(Debug)]
pub struct Pool {
    pub device: usize,
    pub is_default: bool,
    pub destroyed: bool,
    pub threshold: u64,
    pub reserved: u64,
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
    pub reuse: [i32; 3],
}

#[derive(Debug)]
pub struct VmmHandle {
    pub fd: libc::c_int,
    pub size: u64,
    pub prop: CUmemAllocationProp,
    /// The device charged for it, `None` for host memory.
    pub device: Option<usize>,
    /// References: 1 from `cuMemCreate`, +1 per `cuMemRetainAllocationHandle`,
    /// -1 per `cuMemRelease`.
    pub refs: u32,
    /// Live `cuMemMap` mappings of it.
    pub maps: u32,
}

/// What a device-addressable range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionKind {
    /// `cuMemAlloc` / `cuMemAllocPitch`.
    Device,
    /// `cuMemAllocManaged`.
    Managed,
    /// Page-locked host memory (`cuMemAllocHost`, `cuMemHostAlloc`).
    Host,
    /// Stream-ordered allocation from a pool.
    PoolAlloc { pool: u64 },
    /// A `cuMemMap` of a VMM handle.
    Mapping { handle: u64 },
}

#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// Bytes the caller asked for (what `cuMemGetAddressRange` reports).
    pub size: u64,
    /// Bytes of address space it occupies.
    pub span: u64,
    pub kind: RegionKind,
    pub device: usize,
    /// Owning context (0 for process-wide objects such as mappings).
    pub ctx: u64,
}

/// A per-device range of address space that backs `cuMemAlloc` & co.
#[derive(Debug)]
pub struct Arena {
    base: u64,
    size: u64,
    /// Free blocks: start → length.
    free: BTreeMap<u64, u64>,
}

impl Arena {
    fn new(total: u64) -> CuResult<Arena> {
        let size = round_up(
            total
                .saturating_mul(2)
                .saturating_add(1 << 30)
                .min(16 << 40),
            GRANULARITY,
        );
        // SAFETY: anonymous, private, unreserved mapping; pages are only
        // materialised when touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let base = base as u64;
        let mut free = BTreeMap::new();
        free.insert(base, size);
        Ok(Arena { base, size, free })
    }

    /// True when `addr` lies inside this arena's address range.
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + self.size
    }

    /// First-fit allocation of `len` bytes aligned to `align`.
    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let (start, block) = self.free.iter().find_map(|(&start, &block)| {
            let aligned = round_up(start, align);
            (aligned + len <= start + block).then_some((start, block))
        })?;
        let aligned = round_up(start, align);
        self.free.remove(&start);
        if aligned > start {
            self.free.insert(start, aligned - start);
        }
        let end = aligned + len;
        if end < start + block {
            self.free.insert(end, start + block - end);
        }
        Some(aligned)
    }

    /// Returns a block and gives its whole pages back to the OS.
    fn release(&mut self, addr: u64, len: u64) {
        let page = 4096;
        let first = round_up(addr, page);
        let last = (addr + len) / page * page;
        if last > first {
            // SAFETY: the pages lie inside our arena mapping and inside the
            // freed block, so no live allocation uses them.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    (last - first) as usize,
                    libc::MADV_DONTNEED,
                )
            };
        }
        let mut start = addr;
        let mut length = len;
        if let Some((&prev, &plen)) = self.free.range(..addr).next_back() {
            if prev + plen == addr {
                self.free.remove(&prev);
                start = prev;
                length += plen;
            }
        }
        if let Some(&next_len) = self.free.get(&(addr + len)) {
            self.free.remove(&(addr + len));
            length += next_len;
        }
        self.free.insert(start, length);
    }
}

/// Primary context bookkeeping for one device.
#[derive(Debug, Default, Clone, Copy)]
pub struct Primary {
    pub handle: u64,
    pub refcount: u32,
    pub flags: u32,
}

/// All per-process driver state.
#[derive(Debug, Default)]
pub struct Inner {
    pub contexts: HashMap<u64, Context>,
    pub primary: Vec<Primary>,
    pub streams: HashMap<u64, Stream>,
    pub events: HashMap<u64, Event>,
    pub modules: HashMap<u64, Module>,
    pub functions: HashMap<u64, Function>,
    pub arrays: HashMap<u64, Array>,
    pub pools: HashMap<u64, Pool>,
    pub default_pool: Vec<Option<u64>>,
    pub current_pool: Vec<Option<u64>>,
    pub regions: BTreeMap<u64, Region>,
    pub arenas: Vec<Option<Arena>>,
    pub vmm: HashMap<u64, VmmHandle>,
    /// VMM address reservations: start → size.
    pub reservations: BTreeMap<u64, u64>,
    pub graphs: HashMap<u64, Graph>,
    pub graph_nodes: HashMap<u64, GraphNode>,
    pub graph_execs: HashMap<u64, GraphExec>,
    /// Active capture sequences by id.
    pub captures: HashMap<u64, Capture>,
}

pub struct Proc {
    inner: Mutex<Inner>,
}

static PROC: AtomicPtr<Proc> = AtomicPtr::new(std::ptr::null_mut());

fn proc() -> &'static Proc {
    let p = PROC.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published Proc values are leaked, hence 'static.
        return unsafe { &*p };
    }
    FORGET_AFTER_FORK.call_once(|| {
        // SAFETY: registering a plain extern "C" handler.
        unsafe { libc::pthread_atfork(None, None, Some(forget_after_fork)) };
    });
    let fresh = Box::into_raw(Box::new(Proc {
        inner: Mutex::new(Inner::default()),
    }));
    match PROC.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: `fresh` is now published and leaked.
        Ok(_) => unsafe { &*fresh },
        Err(existing) => {
            // SAFETY: `fresh` was never published; `existing` is leaked.
            unsafe {
                drop(Box::from_raw(fresh));
                &*existing
            }
        }
    }
}

/// Registers [`forget_after_fork`] once, with the first process state.
static FORGET_AFTER_FORK: Once = Once::new();

/// In a fork child: start over with an empty state (the old one, possibly
/// locked by a thread that does not exist here, leaks). Each layer forgets
/// its own after fork (the state file in [`crate::state`], the device
/// threads in [`crate::executor`]), so none reaches up into another.
extern "C" fn forget_after_fork() {
    PROC.store(std::ptr::null_mut(), Ordering::Release);
}

/// Whether kernels run on device threads in wall-clock time
/// (`SIMGPU_TIMING=wall`) rather than on the precomputed timeline.
pub fn wall_timing() -> bool {
    config::get().is_ok_and(|cfg| cfg.timing == config::Timing::Wall)
}

/// Locks the process state.
pub fn lock() -> MutexGuard<'static, Inner> {
    proc().inner.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// The calling thread's context stack (top = current).
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The current context handle of this thread, if any (not validated).
pub fn current_handle() -> Option<u64> {
    STACK.with(|s| s.borrow().last().copied())
}

pub fn push_current(ctx: u64) {
    STACK.with(|s| s.borrow_mut().push(ctx));
}

pub fn pop_current() -> Option<u64> {
    STACK.with(|s| s.borrow_mut().pop())
}

/// `cuCtxSetCurrent`: replace the top (or push on an empty stack); NULL pops.
pub fn set_current(ctx: u64) {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if ctx == 0 {
            s.pop();
        } else if let Some(top) = s.last_mut() {
            *top = ctx;
        } else {
            s.push(ctx);
        }
    });
}

/// Removes `ctx` from the top of this thread's stack if it is there.
pub fn pop_if_current(ctx: u64) {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if s.last() == Some(&ctx) {
            s.pop();
        }
    });
}

/// A stream argument resolved against the process state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRef {
    /// The default stream (NULL, legacy or per-thread) of a context.
    Default(u64),
    /// A created stream.
    Created(u64),
}

impl Inner {
    /// Validates a context handle.
    pub fn ctx(&self, handle: u64) -> CuResult<&Context> {
        match self.contexts.get(&handle) {
            Some(c) if c.active => Ok(c),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// The calling thread's current context (handle, device).
    pub fn current(&self) -> CuResult<(u64, usize)> {
        let handle = current_handle().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let ctx = self.ctx(handle)?;
        Ok((handle, ctx.device))
    }

    /// Resolves a stream handle to (stream, owning context, device).
    pub fn stream(&self, stream: CUstream) -> CuResult<(StreamRef, u64, usize)> {
        let value = stream as usize;
        if value == 0 || value == CU_STREAM_LEGACY || value == CU_STREAM_PER_THREAD {
            let (ctx, device) = self.current()?;
            return Ok((StreamRef::Default(ctx), ctx, device));
        }
        let s = self
            .streams
            .get(&(value as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let ctx = self.ctx(s.ctx)?;
        Ok((StreamRef::Created(value as u64), s.ctx, ctx.device))
    }

    pub fn timeline(&mut self, s: StreamRef) -> Option<&mut Timeline> {
        match s {
            StreamRef::Default(ctx) => self.contexts.get_mut(&ctx).map(|c| &mut c.default_stream),
            StreamRef::Created(h) => self.streams.get_mut(&h).map(|s| &mut s.timeline),
        }
    }

    /// The capture sequence a stream takes part in (default streams are
    /// never captured).
    pub fn capture_of(&self, s: StreamRef) -> Option<u64> {
        match s {
            StreamRef::Default(_) => None,
            StreamRef::Created(h) => self.streams.get(&h).and_then(|s| s.capture),
        }
    }

    /// Appends a node to a graph (after every node it already has).
    pub fn add_node(&mut self, graph: u64, op: NodeOp) -> CuResult<u64> {
        let g = self
            .graphs
            .get_mut(&graph)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let node = new_handle();
        g.nodes.push(node);
        self.graph_nodes.insert(node, GraphNode { graph, op });
        Ok(node)
    }

    /// Records an operation into a capture sequence instead of running it.
    pub fn capture_append(&mut self, id: u64, op: NodeOp) -> CuResult<()> {
        let capture = self
            .captures
            .get(&id)
            .ok_or(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)?;
        if capture.invalidated {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let graph = capture.graph;
        let node = self.add_node(graph, op)?;
        if let Some(c) = self.captures.get_mut(&id) {
            *c.last = node;
        }
        Ok(())
    }

    /// Marks a capture sequence failed (an operation it cannot hold).
    pub fn invalidate_capture(&mut self, id: u64) {
        if let Some(c) = self.captures.get_mut(&id) {
            c.invalidated = true;
        }
    }

    /// Ends a capture sequence: no stream takes part in it any more.
    pub fn end_capture(&mut self, id: u64) -> Option<Capture> {
        for s in self.streams.values_mut() {
            if s.capture == Some(id) {
                s.capture = None;
            }
        }
        self.captures.remove(&id)
    }

    /// Destroys a graph and its nodes.
    pub fn destroy_graph(&mut self, graph: u64) -> bool {
        let Some(g) = self.graphs.remove(&graph) else {
            return false;
        };
        for n in g.nodes {
            self.graph_nodes.remove(&n);
        }
        true
    }

    /// Wall timing: the last operation queued on any stream of a context.
    pub fn ctx_last_seq(&self, ctx: u64) -> u64 {
        let own = self
            .contexts
            .get(&ctx)
            .map_or(0, |c| c.default_stream.last_seq);
        self.streams
            .values()
            .filter(|s| s.ctx == ctx)
            .map(|s| s.timeline.last_seq)
            .fold(own, u64::max)
    }

    /// When all work queued in a context ends.
    pub fn ctx_last_end(&self, ctx: u64) -> u64 {
        let own = self
            .contexts
            .get(&ctx)
            .map_or(0, |c| c.default_stream.last_end);
        self.streams
            .values()
            .filter(|s| s.ctx == ctx)
            .map(|s| s.timeline.last_end)
            .fold(own, u64::max)
    }

    /// Creates an active context on `device` (charging its memory).
    pub fn create_context(
        &mut self,
        cfg: &Config,
        device: usize,
        flags: u32,
        primary: bool,
    ) -> CuResult<u64> {
        charge(device, cfg.context_bytes)?;
        if shared()?.count_context(device, true).is_err() {
            uncharge(device, cfg.context_bytes);
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        let handle = new_handle();
        self.contexts.insert(
            handle,
            Context {
                device,
                flags,
                primary,
                active: true,
                default_stream: Timeline::default(),
            },
        );
        Ok(handle)
    }

    /// Frees everything a context owns and gives its memory back. The
    /// context entry stays (inactive) for primaries and is removed otherwise.
    pub fn teardown_context(&mut self, cfg: &Config, handle: u64) {
        let Some(ctx) = self.contexts.get(&handle) else {
            return;
        };
        if !ctx.active {
            return;
        }
        let device = ctx.device;
        let primary = ctx.primary;
        let owned: Vec<u64> = self
            .regions
            .iter()
            .filter(|(_, r)| r.ctx == handle)
            .map(|(&a, _)| a)
            .collect();
        for addr in owned {
            let _ = self.free_region(addr);
        }
        let modules: Vec<u64> = self
            .modules
            .iter()
            .filter(|(_, m)| m.ctx == handle)
            .map(|(&h, _)| h)
            .collect();
        for m in modules {
            self.unload_module(m);
        }
        let arrays: Vec<u64> = self
            .arrays
            .iter()
            .filter(|(_, a)| a.ctx == handle)
            .map(|(&h, _)| h)
            .collect();
        for a in arrays {
            if let Some(arr) = self.arrays.remove(&a) {
                uncharge(arr.device, arr.bytes);
            }
        }
        self.streams.retain(|_, s| s.ctx != handle);
        let orphaned: Vec<u64> = self
            .captures
            .iter()
            .filter(|(_, c)| !self.streams.contains_key(&c.origin))
            .map(|(&id, _)| id)
            .collect();
        for id in orphaned {
            self.end_capture(id);
        }
        self.events.retain(|_, e| e.ctx != handle);
        uncharge(device, cfg.context_bytes);
        if let Ok(s) = shared() {
            let _ = s.count_context(device, false);
        }
        if primary {
            if let Some(c) = self.contexts.get_mut(&handle) {
                c.active = false;
                c.default_stream = Timeline::default();
            }
        } else {
            self.contexts.remove(&handle);
        }
        // With no context left on the device, pools keep nothing unused.
        let device_in_use = self
            .contexts
            .values()
            .any(|c| c.active && c.device == device);
        if !device_in_use {
            let pools: Vec<u64> = self
                .pools
                .iter()
                .filter(|(_, p)| p.device == device)
                .map(|(&h, _)| h)
                .collect();
            for p in pools {
                self.trim_pool(p, 0);
            }
        }
    }

    pub fn unload_module(&mut self, handle: u64) -> bool {
        let Some(m) = self.modules.remove(&handle) else {
            return false;
        };
        for f in &m.functions {
            self.functions.remove(f);
        }
        uncharge(m.device, m.bytes);
        true
    }

    /// The address arena of `device`, created on first use.
    pub fn arena(&mut self, cfg: &Config, device: usize) -> CuResult<&mut Arena> {
        if self.arenas.len() < cfg.devices {
            self.arenas.resize_with(cfg.devices, || None);
        }
        let slot = self
            .arenas
            .get_mut(device)
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        if slot.is_none() {
            *slot = Some(Arena::new(cfg.memory[device])?);
        }
        slot.as_mut().ok_or(CUDA_ERROR_UNKNOWN)
    }

    /// Takes address space on `device` (no accounting).
    pub fn take_address(&mut self, cfg: &Config, device: usize, size: u64) -> CuResult<(u64, u64)> {
        let span = round_up(size.max(1), ALLOC_ALIGN);
        let addr = self
            .arena(cfg, device)?
            .alloc(span, ALLOC_ALIGN)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok((addr, span))
    }

    /// Device memory (`cuMemAlloc`-like): charges, then takes address space.
    pub fn alloc_device(
        &mut self,
        cfg: &Config,
        ctx: u64,
        device: usize,
        size: u64,
        kind: RegionKind,
    ) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        charge(device, size)?;
        match self.take_address(cfg, device, size) {
            Ok((addr, span)) => {
                self.regions.insert(
                    addr,
                    Region {
                        size,
                        span,
                        kind,
                        device,
                        ctx,
                    },
                );
                Ok(addr)
            }
            Err(e) => {
                uncharge(device, size);
                Err(e)
            }
        }
    }

    /// The region starting exactly at `addr`.
    pub fn region_at(&self, addr: u64) -> Option<Region> {
        self.regions.get(&addr).copied()
    }

    /// The region containing `addr`: (start, region).
    pub fn region_containing(&self, addr: u64) -> Option<(u64, Region)> {
        let (&start, r) = self.regions.range(..=addr).next_back()?;
        (addr < start + r.size.max(1)).then_some((start, *r))
    }

    /// Checks that `[addr, addr+len)` is live device-addressable memory.
    /// A range may run across adjacent VMM mappings.
    pub fn check_device_range(&self, addr: u64, len: u64) -> CuResult<()> {
        if len == 0 {
            return Ok(());
        }
        let end = addr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut cursor = addr;
        let mut first = true;
        while cursor < end {
            let (start, r) = self
                .region_containing(cursor)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
            if !first && !matches!(r.kind, RegionKind::Mapping { .. }) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            if first && end > start + r.size && !matches!(r.kind, RegionKind::Mapping { .. }) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            first = false;
            cursor = start + r.size;
        }
        Ok(())
    }

    /// True when `addr` is inside simulated device address space (an arena
    /// or a VMM reservation), live or not.
    pub fn in_device_space(&self, addr: u64) -> bool {
        self.arenas.iter().flatten().any(|a| a.contains(addr))
            || self
                .reservations
                .range(..=addr)
                .next_back()
                .is_some_and(|(&s, &len)| addr < s + len)
    }

    /// Frees the allocation starting at `addr` (cuMemFree semantics).
    pub fn free_region(&mut self, addr: u64) -> CuResult<()> {
        let r = self.region_at(addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match r.kind {
            RegionKind::Mapping { .. } => return Err(CUDA_ERROR_INVALID_VALUE),
            RegionKind::Host => {
                self.regions.remove(&addr);
                // SAFETY: host allocations are our own anonymous mappings of
                // `span` bytes.
                unsafe { libc::munmap(addr as *mut libc::c_void, r.span as usize) };
                return Ok(());
            }
            RegionKind::Device | RegionKind::Managed => {
                uncharge(r.device, r.size);
            }
            RegionKind::PoolAlloc { pool } => {
                if let Some(p) = self.pools.get_mut(&pool) {
                    p.used = p.used.saturating_sub(r.size);
                }
                self.finish_destroyed_pool(pool);
            }
        }
        self.regions.remove(&addr);
        if let Some(Some(arena)) = self.arenas.get_mut(r.device) {
            arena.release(addr, r.span);
        }
        Ok(())
    }

    /// Releases a pool's unused reservation down to `keep` bytes (never
    /// below what its live allocations need).
    pub fn trim_pool(&mut self, pool: u64, keep: u64) {
        let Some(p) = self.pools.get_mut(&pool) else {
            return;
        };
        let floor = round_up(p.used, GRANULARITY).max(round_up(keep, GRANULARITY));
        if p.reserved > floor {
            let give = p.reserved - floor;
            p.reserved = floor;
            let device = p.device;
            uncharge(device, give);
        }
    }

    /// Trims every pool on `device` to its release threshold.
    pub fn trim_pools_to_threshold(&mut self, device: Option<usize>) {
        let pools: Vec<(u64, u64)> = self
            .pools
            .iter()
            .filter(|(_, p)| device.is_none_or(|d| p.device == d))
            .map(|(&h, p)| (h, p.threshold))
            .collect();
        for (h, threshold) in pools {
            self.trim_pool(h, threshold);
        }
    }

    /// Drops a destroyed pool once its last allocation is gone.
    pub fn finish_destroyed_pool(&mut self, pool: u64) {
        let done = self
            .pools
            .get(&pool)
            .is_some_and(|p| p.destroyed && p.used == 0);
        if done {
            self.trim_pool(pool, 0);
            self.pools.remove(&pool);
        }
    }

    /// The default pool of `device`, created on first use.
    pub fn default_pool(&mut self, cfg: &Config, device: usize) -> u64 {
        if self.default_pool.len() < cfg.devices {
            self.default_pool.resize(cfg.devices, None);
            self.current_pool.resize(cfg.devices, None);
        }
        if let Some(h) = self.default_pool[device] {
            return h;
        }
        let h = new_handle();
        self.pools.insert(h, Pool::new(device, true));
        self.default_pool[device] = Some(h);
        h
    }

    /// The current pool of `device` (`cuDeviceGetMemPool`).
    pub fn current_pool(&mut self, cfg: &Config, device: usize) -> u64 {
        let default = self.default_pool(cfg, device);
        self.current_pool[device].unwrap_or(default)
    }

    /// Stream-ordered allocation from `pool`.
    pub fn pool_alloc(&mut self, cfg: &Config, pool: u64, ctx: u64, size: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = self.pools.get(&pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if p.destroyed {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = p.device;
        let need_used = p.used + size;
        let grow = if need_used > p.reserved {
            round_up(need_used - p.reserved, GRANULARITY)
        } else {
            0
        };
        charge(device, grow)?;
        let (addr, span) = match self.take_address(cfg, device, size) {
            Ok(x) => x,
            Err(e) => {
                uncharge(device, grow);
                return Err(e);
            }
        };
        if let Some(p) = self.pools.get_mut(&pool) {
            p.reserved += grow;
            p.used = need_used;
            p.reserved_high = p.reserved_high.max(p.reserved);
            p.used_high = p.used_high.max(p.used);
        }
        self.regions.insert(
            addr,
            Region {
                size,
                span,
                kind: RegionKind::PoolAlloc { pool },
                device,
                ctx,
            },
        );
        Ok(addr)
    }
}

impl Pool {
    pub fn new(device: usize, is_default: bool) -> Pool {
        Pool {
            device,
            is_default,
            destroyed: false,
            threshold: 0,
            reserved: 0,
            used: 0,
            reserved_high: 0,
            used_high: 0,
            reuse: [1, 1, 1],
        }
    }
}

/// How close to a completion a synchronising thread stops sleeping and
/// polls instead. The real driver's default synchronisation spins then
/// yields, and returns within microseconds of the work finishing; a plain
/// sleep would overshoot by the kernel's timer slack (about 50 us), which
/// would make short kernels look far slower than they are.
const SPIN_WINDOW_NS: u64 = 100_000;

/// Waits until `deadline` (monotonic ns) without holding any lock: sleeps
/// for most of the wait, then yields until the deadline.
pub fn wait_until(deadline: u64) {
    let now = clock::now_ns();
    if deadline <= now {
        return;
    }
    if deadline - now > SPIN_WINDOW_NS {
        clock::sleep_until(deadline - SPIN_WINDOW_NS);
    }
    while clock::now_ns() < deadline {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_first_fit_and_coalesce() {
        let mut a = Arena::new(1 << 20).expect("mmap");
        let base = a.base;
        let x = a.alloc(256, 256).expect("x");
        let y = a.alloc(512, 256).expect("y");
        let z = a.alloc(256, 256).expect("z");
        assert_eq!(x, base);
        assert_eq!(y, base + 256);
        assert_eq!(z, base + 768);
        a.release(y, 512);
        // A smaller block reuses the hole.
        assert_eq!(a.alloc(256, 256), Some(base + 256));
        a.release(base + 256, 256);
        a.release(x, 256);
        a.release(z, 256);
        assert_eq!(a.free.len(), 1);
        assert_eq!(a.free.get(&base), Some(&a.size));
        // Alignment is honoured.
        let big = a.alloc(100, 1 << 21).expect("aligned");
        assert_eq!(big % (1 << 21), 0);
    }
}
