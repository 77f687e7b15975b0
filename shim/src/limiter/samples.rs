//! Timing launches with events, without ever waiting for them on the launch
//! path: a sampled launch is bracketed by two events on its own stream, and
//! later launches poll the finished pairs.

use crate::driver::cuda as real;
use crate::lock::ForkSafeLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use vgpu_cuda_abi::cuda::*;

/// How a launch names the default stream: the legacy one, or the calling
/// thread's own (`_ptsz` entry points). Events must be recorded the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    Legacy,
    PerThread,
}

impl Flavour {
    /// The flavour of a hooked entry point (`per_thread`: its `_ptsz` twin).
    pub fn of(per_thread: bool) -> Self {
        if per_thread {
            Self::PerThread
        } else {
            Self::Legacy
        }
    }
}

/// Events kept for reuse per process.
const POOL_LIMIT: usize = 256;
/// How long after a timed launch on an idle stream its start event is
/// polled for. An idle device has completed it within microseconds (an H200
/// makes it visible about 5 us after the record); one busy with another
/// context has not, and the sample is then taken as it comes.
const START_EVENT_WAIT_NS: u64 = 10_000;
/// Longest gap between the start event's record and the launch call that
/// is taken off an idle stream's timing. The host's own time there is
/// microseconds; a longer gap means the thread was preempted, and then the
/// device may have stamped the event late too (a device thread starved on
/// a busy host, as the simulated GPU's can be), so the gap may not be in
/// the timing at all: taking it off would price the kernel below what it
/// ran, and the container over its share. Such a timing is taken whole:
/// over, never under, and the price's cluster at the bottom of the window
/// leaves it out.
const MAX_HOST_GAP_NS: u64 = 50_000;
/// Timed launch calls (after a process's first) before the fastest of them
/// is taken as what a call costs. A thread can be preempted inside a call
/// after its kernel left, and the call then returns after the kernel ended:
/// taking that call's time off its own timing priced a 1 ms kernel at a
/// microsecond, which held for the window's 64 samples. The fastest of
/// eight calls is held up only if all eight were; until then no call's time
/// is taken off (a timing over, never under).
///
/// Only a call whose work was still running when it returned counts: one
/// whose stream was idle by then may have held the kernel's whole run (a
/// launch that blocks, as every launch does under `CUDA_LAUNCH_BLOCKING=1`,
/// or a thread preempted in the call). Counting such calls made the fastest
/// "call" a whole kernel, and taking that off every timing priced kernels
/// that finish inside their call at nothing: a process that set one
/// variable ran far above its share.
const TRUSTED_LAUNCH_CALLS: u64 = 8;

/// A timed launch in flight.
pub struct Sample {
    pub entry: usize,
    pub device: usize,
    context: usize,
    start: CUevent,
    end: CUevent,
    /// The stream had no work queued when the start event was recorded, so
    /// the event completed as soon as it reached the device, and the kernel
    /// could only start once the host had also issued the launch: that
    /// host-side gap is not kernel time. Each call hands its work over at
    /// its end, so the gap runs from the return of the record call to the
    /// end of the launch call: the host's own time before the launch and the
    /// launch call's cost (the launch overhead: microseconds, a fifth more
    /// than a 20 us kernel ran). The call's cost is counted as at most the
    /// fastest launch call seen, so a thread preempted inside the call after
    /// its kernel left does not make the kernel look shorter than it ran;
    /// and a gap before the call longer than [`MAX_HOST_GAP_NS`] is not
    /// taken off at all.
    idle_stream: bool,
    /// The start event was seen complete right after the launch (at this
    /// time). If it was not, the device was busy with another context's
    /// work: the event is then stamped when this context's turn comes,
    /// with the kernel right behind it, and the host's gap is not in the
    /// timing at all. (The check waits until after the launch: waiting for
    /// the event before it would put the wait into the gap, and an event
    /// becomes visible microseconds after the device stamped it.)
    start_seen_at: Option<u64>,
    /// No capture was in progress when the launch was admitted, so its
    /// stream may be queried.
    may_query: bool,
    /// When the start event's record call returned.
    recorded_at: u64,
    launched_at: u64,
    returned_at: u64,
    /// The launch's work had finished when its call returned (a launch
    /// that blocks): the end event, recorded on an idle stream, is then
    /// stamped when it is recorded, and the host's time from the return to
    /// that record (`end_recorded_at`) is not kernel time either.
    done_in_call: bool,
    /// When the end event's record was made.
    end_recorded_at: u64,
}

impl Sample {
    /// Marks the moment just before the real launch call.
    pub fn launching(&mut self) {
        self.launched_at = super::bucket::monotonic_ns();
    }

    /// The launch call's own time, from [`Sample::launching`] to its return.
    fn launch_call_ns(&self) -> u64 {
        self.returned_at.saturating_sub(self.launched_at)
    }

    /// The kernel's time, from the events' `elapsed_ns`; `fastest_launch_ns`
    /// is the fastest launch call seen (0: not known yet).
    fn kernel_ns(&self, elapsed_ns: u64, fastest_launch_ns: u64) -> u64 {
        let before_launch = self.launched_at.saturating_sub(self.recorded_at);
        if self.idle_stream && self.start_seen_at.is_some() && before_launch <= MAX_HOST_GAP_NS {
            let launch = self.launch_call_ns().min(fastest_launch_ns);
            let after_call = if self.done_in_call {
                self.end_recorded_at
                    .saturating_sub(self.returned_at)
                    .min(MAX_HOST_GAP_NS)
            } else {
                0
            };
            elapsed_ns.saturating_sub(before_launch + launch + after_call)
        } else {
            elapsed_ns
        }
    }
}

// SAFETY: event handles are plain driver handles, valid from any thread.
unsafe impl Send for Sample {}

struct PooledEvent {
    context: usize,
    event: CUevent,
}

// SAFETY: as for Sample.
unsafe impl Send for PooledEvent {}

/// How a finished sample came out.
pub enum Outcome {
    Measured(u64),
    Lost,
}

pub struct Sampler {
    pending: ForkSafeLock<Vec<Sample>>,
    pending_count: AtomicUsize,
    pool: ForkSafeLock<Vec<PooledEvent>>,
    /// The shortest timed launch call so far (ns): what handing a kernel to
    /// the device costs the host when nothing interrupts the call. A
    /// process's first launch call is left out: it carries one-off set-up,
    /// some of it after the kernel has left.
    fastest_launch_ns: AtomicU64,
    timed_calls: AtomicU64,
}

fn stream_idle(stream: CUstream, flavour: Flavour) -> bool {
    // SAFETY: the caller's stream.
    let code = unsafe {
        match flavour {
            Flavour::Legacy => real::cuStreamQuery(stream),
            Flavour::PerThread => real::cuStreamQuery_ptsz(stream),
        }
    };
    code == CUDA_SUCCESS
}

/// Polls a recorded event for up to [`START_EVENT_WAIT_NS`]; returns when
/// it was first seen complete.
fn seen_complete(event: CUevent) -> Option<u64> {
    let started = super::bucket::monotonic_ns();
    loop {
        // SAFETY: an event just recorded by the caller.
        let code = unsafe { real::cuEventQuery(event) };
        let now = super::bucket::monotonic_ns();
        if code == CUDA_SUCCESS {
            return Some(now);
        }
        if code != CUDA_ERROR_NOT_READY || now.saturating_sub(started) > START_EVENT_WAIT_NS {
            return None;
        }
        std::hint::spin_loop();
    }
}

fn record(event: CUevent, stream: CUstream, flavour: Flavour) -> bool {
    // SAFETY: a live event of the current context and the caller's stream.
    let code = unsafe {
        match flavour {
            Flavour::Legacy => real::cuEventRecord(event, stream),
            Flavour::PerThread => real::cuEventRecord_ptsz(event, stream),
        }
    };
    code == CUDA_SUCCESS
}

impl Sampler {
    pub fn new() -> Self {
        Self {
            pending: ForkSafeLock::new(Vec::new()),
            pending_count: AtomicUsize::new(0),
            pool: ForkSafeLock::new(Vec::new()),
            fastest_launch_ns: AtomicU64::new(0),
            timed_calls: AtomicU64::new(0),
        }
    }

    /// The fastest timed launch call so far; 0 until
    /// [`TRUSTED_LAUNCH_CALLS`] calls after the first were timed.
    pub fn fastest_launch_ns(&self) -> u64 {
        if self.timed_calls.load(Ordering::Relaxed) > TRUSTED_LAUNCH_CALLS {
            self.fastest_launch_ns.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// Counts a timed launch call of `call_ns`.
    fn note_launch_call(&self, call_ns: u64) {
        if self.timed_calls.fetch_add(1, Ordering::Relaxed) == 0 {
            return;
        }
        let call = call_ns.max(1);
        let _ =
            self.fastest_launch_ns
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |fastest| {
                    (fastest == 0 || call < fastest).then_some(call)
                });
    }

    pub fn has_pending(&self) -> bool {
        self.pending_count.load(Ordering::Relaxed) > 0
    }

    fn take_event(&self, context: usize) -> Option<CUevent> {
        let pooled = self.pool.with(|pool| {
            pool.iter()
                .position(|e| e.context == context)
                .map(|index| pool.swap_remove(index).event)
        });
        if pooled.is_some() {
            return pooled;
        }
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the event belongs to the current context.
        (unsafe { real::cuEventCreate(&mut event, 0) } == CUDA_SUCCESS).then_some(event)
    }

    fn give_back(&self, context: usize, event: CUevent) {
        let kept = self.pool.with(|pool| {
            if pool.len() < POOL_LIMIT {
                pool.push(PooledEvent { context, event });
                true
            } else {
                false
            }
        });
        if !kept {
            // SAFETY: an event we created and no longer use.
            unsafe {
                real::cuEventDestroy_v2(event);
            }
        }
    }

    /// Records the start event of a timed launch on `stream`. `may_query`:
    /// no capture is in progress, so the event may be polled after the
    /// launch.
    pub fn start(
        &self,
        entry: usize,
        device: usize,
        stream: CUstream,
        flavour: Flavour,
        may_query: bool,
    ) -> Option<Sample> {
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        if unsafe { real::cuCtxGetCurrent(&mut context) } != CUDA_SUCCESS || context.is_null() {
            return None;
        }
        let context = context as usize;
        let start = self.take_event(context)?;
        let Some(end) = self.take_event(context) else {
            self.give_back(context, start);
            return None;
        };
        // No stream is queried while a capture is in progress anywhere.
        let idle_stream = may_query && stream_idle(stream, flavour);
        if !record(start, stream, flavour) {
            self.give_back(context, start);
            self.give_back(context, end);
            return None;
        }
        let recorded_at = super::bucket::monotonic_ns();
        Some(Sample {
            entry,
            device,
            context,
            start,
            end,
            idle_stream,
            may_query,
            start_seen_at: None,
            recorded_at,
            launched_at: recorded_at,
            returned_at: recorded_at,
            done_in_call: false,
            end_recorded_at: recorded_at,
        })
    }

    /// Records the end event after the launch. Returns false (and recycles
    /// the events) if the launch failed or the event could not be recorded.
    pub fn finish(
        &self,
        mut sample: Sample,
        stream: CUstream,
        flavour: Flavour,
        launched: bool,
    ) -> bool {
        sample.returned_at = super::bucket::monotonic_ns();
        // Whether the launch's work was still running when its call
        // returned (asked before anything else is queued on the stream):
        // only then is the call's time the call's alone.
        let running_after_call = launched && sample.may_query && !stream_idle(stream, flavour);
        if launched && sample.idle_stream {
            sample.start_seen_at = seen_complete(sample.start);
        }
        if running_after_call {
            self.note_launch_call(sample.launch_call_ns());
        }
        sample.done_in_call = launched && sample.may_query && !running_after_call;
        sample.end_recorded_at = super::bucket::monotonic_ns();
        if !launched || !record(sample.end, stream, flavour) {
            self.give_back(sample.context, sample.start);
            self.give_back(sample.context, sample.end);
            return false;
        }
        self.pending.with(|pending| pending.push(sample));
        self.pending_count.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Hands each finished sample to `done(entry, device, outcome)`. Never
    /// waits: a sample whose end event has not completed stays pending, and
    /// if another thread is polling this returns at once.
    pub fn poll(&self, mut done: impl FnMut(usize, usize, Outcome)) {
        if !self.has_pending() {
            return;
        }
        let finished = self.pending.try_with(|pending| {
            let mut finished = Vec::new();
            let mut index = 0;
            while index < pending.len() {
                // SAFETY: an event recorded by `finish`.
                let code = unsafe { real::cuEventQuery(pending[index].end) };
                if code == CUDA_ERROR_NOT_READY {
                    index += 1;
                } else {
                    finished.push((pending.swap_remove(index), code));
                }
            }
            finished
        });
        let Some(finished) = finished else { return };
        self.pending_count
            .fetch_sub(finished.len(), Ordering::Relaxed);
        for (sample, code) in finished {
            let mut milliseconds = 0f32;
            let outcome = if code == CUDA_SUCCESS
                // SAFETY: both events completed; valid out-pointer.
                && unsafe { real::cuEventElapsedTime(&mut milliseconds, sample.start, sample.end) } == CUDA_SUCCESS
                && milliseconds.is_finite()
                && milliseconds >= 0.0
            {
                let elapsed_ns = (milliseconds as f64 * 1e6) as u64;
                let kernel_ns = sample.kernel_ns(elapsed_ns, self.fastest_launch_ns());
                tracing::trace!(
                    elapsed_ns,
                    kernel_ns,
                    start_seen_ns = sample
                        .start_seen_at
                        .map_or(0, |seen| seen.saturating_sub(sample.returned_at)),
                    launch_call_ns = sample.launch_call_ns(),
                    "sample"
                );
                Outcome::Measured(kernel_ns)
            } else {
                Outcome::Lost
            };
            self.give_back(sample.context, sample.start);
            self.give_back(sample.context, sample.end);
            done(sample.entry, sample.device, outcome);
        }
    }

    /// A context was destroyed: its events went with it. Returns the kernel
    /// entries whose samples were lost.
    pub fn forget_context(&self, context: usize) -> Vec<usize> {
        self.pool.with(|pool| pool.retain(|e| e.context != context));
        let lost = self.pending.with(|pending| {
            let lost: Vec<usize> = pending
                .iter()
                .filter(|s| s.context == context)
                .map(|s| s.entry)
                .collect();
            pending.retain(|s| s.context != context);
            lost
        });
        self.pending_count.fetch_sub(lost.len(), Ordering::Relaxed);
        lost
    }

    pub fn before_fork(&self) {
        self.pending.before_fork();
        self.pool.before_fork();
    }

    pub fn after_fork_in_parent(&self) {
        self.pool.after_fork_in_parent();
        self.pending.after_fork_in_parent();
    }

    /// The child has no CUDA contexts: forget (do not destroy) every event.
    pub fn after_fork_in_child(&self) {
        self.pool.after_fork_in_child(Vec::clear);
        self.pending.after_fork_in_child(Vec::clear);
        self.pending_count.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timed launch whose start event was seen complete `seen_after` ns
    /// after the record returned (`None`: busy stream), launched
    /// `launched_after` ns after that record, in a call of `call` ns.
    /// A timed launch made `launched_after` ns after its start event's
    /// record returned, in a call of `call` ns, on an idle stream or not,
    /// with the start event seen complete after the launch or not.
    fn sample(idle_stream: bool, seen: bool, launched_after: u64, call: u64) -> Sample {
        let recorded_at = 1_000_000;
        let returned_at = recorded_at + launched_after + call;
        Sample {
            entry: 0,
            device: 0,
            context: 0,
            start: std::ptr::null_mut(),
            end: std::ptr::null_mut(),
            idle_stream,
            may_query: true,
            start_seen_at: seen.then_some(returned_at + 500),
            recorded_at,
            launched_at: recorded_at + launched_after,
            returned_at,
            done_in_call: false,
            end_recorded_at: returned_at,
        }
    }

    #[test]
    fn the_fastest_launch_call_counts_once_enough_calls_were_timed() {
        let sampler = Sampler::new();
        // The first call (one-off set-up), then one held up 2.9 ms after
        // its kernel left: neither is what a call costs.
        sampler.note_launch_call(900_000);
        sampler.note_launch_call(2_900_000);
        assert_eq!(sampler.fastest_launch_ns(), 0);
        for call in 0..TRUSTED_LAUNCH_CALLS - 2 {
            sampler.note_launch_call(5_000 + call);
        }
        assert_eq!(
            sampler.fastest_launch_ns(),
            0,
            "seven calls after the first"
        );
        sampler.note_launch_call(6_000);
        assert_eq!(sampler.fastest_launch_ns(), 5_000);
        // Until then the held-up call's timing is taken whole: over, not
        // under (it was 1 us after taking its own call off).
        let held_up = sample(true, true, 1_000, 2_900_000);
        assert_eq!(held_up.kernel_ns(2_902_000, 0), 2_901_000);
    }

    #[test]
    fn an_idle_stream_sample_leaves_out_the_host_gap_and_the_launch_call() {
        // Launched 1000 ns after the record, in a 4000 ns call: 5000 ns of
        // the 25 us were the host's.
        assert_eq!(
            sample(true, true, 1_000, 4_000).kernel_ns(25_000, 4_000),
            20_000
        );
    }

    #[test]
    fn a_call_longer_than_the_fastest_counts_only_the_fastest() {
        // Preempted inside the call after the kernel left: only what a
        // launch call costs when nothing interrupts it is the host's.
        assert_eq!(
            sample(true, true, 1_000, 900_000).kernel_ns(25_000, 4_000),
            20_000
        );
        // The first timed call (no fastest yet) may carry one-off set-up
        // after the kernel left: none of it is taken off.
        assert_eq!(
            sample(true, true, 1_000, 4_000).kernel_ns(25_000, 0),
            24_000
        );
    }

    #[test]
    fn a_thread_preempted_before_its_launch_takes_the_timing_whole() {
        // 300 us between the record and the launch: the device may have
        // stamped the start event late as well, so the gap is not taken
        // off (a 1 ms kernel priced at 0.7 ms would run its container 40 %
        // over its share).
        assert_eq!(
            sample(true, true, 300_000, 4_000).kernel_ns(1_000_000, 4_000),
            1_000_000
        );
        // Up to the bound, the gap is the host's and is taken off.
        assert_eq!(
            sample(true, true, MAX_HOST_GAP_NS, 4_000).kernel_ns(1_000_000, 4_000),
            1_000_000 - MAX_HOST_GAP_NS - 4_000
        );
    }

    #[test]
    fn busy_streams_and_start_events_not_seen_complete_are_taken_as_measured() {
        assert_eq!(
            sample(false, true, 1_000, 4_000).kernel_ns(25_000, 4_000),
            25_000
        );
        // The device was busy with another context: the event and the
        // kernel ran back to back when its turn came.
        assert_eq!(
            sample(true, false, 1_000, 4_000).kernel_ns(25_000, 4_000),
            25_000
        );
        // Never below zero.
        assert_eq!(sample(true, true, 9_000, 4_000).kernel_ns(5_000, 4_000), 0);
    }

    #[test]
    fn a_kernel_that_finished_inside_its_call_is_priced_at_the_call_not_at_nothing() {
        // Every call blocked for its 1 ms kernel, so `finish` noted none of
        // them: no call's time is known, and none is taken off.
        let mut blocked = sample(true, true, 1_000, 1_004_000);
        blocked.done_in_call = true;
        blocked.end_recorded_at = blocked.returned_at + 3_000;
        // Record, 1 us, a 1.004 ms call holding the kernel, 3 us of the
        // shim's own before the end record: the kernel and the call, never
        // less.
        assert_eq!(blocked.kernel_ns(1_008_000, 0), 1_004_000);
        // A long gap after the call (a preempted thread) is not taken off
        // beyond the bound.
        blocked.end_recorded_at = blocked.returned_at + 400_000;
        assert_eq!(
            blocked.kernel_ns(1_405_000, 0),
            1_405_000 - 1_000 - MAX_HOST_GAP_NS
        );
    }
}
