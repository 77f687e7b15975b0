//! The GPUs' measured load, for the extender's `load-aware` policies: SM
//! utilization read from NVML every few seconds, smoothed, and handed to
//! the inventory publisher only when it moved enough to change a placement
//! (so a busy node does not rewrite its Node object every sample).

use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Smoothed utilization per GPU UUID, in percent.
pub type LoadFigures = BTreeMap<String, u32>;

/// How far (percentage points) a GPU's smoothed figure must move from the
/// published one to be published again.
pub const PUBLISH_STEP: u32 = 5;
/// The least time between two publications of changed figures.
pub const PUBLISH_INTERVAL: Duration = Duration::from_secs(10);
/// Weight of the newest sample in the smoothed figure.
const SMOOTHING: f64 = 0.5;

/// Where the figures come from.
pub trait LoadSource: Send {
    /// Each GPU's utilization now, in percent, by UUID; `None` for a GPU
    /// that could not be read this time.
    fn sample(&mut self) -> Vec<(String, Option<u32>)>;
}

/// NVML's utilization rate (the share of the last sample period in which a
/// kernel ran) of each of the plugin's GPUs.
pub struct NvmlLoad {
    nvml: Arc<Nvml>,
    uuids: Vec<String>,
}

impl NvmlLoad {
    pub fn new(nvml: Arc<Nvml>, uuids: Vec<String>) -> Self {
        Self { nvml, uuids }
    }
}

impl LoadSource for NvmlLoad {
    fn sample(&mut self) -> Vec<(String, Option<u32>)> {
        self.uuids
            .iter()
            .map(|uuid| {
                let percent = self
                    .nvml
                    .device_by_uuid(uuid.as_str())
                    .and_then(|device| device.utilization_rates())
                    .ok()
                    .map(|rates| rates.gpu.min(100));
                (uuid.clone(), percent)
            })
            .collect()
    }
}

/// Exponentially smoothed figures and what was last published.
#[derive(Debug, Default)]
pub struct Smoother {
    smoothed: BTreeMap<String, f64>,
    published: LoadFigures,
    published_at: Option<Instant>,
}

impl Smoother {
    /// Takes one sample; answers the figures to publish when they moved by
    /// [`PUBLISH_STEP`] or more (or a GPU was measured for the first time)
    /// and [`PUBLISH_INTERVAL`] has passed since the last publication.
    pub fn take(&mut self, sample: &[(String, Option<u32>)], now: Instant) -> Option<LoadFigures> {
        for (uuid, percent) in sample {
            let Some(percent) = percent else { continue };
            let value = f64::from(*percent);
            self.smoothed
                .entry(uuid.clone())
                .and_modify(|old| *old += SMOOTHING * (value - *old))
                .or_insert(value);
        }
        let current: LoadFigures = self
            .smoothed
            .iter()
            .map(|(uuid, value)| (uuid.clone(), value.round().clamp(0.0, 100.0) as u32))
            .collect();
        let moved = current.iter().any(|(uuid, value)| {
            self.published
                .get(uuid)
                .is_none_or(|old| old.abs_diff(*value) >= PUBLISH_STEP)
        });
        let due = self
            .published_at
            .is_none_or(|at| now.duration_since(at) >= PUBLISH_INTERVAL);
        if !(moved && due) {
            return None;
        }
        self.published = current.clone();
        self.published_at = Some(now);
        Some(current)
    }
}

/// Samples `source` every `every` on a thread of its own (NVML calls
/// block) until every receiver is dropped; the receiver gets the figures
/// to publish.
pub fn spawn(
    mut source: Box<dyn LoadSource>,
    every: Duration,
) -> std::io::Result<watch::Receiver<LoadFigures>> {
    let (sender, receiver) = watch::channel(LoadFigures::new());
    std::thread::Builder::new()
        .name("vgpu-gpu-load".into())
        .spawn(move || {
            let mut smoother = Smoother::default();
            while !sender.is_closed() {
                if let Some(figures) = smoother.take(&source.sample(), Instant::now()) {
                    tracing::debug!(?figures, "GPU load moved");
                    sender.send_replace(figures);
                }
                std::thread::sleep(every);
            }
        })?;
    Ok(receiver)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(values: &[(&str, Option<u32>)]) -> Vec<(String, Option<u32>)> {
        values.iter().map(|(u, v)| (u.to_string(), *v)).collect()
    }

    #[test]
    fn figures_are_smoothed_and_published_only_when_they_move() {
        let mut smoother = Smoother::default();
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        // First measurement: published as it is.
        let first = smoother.take(&sample(&[("a", Some(80)), ("b", Some(0))]), at(0));
        assert_eq!(
            first,
            Some(LoadFigures::from([("a".into(), 80), ("b".into(), 0)]))
        );
        // Moved, but too soon after the last publication.
        assert_eq!(smoother.take(&sample(&[("a", Some(0))]), at(5)), None);
        // a: 80 -> 40 -> 20 over the two samples; published now.
        let later = smoother.take(&sample(&[("a", Some(0)), ("b", Some(2))]), at(10));
        assert_eq!(
            later,
            Some(LoadFigures::from([("a".into(), 20), ("b".into(), 1)]))
        );
        // Small moves are not worth a write.
        assert_eq!(
            smoother.take(&sample(&[("a", Some(24)), ("b", Some(4))]), at(30)),
            None
        );
        // A GPU that could not be read keeps its figure.
        assert_eq!(smoother.take(&sample(&[("a", None)]), at(40)), None);
        // A GPU measured for the first time is published.
        let third = smoother
            .take(&sample(&[("c", Some(50))]), at(50))
            .expect("new GPU");
        assert_eq!(third.get("c"), Some(&50));
    }
}
