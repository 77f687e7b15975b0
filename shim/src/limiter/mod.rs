//! Compute shares: each container gets its share of a device's time.
//!
//! Every kernel (or graph) launch is charged the device time it is expected
//! to take against the container's token bucket for that device (in the
//! region, shared by all its processes), and waits while the container is
//! in debt. How long a launch takes is learned by timing a sample of
//! launches with events ([`kernels`], [`samples`]); a misprediction is
//! settled when the measurement arrives. Launches into a stream that is
//! being captured into a graph are not charged (they do not run); the graph
//! is charged when launched. The shim never waits on a capturing stream and
//! never polls events while any capture is active.

mod bucket;
mod kernels;
mod samples;

pub use kernels::LaunchKey;
pub use samples::Flavour;

use crate::driver::cuda as real;
use kernels::KernelTable;
use samples::{Outcome, Sample, Sampler};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vgpu_cuda_abi::cuda::*;
use vgpu_node_contract::region::{
    Region, UtilizationPolicy, MAX_DEVICES, SHARE_FULL, SHARE_UNLIMITED, UNCAPPED_SHARE,
};

/// Longest wait for the first timing of a kernel group.
const FIRST_SAMPLE_WAIT: Duration = Duration::from_secs(2);

/// A launch the limiter admitted, to be completed after the real call.
pub struct Admission {
    device: usize,
    charge: u64,
    entry: Option<usize>,
    sample: Option<Sample>,
}

pub struct Limiter {
    policy: UtilizationPolicy,
    /// This process's own lower share per device, in basis points
    /// ([`SHARE_UNLIMITED`]: none), which applies on top of its
    /// container's.
    ceilings: [u32; MAX_DEVICES],
    /// Whether any device has such a share (else a `Disable` policy
    /// limits nothing at all).
    any_ceiling: bool,
    /// Built on the first limited launch: most processes of a container
    /// never launch a kernel, and the table is a few hundred KiB.
    kernel_table: OnceLock<KernelTable>,
    sampler: Sampler,
    /// Stream captures in progress in this process.
    captures: AtomicUsize,
    /// The process sees one device, so every launch is on device 0.
    single_device: AtomicBool,
}

impl Limiter {
    /// A limiter applying `policy`, and `share_ceiling` (percent per
    /// device, [`UNCAPPED_SHARE`]: none) on top of the container's shares.
    pub fn new(policy: UtilizationPolicy, share_ceiling: &[u32; MAX_DEVICES]) -> Self {
        let ceilings = share_ceiling.map(|percent| match percent {
            UNCAPPED_SHARE => SHARE_UNLIMITED,
            percent => percent.saturating_mul(SHARE_FULL / 100),
        });
        Self {
            policy,
            ceilings,
            any_ceiling: ceilings.iter().any(|ceiling| *ceiling < SHARE_FULL),
            kernel_table: OnceLock::new(),
            sampler: Sampler::new(),
            captures: AtomicUsize::new(0),
            single_device: AtomicBool::new(false),
        }
    }

    #[inline(always)]
    fn kernels(&self) -> &KernelTable {
        self.kernel_table.get_or_init(KernelTable::new)
    }

    /// Called after `cuInit` with the number of visible devices.
    pub fn set_device_count(&self, count: i32) {
        self.single_device.store(count == 1, Ordering::Relaxed);
    }

    pub fn capture_started(&self) {
        self.captures.fetch_add(1, Ordering::AcqRel);
    }

    pub fn capture_ended(&self) {
        let _ = self
            .captures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    fn capturing_anywhere(&self) -> bool {
        self.captures.load(Ordering::Acquire) > 0
    }

    #[inline(always)]
    fn launch_device(&self) -> Option<usize> {
        if self.single_device.load(Ordering::Relaxed) {
            return Some(0);
        }
        let mut device: CUdevice = 0;
        // SAFETY: valid out-pointer.
        let code = unsafe { real::cuCtxGetDevice(&mut device) };
        (code == CUDA_SUCCESS && (0..MAX_DEVICES as CUdevice).contains(&device))
            .then_some(device as usize)
    }

    /// Admits a launch of `key` on `stream`, waiting for tokens if the
    /// container is over its share. `None` means the launch is not limited
    /// (no cap on its device, or it is being captured) and needs no
    /// completion.
    #[inline(always)]
    pub fn admit(
        &self,
        region: &Region,
        key: LaunchKey,
        stream: CUstream,
        flavour: Flavour,
    ) -> Option<Admission> {
        if self.policy == UtilizationPolicy::Disable && !self.any_ceiling {
            return None;
        }
        let device = self.launch_device()?;
        let record = &region.layout().devices[device];
        let limits = &region.enforced_limits().devices[device];
        let ceiling = self.ceilings[device];
        bucket::share(limits, self.policy, ceiling)?;
        if self.capturing_anywhere() && stream_is_capturing(stream, flavour) {
            return None;
        }
        let Some((index, entry)) = self.kernels().entry(&key) else {
            // Table full around this key: charge a typical launch, untimed.
            let charge = self.kernels().typical();
            bucket::spend(&record.compute, limits, self.policy, ceiling, charge);
            return Some(Admission {
                device,
                charge,
                entry: None,
                sample: None,
            });
        };
        let mut price = entry.price();
        if price == 0 && entry.sampling() && !self.capturing_anywhere() {
            // This kernel's first timing is in flight: wait for it rather
            // than admit a burst of launches of unknown cost.
            price = self.wait_for_first_sample(region, index);
        }
        let charge = if price == 0 {
            self.kernels().typical()
        } else {
            price
        };
        let due = entry.charge(charge);
        bucket::spend(&record.compute, limits, self.policy, ceiling, charge);
        let capturing = self.capturing_anywhere();
        // Before a timed launch's start event, so that nothing of the
        // host's comes between the event and the launch.
        if self.sampler.has_pending() && !capturing {
            self.poll(region);
        }
        let mut sample = if due {
            record
                .compute
                .last_launch_at
                .store(bucket::monotonic_ns(), Ordering::Relaxed);
            let sample = self
                .sampler
                .start(index, device, stream, flavour, !capturing);
            if sample.is_none() {
                entry.abandon_sample();
            }
            sample
        } else {
            None
        };
        if let Some(sample) = sample.as_mut() {
            sample.launching();
        }
        Some(Admission {
            device,
            charge,
            entry: Some(index),
            sample,
        })
    }

    /// Completes an admitted launch after the real call returned `code`.
    pub fn finish(
        &self,
        region: &Region,
        admission: Admission,
        stream: CUstream,
        flavour: Flavour,
        code: CUresult,
    ) {
        let launched = code == CUDA_SUCCESS;
        if let Some(sample) = admission.sample {
            let entry = sample.entry;
            if !self.sampler.finish(sample, stream, flavour, launched) {
                if let Some(stats) = self.kernels().get(entry) {
                    stats.abandon_sample();
                }
            }
        }
        if !launched {
            bucket::refund(
                &region.layout().devices[admission.device].compute,
                admission.charge,
            );
            if let Some(stats) = admission.entry.and_then(|e| self.kernels().get(e)) {
                stats.uncharge(admission.charge);
            }
        }
    }

    /// Charges a launch on `device` without timing it (launch forms whose
    /// streams the shim cannot time, such as multi-device cooperative
    /// launches).
    pub fn charge_untimed(&self, region: &Region, device: usize, key: LaunchKey) {
        if (self.policy == UtilizationPolicy::Disable && !self.any_ceiling) || device >= MAX_DEVICES
        {
            return;
        }
        let record = &region.layout().devices[device];
        let limits = &region.enforced_limits().devices[device];
        let ceiling = self.ceilings[device];
        if bucket::share(limits, self.policy, ceiling).is_none() {
            return;
        }
        let charge = match self.kernels().entry(&key) {
            Some((_, entry)) if entry.price() > 0 => entry.price(),
            _ => self.kernels().typical(),
        };
        bucket::spend(&record.compute, limits, self.policy, ceiling, charge);
    }

    fn wait_for_first_sample(&self, region: &Region, index: usize) -> u64 {
        let started = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            self.poll(region);
            let Some(entry) = self.kernels().get(index) else {
                return 0;
            };
            let price = entry.price();
            if price != 0 || !entry.sampling() || started.elapsed() > FIRST_SAMPLE_WAIT {
                return price;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Folds finished samples into the prices and settles corrections.
    fn poll(&self, region: &Region) {
        // A sample is good to within about a launch call: that much of the
        // host's part is taken off it, give or take the call's own spread.
        let slack = self.sampler.fastest_launch_ns();
        self.sampler.poll(|entry, device, outcome| match outcome {
            Outcome::Measured(nanos) => {
                let correction = self.kernels().record(entry, nanos, slack);
                tracing::trace!(
                    entry,
                    device,
                    measured_ns = nanos,
                    price_ns = self.kernels().get(entry).map_or(0, |stats| stats.price()),
                    correction,
                    "kernel timed"
                );
                if correction != 0 {
                    bucket::correct(&region.layout().devices[device].compute, correction);
                }
            }
            Outcome::Lost => {
                if let Some(stats) = self.kernels().get(entry) {
                    stats.abandon_sample();
                }
            }
        });
    }

    /// A context was destroyed: forget its events and samples.
    pub fn forget_context(&self, context: usize) {
        for entry in self.sampler.forget_context(context) {
            if let Some(stats) = self.kernels().get(entry) {
                stats.abandon_sample();
            }
        }
    }

    pub fn before_fork(&self) {
        self.sampler.before_fork();
    }

    pub fn after_fork_in_parent(&self) {
        self.sampler.after_fork_in_parent();
    }

    pub fn after_fork_in_child(&self) {
        self.sampler.after_fork_in_child();
        if let Some(kernels) = self.kernel_table.get() {
            kernels.reset_after_fork();
        }
        self.captures.store(0, Ordering::Relaxed);
    }
}

fn stream_is_capturing(stream: CUstream, flavour: Flavour) -> bool {
    let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream; valid out-pointer.
    let code = unsafe {
        match flavour {
            Flavour::Legacy => real::cuStreamIsCapturing(stream, &mut status),
            Flavour::PerThread => real::cuStreamIsCapturing_ptsz(stream, &mut status),
        }
    };
    // If the driver cannot say, treat the stream as capturing: charging a
    // launch that does not run is the smaller harm than syncing a capture.
    code != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE
}
