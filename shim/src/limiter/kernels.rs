//! What each kernel costs: device time learned from timed launches.
//!
//! Launches are grouped by function and launch shape (grid, block, shared
//! memory), since the same kernel takes longer on a larger grid. A launch is
//! charged its group's current price; a sample of launches is timed with
//! events, and the price is the mean of the cluster of recent samples at
//! the bottom of the window: those within an eighth above the smallest, or
//! within a narrower reach when the kernel runs tighter ([`Window::price`]).
//!
//! Two things move a timing. A kernel's own time varies from run to run
//! (clocks, memory: an H100 ran one product in 1.39 to 1.65 ms), and the
//! device time it used is its mean: charging the *smallest* of 32 timings,
//! as this module once did, charged the fast tail, 3 to 5 % less than the
//! kernels used, and a container at 50 % got 52.2 % of the device (the
//! simulated GPU, its kernels varying 5 % either way). And a timing can
//! include a wait for the device behind other work (another container's, or
//! this process's other streams'), which is not this kernel's time: it only
//! ever lengthens a timing, by up to a whole other kernel. So the price is
//! the mean of the cluster at the bottom of the window: the timings no more
//! than an eighth above the smallest, which holds a kernel's own spread and
//! leaves out timings lengthened by a wait of more than an eighth of the
//! kernel; and when the timings within a thirty-second (or a sixteenth) of
//! the smallest are at least six and the next reach adds fewer than a
//! quarter more, the kernel runs that tightly and the cluster ends there, so
//! fewer short waits count. Every reach is a launch call's worth longer: the
//! host's part taken off a timing (see `samples`) can be that far out, which
//! on a 20 us kernel is a tenth. (The lower quartile fails where more than
//! three quarters of the timings waited, as the 30 of two containers at 30
//! and 70 % does on the simulated GPU.) If the kernel really slows down,
//! every recent sample rises and so does the price.
//!
//! When the price changes, launches charged at the old price since the last
//! change are settled at the new one, so a misprediction is paid back (or
//! refunded) rather than lost.

use crate::lock::ForkSafeLock;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Groups tracked per process (a model with more distinct kernel shapes
/// charges the rest at the typical price, untimed).
const TABLE_SIZE: usize = 1024;
/// Slots probed for a group before giving up on tracking it.
const PROBES: usize = 8;
/// Samples the price is taken from. Under contention most samples include
/// a wait behind other work; the window must be long enough to hold enough
/// clean ones. (Kept as `f32`: 7 significant digits, and 256 bytes a group.)
const WINDOW: usize = 64;
/// How far above the window's smallest sample the price's cluster may
/// reach, narrowest first: at most an eighth (a kernel's own spread, a few
/// percent either way, fits; a wait behind another kernel mostly does not).
const CLUSTER_WIDTHS: [f64; 3] = [1.0 / 32.0, 1.0 / 16.0, 1.0 / 8.0];
/// A narrower cluster is taken when it holds at least this many samples and
/// the next width adds fewer than a quarter more: the kernel runs tighter
/// than the widest cluster, and what lies beyond it waited.
const CLUSTER_MIN_SAMPLES: u32 = 6;
const CLUSTER_GROWTH: f64 = 1.25;
/// Timing costs two event records, so cheap kernels are timed rarely and
/// expensive ones often: a group is timed every `SAMPLE_SPACING_NS / price`
/// launches, at least every launch and at most every `MAX_SAMPLE_EVERY`th.
const SAMPLE_SPACING_NS: u64 = 2_000_000;
pub const MAX_SAMPLE_EVERY: u64 = 256;

/// Every how many launches a group with this price is timed.
#[inline(always)]
fn sample_every(price_ns: u64) -> u64 {
    (SAMPLE_SPACING_NS / price_ns.max(1)).clamp(1, MAX_SAMPLE_EVERY)
}

/// What identifies a group of launches.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct LaunchKey {
    pub function: usize,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

impl LaunchKey {
    /// A whole CUDA graph, timed as one unit.
    pub fn graph(exec: usize) -> Self {
        Self {
            function: exec,
            grid: [u32::MAX; 3],
            block: [0; 3],
            shared_bytes: 0,
        }
    }

    /// A table index, not a defence against chosen inputs, so a few
    /// multiply-rotate rounds (as in rustc's FxHash) instead of SipHash,
    /// which would cost hundreds of instructions per launch.
    #[inline(always)]
    fn hash64(&self) -> u64 {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let words = [
            self.function as u64,
            self.grid[0] as u64 | (self.grid[1] as u64) << 32,
            self.grid[2] as u64 | (self.block[0] as u64) << 32,
            self.block[1] as u64 | (self.block[2] as u64) << 32,
            self.shared_bytes as u64,
        ];
        let mut hash = 0u64;
        for word in words {
            hash = (hash.rotate_left(5) ^ word).wrapping_mul(K);
        }
        // Fold the high bits down (the index uses the low ones); 0 marks an
        // empty slot.
        (hash ^ (hash >> 29)) | 1
    }
}

/// The recent samples of a group, in nanoseconds.
struct Window {
    samples: [f32; WINDOW],
    len: usize,
    next: usize,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            samples: [0.0; WINDOW],
            len: 0,
            next: 0,
        }
    }
}

impl Window {
    /// Adds a sample; returns the new price (see [`Window::price`]).
    fn push(&mut self, sample: u64, slack_ns: u64) -> u64 {
        self.samples[self.next] = sample as f32;
        self.next = (self.next + 1) % WINDOW;
        self.len = (self.len + 1).min(WINDOW);
        self.price(slack_ns)
    }

    /// The mean of the cluster at the bottom of the window: the samples
    /// within one of [`CLUSTER_WIDTHS`] above the smallest, plus `slack_ns`
    /// (how far the host's part taken off a sample can be out: a sample of
    /// a 20 us kernel can be a microsecond short or long).
    fn price(&self, slack_ns: u64) -> u64 {
        let samples = &self.samples[..self.len];
        let smallest = f64::from(samples.iter().copied().fold(f32::INFINITY, f32::min));
        if !smallest.is_finite() {
            return 0;
        }
        let mut sums = [0.0f64; CLUSTER_WIDTHS.len()];
        let mut counts = [0u32; CLUSTER_WIDTHS.len()];
        for &sample in samples {
            let sample = f64::from(sample);
            for (width, (sum, count)) in CLUSTER_WIDTHS
                .iter()
                .zip(sums.iter_mut().zip(counts.iter_mut()))
            {
                if sample <= smallest * (1.0 + width) + slack_ns as f64 {
                    *sum += sample;
                    *count += 1;
                }
            }
        }
        let chosen = (0..CLUSTER_WIDTHS.len() - 1)
            .find(|&i| {
                counts[i] >= CLUSTER_MIN_SAMPLES
                    && f64::from(counts[i + 1]) < CLUSTER_GROWTH * f64::from(counts[i])
            })
            .unwrap_or(CLUSTER_WIDTHS.len() - 1);
        (sums[chosen] / f64::from(counts[chosen].max(1)))
            .round()
            .max(1.0) as u64
    }
}

/// One group's learned cost.
pub struct KernelStats {
    key: AtomicU64,
    /// What a launch is charged now; 0 until the first sample.
    price_ns: AtomicU64,
    /// Launches of the group so far.
    launches: AtomicU64,
    /// `launches` at the last settlement: the launches since were charged
    /// `price_ns` each, plus `unsettled_extra_ns` in all (provisional charges
    /// that differed from the price).
    settled_launches: AtomicU64,
    unsettled_extra_ns: AtomicI64,
    /// A timed launch of this group is in flight.
    sampling: AtomicBool,
    window: ForkSafeLock<Window>,
}

impl KernelStats {
    fn new() -> Self {
        Self {
            key: AtomicU64::new(0),
            price_ns: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            settled_launches: AtomicU64::new(0),
            unsettled_extra_ns: AtomicI64::new(0),
            sampling: AtomicBool::new(false),
            window: ForkSafeLock::new(Window::default()),
        }
    }

    /// The current price, 0 when the group has never been timed.
    #[inline(always)]
    pub fn price(&self) -> u64 {
        self.price_ns.load(Ordering::Acquire)
    }

    /// Counts a launch charged `charged_ns` and says whether to time it.
    #[inline(always)]
    pub fn charge(&self, charged_ns: u64) -> bool {
        let nth = self.launches.fetch_add(1, Ordering::Relaxed);
        let price = self.price();
        if charged_ns != price {
            self.unsettled_extra_ns
                .fetch_add(charged_ns as i64 - price as i64, Ordering::Relaxed);
        }
        let due = price == 0 || nth.is_multiple_of(sample_every(price));
        due && self.try_start_sample()
    }

    /// Takes back a launch the driver refused: it stays counted, but its
    /// charge is removed from what will be settled.
    pub fn uncharge(&self, charged_ns: u64) {
        self.unsettled_extra_ns
            .fetch_sub(charged_ns as i64, Ordering::Relaxed);
    }

    /// Claims the group's one in-flight sample.
    pub fn try_start_sample(&self) -> bool {
        self.sampling
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// The timed launch was not made or its timing was lost.
    pub fn abandon_sample(&self) {
        self.sampling.store(false, Ordering::Release);
    }

    /// Whether a sample is in flight.
    pub fn sampling(&self) -> bool {
        self.sampling.load(Ordering::Acquire)
    }

    /// Folds in a timed launch of `measured_ns` (good to within `slack_ns`,
    /// see [`Window::price`]). Returns the correction owed for the launches
    /// since the last sample, settled at the new price (positive: they were
    /// undercharged).
    pub fn record(&self, measured_ns: u64, slack_ns: u64) -> i64 {
        let measured_ns = measured_ns.max(1);
        let new_price = self
            .window
            .with(|window| window.push(measured_ns, slack_ns));
        let old_price = self.price_ns.swap(new_price, Ordering::AcqRel);
        let launches = self.launches.load(Ordering::Acquire);
        let settled = self.settled_launches.swap(launches, Ordering::AcqRel);
        let extra = self.unsettled_extra_ns.swap(0, Ordering::AcqRel);
        self.sampling.store(false, Ordering::Release);
        let unsettled = launches.saturating_sub(settled) as i128;
        let charged = old_price as i128 * unsettled + extra as i128;
        let owed = new_price as i128 * unsettled - charged;
        owed.clamp(i64::MIN as i128, i64::MAX as i128) as i64
    }

    fn reset_after_fork(&self) {
        // The child is single-threaded: a window lock held by a parent thread
        // at fork time is simply released.
        self.window
            .reset_in_child(|window| *window = Window::default());
        self.sampling.store(false, Ordering::Relaxed);
        self.settled_launches
            .store(self.launches.load(Ordering::Relaxed), Ordering::Relaxed);
        self.unsettled_extra_ns.store(0, Ordering::Relaxed);
    }
}

/// All groups of this process.
pub struct KernelTable {
    entries: Box<[KernelStats]>,
    /// Mean price of timed groups: the provisional charge of a launch whose
    /// group has never been timed.
    typical_ns: AtomicU64,
}

impl KernelTable {
    pub fn new() -> Self {
        Self {
            entries: (0..TABLE_SIZE).map(|_| KernelStats::new()).collect(),
            typical_ns: AtomicU64::new(0),
        }
    }

    /// The group of `key`, claiming a free slot for a new one; `None` if the
    /// probed slots all belong to other groups.
    #[inline(always)]
    pub fn entry(&self, key: &LaunchKey) -> Option<(usize, &KernelStats)> {
        let hash = key.hash64();
        let start = hash as usize % TABLE_SIZE;
        for probe in 0..PROBES {
            let index = (start + probe) % TABLE_SIZE;
            let entry = &self.entries[index];
            let current = entry.key.load(Ordering::Acquire);
            if current == hash {
                return Some((index, entry));
            }
            if current == 0 {
                match entry
                    .key
                    .compare_exchange(0, hash, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return Some((index, entry)),
                    Err(winner) if winner == hash => return Some((index, entry)),
                    Err(_) => continue,
                }
            }
        }
        None
    }

    pub fn get(&self, index: usize) -> Option<&KernelStats> {
        self.entries.get(index)
    }

    /// Provisional price for launches of untimed groups.
    pub fn typical(&self) -> u64 {
        self.typical_ns.load(Ordering::Relaxed)
    }

    /// Records a sample for entry `index`, good to within `slack_ns`;
    /// returns the correction owed.
    pub fn record(&self, index: usize, measured_ns: u64, slack_ns: u64) -> i64 {
        let Some(entry) = self.entries.get(index) else {
            return 0;
        };
        let correction = entry.record(measured_ns, slack_ns);
        let price = entry.price();
        let _ = self
            .typical_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |typical| {
                Some(if typical == 0 {
                    price
                } else {
                    (typical * 7 + price) / 8
                })
            });
        correction
    }

    pub fn reset_after_fork(&self) {
        for entry in self.entries.iter() {
            entry.reset_after_fork();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(function: usize) -> LaunchKey {
        LaunchKey {
            function,
            grid: [1, 1, 1],
            block: [128, 1, 1],
            shared_bytes: 0,
        }
    }

    #[test]
    fn the_price_is_the_mean_of_the_cluster_at_the_bottom_of_the_window() {
        let table = KernelTable::new();
        let (index, entry) = table.entry(&key(1)).expect("slot");
        assert!(entry.charge(400), "an untimed group is timed at once");
        assert_eq!(
            table.record(index, 1_000, 0),
            600,
            "a provisional 400 settles at 1000"
        );
        assert_eq!(entry.price(), 1_000);
        // A sample lengthened by waiting behind other work does not raise it.
        assert!(!entry.charge(1_000));
        assert_eq!(table.record(index, 5_000, 0), 0);
        assert_eq!(entry.price(), 1_000);
        // One within an eighth of the smallest is the kernel's own spread.
        table.record(index, 1_100, 0);
        assert_eq!(entry.price(), 1_050);
        // Once every recent sample is higher, the kernel really got slower.
        for _ in 0..WINDOW {
            table.record(index, 2_000, 0);
        }
        assert_eq!(entry.price(), 2_000);
    }

    #[test]
    fn a_kernel_that_varies_is_charged_its_mean_not_its_fastest_runs() {
        // Runs of 950 to 1050 ns, evenly: 1000 on average. The smallest of
        // the window (the price this module used to charge) is 950, 5 % less
        // than the device time used.
        let mut window = Window::default();
        let mut price = 0;
        for i in 0..WINDOW as u64 * 4 {
            price = window.push(950 + (i * 37) % 101, 0);
        }
        assert!((995..=1_005).contains(&price), "{price}");
    }

    #[test]
    fn a_short_kernel_is_charged_its_mean_despite_the_hosts_part() {
        // A 20 us kernel varying by 5 % either way, each sample also up to a
        // microsecond out from the host's part taken off it: 18 to 22 us.
        // Within an eighth of the smallest alone, the cluster would hold
        // only its lower half (about 19.2 us); a launch call's worth of
        // slack (4.6 us) takes it all.
        let mut window = Window::default();
        let mut price = 0;
        for i in 0..WINDOW as u64 * 4 {
            // Every 64 in a row take each of 64 evenly spaced values once.
            price = window.push(18_000 + (i * 37 % 64) * 4_000 / 63, 4_600);
        }
        assert!((19_800..=20_200).contains(&price), "{price}");
        assert!(window.price(0) < 19_500, "{}", window.price(0));
    }

    #[test]
    fn a_tight_kernel_leaves_out_even_short_waits() {
        // Runs of 1000 to 1004 ns; four in five timings waited 0 to 100 %
        // longer. Taking every timing within an eighth would also take the
        // waits of up to an eighth, about 2.5 % more.
        let mut window = Window::default();
        let mut price = 0;
        for i in 0..WINDOW as u64 * 4 {
            let sample = if i % 5 == 0 {
                1_000 + i % 5
            } else {
                1_000 + (i * 7_919) % 1_000
            };
            price = window.push(sample, 0);
        }
        assert!((1_000..=1_008).contains(&price), "{price}");
    }

    #[test]
    fn waits_behind_other_work_stay_out_of_the_price_however_many() {
        // Seven in eight timings waited behind another container's kernel
        // (by 20 % to twice the kernel); the others vary by 2 % either way.
        let mut window = Window::default();
        let mut price = 0;
        for i in 0..WINDOW as u64 * 4 {
            let sample = if i % 8 == 0 {
                980 + (i * 13) % 41
            } else {
                1_200 + (i * 97) % 1_000
            };
            price = window.push(sample, 0);
        }
        assert!((990..=1_010).contains(&price), "{price}");
    }

    #[test]
    fn mispredictions_are_settled_for_every_launch_at_the_old_price() {
        let table = KernelTable::new();
        let (index, entry) = table.entry(&key(2)).expect("slot");
        table.record(index, 3_000, 0);
        for _ in 0..10 {
            entry.charge(3_000);
        }
        // The window still holds 3000 (smaller): the price stays, nothing owed.
        assert_eq!(table.record(index, 4_000, 0), 0);
        // A smaller sample lowers the price and refunds the 10 launches.
        for _ in 0..10 {
            entry.charge(3_000);
        }
        assert_eq!(table.record(index, 1_000, 0), -20_000);
    }

    #[test]
    fn sampling_cadence_and_single_flight() {
        let table = KernelTable::new();
        let (index, entry) = table.entry(&key(3)).expect("slot");
        table.record(index, 100, 0);
        let timed = (0..MAX_SAMPLE_EVERY * 4)
            .filter(|_| entry.charge(100))
            .count();
        assert_eq!(timed, 1, "only one sample in flight at a time");
        entry.abandon_sample();
        let timed = (0..MAX_SAMPLE_EVERY * 4).filter(|_| {
            let due = entry.charge(100);
            if due {
                entry.abandon_sample();
            }
            due
        });
        assert_eq!(timed.count(), 4);
    }

    #[test]
    fn expensive_kernels_are_timed_more_often() {
        assert_eq!(sample_every(20_000), 100);
        assert_eq!(sample_every(1_000), MAX_SAMPLE_EVERY);
        assert_eq!(sample_every(1_000_000), 2);
        assert_eq!(sample_every(100_000), 20);
        assert_eq!(sample_every(30_000_000), 1);
    }

    #[test]
    fn distinct_shapes_are_distinct_groups() {
        let table = KernelTable::new();
        let (a, _) = table.entry(&key(4)).expect("slot");
        let mut wider = key(4);
        wider.grid[0] = 1024;
        let (b, _) = table.entry(&wider).expect("slot");
        assert_ne!(a, b);
        assert_eq!(table.entry(&key(4)).map(|(i, _)| i), Some(a));
    }
}
