//! Timing launches with events, without ever waiting for them on the launch
//! path: a sampled launch is bracketed by two events on its own stream, and
//! later launches poll the finished pairs.

use crate::driver::cuda as real;
use crate::lock::ForkSafeLock;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// A timed launch in flight.
pub struct Sample {
    pub entry: usize,
    pub device: usize,
    context: usize,
    start: CUevent,
    end: CUevent,
    /// The stream had no work queued when the start event was recorded, so
    /// the event completed at once and the kernel could only start after the
    /// host had also issued the launch: that host-side gap is not kernel
    /// time. (On a busy stream both wait for the same earlier work.) The gap
    /// is measured from *after* the record call returned to *before* the
    /// launch call, so it is never more than the device saw, and a corrected
    /// sample can still only err upwards.
    idle_stream: bool,
    recorded_at: u64,
    launched_at: u64,
}

impl Sample {
    /// Marks the moment just before the real launch call.
    pub fn launching(&mut self) {
        self.launched_at = super::bucket::monotonic_ns();
    }

    fn kernel_ns(&self, elapsed_ns: u64) -> u64 {
        if self.idle_stream {
            elapsed_ns.saturating_sub(self.launched_at.saturating_sub(self.recorded_at))
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
        }
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

    /// Records the start event of a timed launch on `stream`.
    pub fn start(
        &self,
        entry: usize,
        device: usize,
        stream: CUstream,
        flavour: Flavour,
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
        let idle_stream = stream_idle(stream, flavour);
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
            recorded_at,
            launched_at: recorded_at,
        })
    }

    /// Records the end event after the launch. Returns false (and recycles
    /// the events) if the launch failed or the event could not be recorded.
    pub fn finish(
        &self,
        sample: Sample,
        stream: CUstream,
        flavour: Flavour,
        launched: bool,
    ) -> bool {
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
                Outcome::Measured(sample.kernel_ns((milliseconds as f64 * 1e6) as u64))
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
