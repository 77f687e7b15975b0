//! Wall timing (`SIMGPU_TIMING=wall`): each process's device is a thread
//! that runs the work queued on it as it comes, in wall-clock time.
//!
//! The default (timeline) timing works a kernel's start and end out when it
//! is launched, exactly. Here nothing is worked out ahead: launches (after
//! the launch overhead, spent on the calling thread) and event records go
//! into one queue per device, in the order they were made, and the device
//! thread takes them one by one. A kernel waits for its process's turn on
//! the device (a process keeps the device while it has work queued, at most
//! a time slice while another waits, see
//! [`crate::state::Shared::acquire_device`]), then the thread sleeps until
//! the kernel's duration has passed on the clock. A turn that passes the
//! device from another process's work to this one's first costs
//! `SIMGPU_SWITCH_COST` of device time, which goes to no process. What the device did is
//! worked out as a GPU would have done it, from when work reached it: a
//! kernel starts when it was handed over (or when the device became free, or
//! the work before it ended) and lasts its duration, varied from run to run
//! by `SIMGPU_KERNEL_JITTER` as a GPU kernel's time varies with clocks and
//! memory; the ring and the busy counters record exactly that. An event is
//! stamped with the time the device reached it (one recorded on a stream
//! whose earlier work is done, while no other process holds the device,
//! completes as it is recorded and never enters the queue). What is real is
//! the host's side: launches cost host time, the device takes work up in the
//! order it was handed over, and synchronisation returns only once the
//! device thread has passed the work waited for, on the clock.
//!
//! One queue per device also orders a process's streams: work on two streams
//! of one device runs in the order it was queued, so waiting on an event
//! recorded on the same device needs nothing more; a wait on another
//! device's event queues a wait for that device's thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once, PoisonError};

use vgpu_cuda_abi::cuda::{CUresult, CUDA_ERROR_OPERATING_SYSTEM};

use crate::clock;
use crate::driver::{self, QUEUE_DEPTH};

/// How long a process keeps the device while another waits for it, as a
/// GPU's time slice between contexts. A kernel is never cut short.
const TIME_SLICE_NS: u64 = 2_000_000;

/// Timer slack of device threads (ns). A kernel's end does not depend on
/// it, but when the thread sees the end does: the default 50 us would make
/// every synchronisation that much late, where a GPU's completions are
/// seen within microseconds.
const DEVICE_TIMER_SLACK_NS: libc::c_ulong = 1_000;

/// Work for a device thread.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Occupies the device for `duration_ns` of wall time.
    Kernel { duration_ns: u64 },
    /// Stamps event `event` (a handle) with the time the device reaches it.
    Record { event: u64 },
    /// Waits until device `device` has done its work up to `seq`.
    Wait { device: usize, seq: u64 },
}

/// An operation as queued: its sequence number, when it reached the
/// device (`CLOCK_MONOTONIC` ns), and what it does.
type Queued = (u64, u64, Op);

struct Queue {
    ops: VecDeque<Queued>,
    /// Sequence number of the last operation queued (they count from 1).
    submitted: u64,
    /// Every operation up to this one has completed.
    done: u64,
    thread_started: bool,
}

/// One device of this process in wall timing.
pub struct Executor {
    device: usize,
    queue: Mutex<Queue>,
    /// The device thread waits here for work.
    work: Condvar,
    /// Threads synchronising wait here for completions.
    completed: Condvar,
}

impl Executor {
    fn new(device: usize) -> Self {
        Self {
            device,
            queue: Mutex::new(Queue {
                ops: VecDeque::new(),
                submitted: 0,
                done: 0,
                thread_started: false,
            }),
            work: Condvar::new(),
            completed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits while the device has `QUEUE_DEPTH` operations outstanding (a
    /// launch into a full queue blocks, as the real driver's does). Call it
    /// before taking the process lock: the device thread needs that lock to
    /// stamp events, so waiting for room while holding it could deadlock.
    pub fn wait_for_room(&self) {
        let mut queue = self.lock();
        while queue.ops.len() >= QUEUE_DEPTH {
            queue = self
                .completed
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Queues `op` and returns its sequence number. Never blocks (see
    /// [`Executor::wait_for_room`]).
    pub fn submit(&'static self, op: Op) -> Result<u64, CUresult> {
        self.submit_all(&[op])
    }

    /// Queues `ops` at once (a graph's work reaches the device together)
    /// and returns the last one's sequence number (the one before them if
    /// there are none). Never blocks.
    pub fn submit_all(&'static self, ops: &[Op]) -> Result<u64, CUresult> {
        let mut queue = self.lock();
        if !queue.thread_started {
            std::thread::Builder::new()
                .name(format!("simgpu-device{}", self.device))
                .spawn(move || self.run())
                .map_err(|_| CUDA_ERROR_OPERATING_SYSTEM)?;
            queue.thread_started = true;
        }
        // The work reaches the device now, as a GPU's doorbell is rung: a
        // GPU polls for work, and waking this thread is not part of it.
        let now = clock::now_ns();
        for &op in ops {
            queue.submitted += 1;
            let seq = queue.submitted;
            queue.ops.push_back((seq, now, op));
        }
        let last = queue.submitted;
        drop(queue);
        self.work.notify_one();
        Ok(last)
    }

    /// Whether the operation `seq` (and all before it) has completed.
    pub fn is_done(&self, seq: u64) -> bool {
        self.lock().done >= seq
    }

    /// Blocks until the operation `seq` (and all before it) has completed.
    pub fn wait_for(&self, seq: u64) {
        let mut queue = self.lock();
        while queue.done < seq {
            queue = self
                .completed
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The device thread: takes the queued operations in order.
    fn run(&self) {
        // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects only
        // the calling thread.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, DEVICE_TIMER_SLACK_NS, 0, 0, 0) };
        let shared = driver::shared().ok();
        let switch_cost_ns = crate::config::get().map_or(0, |cfg| cfg.switch_cost_ns);
        // When the device finished the previous operation: the next one
        // cannot be reached before.
        let mut finished = 0u64;
        let mut turn: Option<Turn> = None;
        loop {
            // The operation stays queued until done, so the queue's length
            // counts the one in progress.
            let (seq, submitted, op) = {
                let mut queue = self.lock();
                loop {
                    if let Some(&next) = queue.ops.front() {
                        break next;
                    }
                    // Out of work: a GPU switches to another context.
                    if let (Some(held), Some(shared)) = (turn.take(), shared) {
                        drop(queue);
                        shared.release_device(self.device, held.ticket, finished);
                        queue = self.lock();
                        continue;
                    }
                    queue = self
                        .work
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            // A GPU takes up work as soon as it arrives and the work before
            // it is done; this thread may wake up to it later, which must
            // not show in timestamps or kernel starts.
            let mut reached = submitted.max(finished);
            let needs_device = !matches!(op, Op::Wait { .. });
            match (needs_device, turn, shared) {
                (true, None, Some(shared)) => {
                    if let Ok(taken) = shared.acquire_device(self.device) {
                        // Waiting for another context's turn to end is not
                        // this work's time.
                        reached = reached.max(taken.free_since);
                        if taken.switched {
                            // The device passes from another process's work
                            // to this one's: it first spends the switch
                            // cost, as a GPU saves one context and loads the
                            // next, and that time is nobody's kernel time.
                            reached = reached.saturating_add(switch_cost_ns);
                            clock::sleep_until(reached);
                            shared.record_switch(self.device, switch_cost_ns);
                        }
                        turn = Some(Turn {
                            ticket: taken.ticket,
                            since: clock::now_ns(),
                        });
                    }
                }
                (false, Some(held), Some(shared)) => {
                    // Never hold the device while waiting for another one.
                    shared.release_device(self.device, held.ticket, finished);
                    turn = None;
                }
                _ => {}
            }
            finished = self.perform(seq, reached, op, turn.is_some());
            let mut queue = self.lock();
            queue.ops.pop_front();
            queue.done = seq;
            drop(queue);
            self.completed.notify_all();
            if let (Some(held), Some(shared)) = (turn, shared) {
                if clock::now_ns().saturating_sub(held.since) >= TIME_SLICE_NS
                    && shared.device_wanted(self.device)
                {
                    shared.release_device(self.device, held.ticket, finished);
                    turn = None;
                }
            }
        }
    }

    /// Performs operation `seq`, which the device reached at `reached`
    /// (`held`: this process holds the device). Returns when it finished.
    fn perform(&self, seq: u64, reached: u64, op: Op, held: bool) -> u64 {
        match op {
            Op::Kernel { duration_ns } => run_kernel(self.device, reached, duration_ns, held),
            Op::Record { event } => {
                let mut inner = driver::lock();
                if let Some(ev) = inner.events.get_mut(&event) {
                    // A later record of the same event supersedes this one.
                    if ev.pending == Some((self.device, seq)) {
                        ev.time = Some(reached);
                        ev.pending = None;
                    }
                }
                reached
            }
            Op::Wait { device, seq } => {
                if let Some(other) = executor(device) {
                    other.wait_for(seq);
                }
                clock::now_ns()
            }
        }
    }
}

/// The device as this process holds it (wall timing).
#[derive(Clone, Copy)]
struct Turn {
    ticket: u32,
    /// When it was taken.
    since: u64,
}

/// Runs one kernel on `device` in wall time from `start` (when it reached
/// the device, which `held` says this process holds): it ends when its
/// duration (varied by `SIMGPU_KERNEL_JITTER`) has passed, and the thread
/// sleeps until then. The kernel ends then however late the thread wakes:
/// a GPU's kernel does not run longer because a host thread was slow, only
/// its completion is seen later. Returns its end.
fn run_kernel(device: usize, start: u64, duration_ns: u64, held: bool) -> u64 {
    let duration_ns =
        crate::config::get().map_or(duration_ns, |cfg| cfg.draw_duration(duration_ns));
    let start = start.min(clock::now_ns());
    let end = start.saturating_add(duration_ns);
    if held {
        if let Ok(shared) = driver::shared() {
            // Without the state file nothing can be recorded; the kernel
            // still takes its time.
            let _ = shared.record_kernel(device, start, end);
        }
    }
    clock::sleep_until(end);
    end
}

/// This process's executors, one per visible device.
static EXECUTORS: AtomicPtr<Vec<Executor>> = AtomicPtr::new(std::ptr::null_mut());

/// The executor of this process's device `device` (created on first use);
/// `None` for a device the process does not see.
pub fn executor(device: usize) -> Option<&'static Executor> {
    let mut current = EXECUTORS.load(Ordering::Acquire);
    if current.is_null() {
        FORGET_AFTER_FORK.call_once(|| {
            // SAFETY: registering a plain extern "C" handler.
            unsafe { libc::pthread_atfork(None, None, Some(forget_after_fork)) };
        });
        let devices = crate::config::get().map_or(0, |cfg| cfg.devices);
        let fresh = Box::into_raw(Box::new(
            (0..devices).map(Executor::new).collect::<Vec<_>>(),
        ));
        current = match EXECUTORS.compare_exchange(
            std::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => fresh,
            Err(existing) => {
                // SAFETY: `fresh` came from Box::into_raw above and was never
                // published.
                drop(unsafe { Box::from_raw(fresh) });
                existing
            }
        };
    }
    // SAFETY: published executor lists are leaked, hence 'static.
    unsafe { &*current }.get(device)
}

/// Registers [`forget_after_fork`] once, with the first executor list.
static FORGET_AFTER_FORK: Once = Once::new();

/// In a fork child: the parent's device threads do not exist here; start
/// over (the old list, maybe locked by a thread that is gone, leaks).
extern "C" fn forget_after_fork() {
    EXECUTORS.store(std::ptr::null_mut(), Ordering::Release);
}

/// Spends `overhead_ns` of the calling thread's time, as a launch call
/// does before its work reaches the device. Spins: a few microseconds are
/// below what a sleep can hit, and the real call is CPU work too.
pub fn spend_launch_overhead(overhead_ns: u64) {
    if overhead_ns == 0 {
        return;
    }
    let deadline = clock::now_ns().saturating_add(overhead_ns);
    while clock::now_ns() < deadline {
        std::hint::spin_loop();
    }
}
