//! GPU health: where faults come from, and when a GPU counts as recovered.
//!
//! A [`HealthSource`] runs on its own thread and reports [`HealthEvent`]s.
//! Two sources exist: [`NvmlHealth`] (NVML XID and ECC events plus a
//! periodic probe of every GPU) and [`ManualHealth`] (signals injected by
//! a caller: tests, and drivers without NVML events). Both feed their raw
//! [`Signal`]s through the same [`HealthTracker`], which holds the policy:
//!
//! - a critical XID (one not in the ignored list: by default 13, 31, 43,
//!   45, 68 and 109, which are errors of the application, not of the GPU), a
//!   double-bit ECC error, or a failed probe makes a GPU unhealthy;
//! - an unhealthy GPU is healthy again once it has answered every probe for
//!   the whole recovery window with no new fault (no window: never; the
//!   agent's restart then clears it, as with NVIDIA's own plugin).

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// XIDs that report an application's error rather than the GPU's.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// A change of one GPU's health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthEvent {
    Unhealthy { uuid: String, reason: String },
    Healthy { uuid: String },
}

/// Why a GPU failed its probe, in NVML's words. NVML's error is kept as
/// its text: a probe's result travels in a [`Signal`], which is cloned and
/// compared, and NVML's error is neither.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProbeError {
    /// NVML does not find the GPU by its UUID.
    #[error("{nvml}")]
    Lookup { nvml: String },
    /// NVML finds the GPU but cannot read its memory figures.
    #[error("{nvml}")]
    MemoryInfo { nvml: String },
    /// A failure reported by a caller (tests, a source without NVML).
    #[error("{0}")]
    Reported(String),
}

/// Something observed about a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signal {
    /// An XID error (`None`: the driver could not say which).
    Xid { uuid: String, xid: Option<u64> },
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc { uuid: String },
    /// The result of asking the GPU a few questions.
    Probe {
        uuid: String,
        result: Result<(), ProbeError>,
    },
}

/// A producer of health events; runs on its own thread.
pub trait HealthSource: Send + 'static {
    /// Reports every change through `report` until `stop` is set. Must
    /// notice `stop` within about a second.
    fn run(self: Box<Self>, report: &mut dyn FnMut(HealthEvent), stop: &AtomicBool);
}

#[derive(Clone, Debug)]
struct Fault {
    last: Instant,
}

/// Turns signals into health changes (see the module documentation).
#[derive(Debug)]
pub struct HealthTracker {
    ignored_xids: HashSet<u64>,
    recover_after: Option<Duration>,
    faults: HashMap<String, Fault>,
}

impl HealthTracker {
    pub fn new(
        ignored_xids: impl IntoIterator<Item = u64>,
        recover_after: Option<Duration>,
    ) -> Self {
        Self {
            ignored_xids: ignored_xids.into_iter().collect(),
            recover_after,
            faults: HashMap::new(),
        }
    }

    /// Whether `uuid` is currently considered faulty.
    pub fn is_faulty(&self, uuid: &str) -> bool {
        self.faults.contains_key(uuid)
    }

    /// Applies one signal observed at `now`; returns the change it causes.
    pub fn apply(&mut self, signal: Signal, now: Instant) -> Option<HealthEvent> {
        match signal {
            Signal::Xid { uuid, xid } => {
                if xid.is_some_and(|x| self.ignored_xids.contains(&x)) {
                    tracing::info!(
                        "GPU {uuid}: XID {} (an application error; the GPU stays healthy)",
                        xid.unwrap_or_default()
                    );
                    return None;
                }
                let reason = match xid {
                    Some(xid) => format!("XID {xid}"),
                    None => "an XID error the driver could not identify".to_string(),
                };
                self.fault(uuid, reason, now)
            }
            Signal::DoubleBitEcc { uuid } => {
                self.fault(uuid, "a double-bit ECC error".to_string(), now)
            }
            Signal::Probe {
                uuid,
                result: Err(what),
            } => self.fault(uuid, format!("it does not answer NVML: {what}"), now),
            Signal::Probe {
                uuid,
                result: Ok(()),
            } => {
                let window = self.recover_after?;
                let fault = self.faults.get(&uuid)?;
                if now.saturating_duration_since(fault.last) < window {
                    return None;
                }
                self.faults.remove(&uuid);
                Some(HealthEvent::Healthy { uuid })
            }
        }
    }

    fn fault(&mut self, uuid: String, reason: String, now: Instant) -> Option<HealthEvent> {
        let was_faulty = self
            .faults
            .insert(uuid.clone(), Fault { last: now })
            .is_some();
        if was_faulty {
            tracing::warn!("GPU {uuid} (already unhealthy): {reason}");
            None
        } else {
            Some(HealthEvent::Unhealthy { uuid, reason })
        }
    }
}

/// Signals injected by a caller through a [`ManualHealthHandle`].
pub struct ManualHealth {
    tracker: HealthTracker,
    signals: mpsc::Receiver<Signal>,
    handled: Arc<AtomicU64>,
}

/// Sends signals to a [`ManualHealth`].
#[derive(Clone)]
pub struct ManualHealthHandle {
    signals: mpsc::Sender<Signal>,
    handled: Arc<AtomicU64>,
}

impl ManualHealth {
    pub fn new(tracker: HealthTracker) -> (Self, ManualHealthHandle) {
        let (tx, rx) = mpsc::channel();
        let handled = Arc::new(AtomicU64::new(0));
        (
            Self {
                tracker,
                signals: rx,
                handled: Arc::clone(&handled),
            },
            ManualHealthHandle {
                signals: tx,
                handled,
            },
        )
    }
}

impl ManualHealthHandle {
    /// Delivers `signal`; false once the source has stopped.
    pub fn send(&self, signal: Signal) -> bool {
        self.signals.send(signal).is_ok()
    }

    /// How many signals have been applied, and their health changes
    /// reported, so far.
    pub fn handled(&self) -> u64 {
        self.handled.load(Ordering::Acquire)
    }

    /// Reports XID `xid` on `uuid`, as NVML would.
    pub fn inject_xid(&self, uuid: &str, xid: u64) -> bool {
        self.send(Signal::Xid {
            uuid: uuid.to_string(),
            xid: Some(xid),
        })
    }
}

impl HealthSource for ManualHealth {
    fn run(mut self: Box<Self>, report: &mut dyn FnMut(HealthEvent), stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            match self.signals.recv_timeout(Duration::from_millis(100)) {
                Ok(signal) => {
                    if let Some(event) = self.tracker.apply(signal, Instant::now()) {
                        report(event);
                    }
                    self.handled.fetch_add(1, Ordering::Release);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

/// NVML events and probes.
pub struct NvmlHealth {
    nvml: Arc<Nvml>,
    uuids: Vec<String>,
    tracker: HealthTracker,
    probe_interval: Duration,
}

impl NvmlHealth {
    /// Watches the GPUs `uuids`, probing each every `probe_interval`.
    pub fn new(
        nvml: Arc<Nvml>,
        uuids: Vec<String>,
        tracker: HealthTracker,
        probe_interval: Duration,
    ) -> Self {
        Self {
            nvml,
            uuids,
            tracker,
            probe_interval: probe_interval.max(Duration::from_millis(10)),
        }
    }
}

/// Asks the GPU `uuid` a few questions a healthy GPU answers (also what
/// `vgpu doctor` asks, so it judges health by the agents' own probe).
pub fn probe(nvml: &Nvml, uuid: &str) -> Result<(), ProbeError> {
    let device = nvml
        .device_by_uuid(uuid)
        .map_err(|error| ProbeError::Lookup {
            nvml: error.to_string(),
        })?;
    device
        .memory_info()
        .map_err(|error| ProbeError::MemoryInfo {
            nvml: error.to_string(),
        })?;
    Ok(())
}

impl HealthSource for NvmlHealth {
    fn run(mut self: Box<Self>, report: &mut dyn FnMut(HealthEvent), stop: &AtomicBool) {
        let nvml = Arc::clone(&self.nvml);
        let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
        let mut set = match nvml.create_event_set() {
            Ok(set) => Some(set),
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "NVML event set; GPU health comes from probes only"
                );
                None
            }
        };
        for uuid in &self.uuids {
            let Some(current) = set.take() else { break };
            let device = match nvml.device_by_uuid(uuid.as_str()) {
                Ok(device) => device,
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "GPU {uuid}; no NVML events for it"
                    );
                    set = Some(current);
                    continue;
                }
            };
            let supported = match device.supported_event_types() {
                Ok(types) => types & wanted,
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "GPU {uuid}: supported NVML events"
                    );
                    EventTypes::empty()
                }
            };
            if supported.is_empty() {
                tracing::warn!("GPU {uuid} reports no XID or ECC events; probes only");
                set = Some(current);
                continue;
            }
            match device.register_events(supported, current) {
                Ok(registered) => {
                    tracing::info!("GPU {uuid}: watching NVML events {supported:?}");
                    set = Some(registered);
                }
                Err(error) => {
                    // The set is freed by a failed registration.
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "GPU {uuid}: NVML event registration; probes only"
                    );
                    set = nvml.create_event_set().ok();
                }
            }
        }

        let mut next_probe = Instant::now();
        let mut wait_failures = 0u32;
        while !stop.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= next_probe {
                for uuid in &self.uuids {
                    let result = probe(&nvml, uuid);
                    let signal = Signal::Probe {
                        uuid: uuid.clone(),
                        result,
                    };
                    if let Some(event) = self.tracker.apply(signal, Instant::now()) {
                        report(event);
                    }
                }
                next_probe = now + self.probe_interval;
            }
            let wait = next_probe
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(500));
            let Some(events) = &set else {
                std::thread::sleep(wait);
                continue;
            };
            let millis = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX).max(1);
            match events.wait(millis) {
                Ok(data) => {
                    wait_failures = 0;
                    let uuid = match data.device.uuid() {
                        Ok(uuid) => uuid,
                        Err(error) => {
                            tracing::warn!(
                                error = &error as &dyn std::error::Error,
                                "NVML event from a device without a UUID"
                            );
                            continue;
                        }
                    };
                    let signal = if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                        Signal::DoubleBitEcc { uuid }
                    } else {
                        let xid = match data.event_data {
                            Some(nvml_wrapper::enums::event::XidError::Value(xid)) => Some(xid),
                            _ => None,
                        };
                        Signal::Xid { uuid, xid }
                    };
                    if let Some(event) = self.tracker.apply(signal, Instant::now()) {
                        report(event);
                    }
                }
                Err(NvmlError::Timeout) => wait_failures = 0,
                Err(error) => {
                    wait_failures += 1;
                    if wait_failures == 1 {
                        tracing::warn!(error = &error as &dyn std::error::Error, "NVML event wait");
                    }
                    std::thread::sleep(wait);
                }
            }
        }
    }
}

/// Runs `source` on a thread of its own, calling `report` for each event.
/// Setting the returned flag stops it.
pub fn spawn(
    source: Box<dyn HealthSource>,
    mut report: impl FnMut(HealthEvent) + Send + 'static,
) -> std::io::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    std::thread::Builder::new()
        .name("gpu-health".into())
        .spawn(move || source.run(&mut report, &flag))?;
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(uuid: &str, xid: u64) -> Signal {
        Signal::Xid {
            uuid: uuid.into(),
            xid: Some(xid),
        }
    }

    fn probe_ok(uuid: &str) -> Signal {
        Signal::Probe {
            uuid: uuid.into(),
            result: Ok(()),
        }
    }

    #[test]
    fn critical_xids_fault_and_application_xids_do_not() {
        let mut tracker = HealthTracker::new(DEFAULT_IGNORED_XIDS, None);
        let t = Instant::now();
        assert_eq!(tracker.apply(xid("a", 13), t), None);
        assert_eq!(tracker.apply(xid("a", 31), t), None);
        assert_eq!(
            tracker.apply(xid("a", 79), t),
            Some(HealthEvent::Unhealthy {
                uuid: "a".into(),
                reason: "XID 79".into()
            })
        );
        assert_eq!(tracker.apply(xid("a", 48), t), None, "already unhealthy");
        assert_eq!(
            tracker.apply(
                Signal::Xid {
                    uuid: "b".into(),
                    xid: None
                },
                t
            ),
            Some(HealthEvent::Unhealthy {
                uuid: "b".into(),
                reason: "an XID error the driver could not identify".into()
            })
        );
        assert!(matches!(
            tracker.apply(Signal::DoubleBitEcc { uuid: "c".into() }, t),
            Some(HealthEvent::Unhealthy { .. })
        ));
        assert!(matches!(
            tracker.apply(
                Signal::Probe {
                    uuid: "d".into(),
                    result: Err(ProbeError::Reported("GPU is lost".into()))
                },
                t
            ),
            Some(HealthEvent::Unhealthy { reason, .. }) if reason.contains("GPU is lost")
        ));
        // No recovery window: faults stay.
        assert_eq!(
            tracker.apply(probe_ok("a"), t + Duration::from_secs(3600)),
            None
        );
        assert!(tracker.is_faulty("a"));
    }

    #[test]
    fn recovery_needs_a_quiet_window_of_good_probes() {
        let window = Duration::from_secs(60);
        let mut tracker = HealthTracker::new([], Some(window));
        let t = Instant::now();
        assert_eq!(tracker.apply(probe_ok("a"), t), None, "healthy stays quiet");
        assert!(tracker.apply(xid("a", 79), t).is_some());
        assert_eq!(tracker.apply(probe_ok("a"), t + window / 2), None);
        // A new fault restarts the window.
        assert_eq!(tracker.apply(xid("a", 79), t + window / 2), None);
        assert_eq!(tracker.apply(probe_ok("a"), t + window), None);
        assert_eq!(
            tracker.apply(probe_ok("a"), t + window + window / 2),
            Some(HealthEvent::Healthy { uuid: "a".into() })
        );
        assert!(!tracker.is_faulty("a"));
    }

    #[test]
    fn manual_source_reports_through_the_tracker_and_stops() {
        let (source, handle) = ManualHealth::new(HealthTracker::new([13], Some(Duration::ZERO)));
        let (tx, rx) = mpsc::channel();
        let stop = spawn(Box::new(source), move |event| {
            let _ = tx.send(event);
        })
        .expect("spawn");
        assert!(handle.inject_xid("a", 13));
        assert!(handle.inject_xid("a", 48));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).expect("event"),
            HealthEvent::Unhealthy {
                uuid: "a".into(),
                reason: "XID 48".into()
            }
        );
        assert!(handle.send(probe_ok("a")));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).expect("event"),
            HealthEvent::Healthy { uuid: "a".into() }
        );
        stop.store(true, Ordering::Release);
    }
}
