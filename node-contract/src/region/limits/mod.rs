//! A container's limits: their value ([`RegionLimits`]), the one
//! conversion from what a node grants to that value ([`granted`]), how memory
//! grants are scaled ([`scaling`]), and how limits are kept in a region or
//! in the node's grant file ([`Limits`]).

pub mod granted;
pub mod scaling;

use super::layout::{Limits, MAX_DEVICES, SHARE_FULL, SHARE_UNLIMITED};
use std::sync::atomic::Ordering;
use thiserror::Error;

/// Priority of a container that asked for none (HAMi-core's default).
pub const DEFAULT_PRIORITY: i32 = 1;

/// How the compute share is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u32)]
pub enum UtilizationPolicy {
    /// The share the node monitor grants (the configured share without one).
    #[default]
    Default = 0,
    /// The configured share is a hard cap.
    Force = 1,
    /// No compute cap.
    Disable = 2,
}

impl UtilizationPolicy {
    /// Decodes the value stored in a region.
    pub fn from_u32(value: u32) -> Option<Self> {
        match value {
            0 => Some(Self::Default),
            1 => Some(Self::Force),
            2 => Some(Self::Disable),
            _ => None,
        }
    }

    /// The value of `GPU_CORE_UTILIZATION_POLICY` that selects this policy.
    pub fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Force => "force",
            Self::Disable => "disable",
        }
    }

    /// Reads a policy name (any case; empty means the default).
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        if text.is_empty() {
            return Some(Self::Default);
        }
        [Self::Default, Self::Force, Self::Disable]
            .into_iter()
            .find(|policy| text.eq_ignore_ascii_case(policy.name()))
    }
}

/// A container's limits as values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionLimits {
    /// Memory cap in bytes ([`UNCAPPED`] = none).
    pub memory_limit: [u64; MAX_DEVICES],
    /// Host-memory swap allowance in bytes (0 = none).
    pub swap_limit: [u64; MAX_DEVICES],
    /// Compute share in percent, 1-99 ([`super::UNCAPPED_SHARE`] = none).
    pub sm_limit: [u32; MAX_DEVICES],
    /// Burst share in percent (0 = same as `sm_limit`).
    pub sm_burst: [u32; MAX_DEVICES],
    pub policy: u32,
    pub priority: i32,
}

impl RegionLimits {
    /// These limits as a region stores them: a burst share is never below
    /// the share.
    pub fn as_stored(&self) -> RegionLimits {
        let mut stored = *self;
        for (burst, share) in stored.sm_burst.iter_mut().zip(self.sm_limit) {
            *burst = (*burst).max(share);
        }
        stored
    }

    /// The effective share (basis points) a device starts with.
    pub fn initial_effective(&self, device: usize) -> u32 {
        match self.sm_limit[device] {
            0 => SHARE_UNLIMITED,
            share => share * (SHARE_FULL / 100),
        }
    }

    /// The compute policy, [`UtilizationPolicy::Default`] for a value no
    /// build knows.
    pub fn utilization_policy(&self) -> UtilizationPolicy {
        UtilizationPolicy::from_u32(self.policy).unwrap_or_default()
    }
}

/// New limits that would put a memory cap below what is already in use.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("device {device}: a cap of {limit} bytes is below the {used} bytes in use")]
pub struct BelowUse {
    pub device: usize,
    pub limit: u64,
    pub used: u64,
}

impl Limits {
    /// The limits held here.
    pub fn load(&self) -> RegionLimits {
        let mut limits = RegionLimits {
            policy: self.policy.load(Ordering::Relaxed),
            priority: self.priority.load(Ordering::Relaxed),
            ..RegionLimits::default()
        };
        for (index, device) in self.devices.iter().enumerate() {
            limits.memory_limit[index] = device.memory_limit.load(Ordering::Relaxed);
            limits.swap_limit[index] = device.swap_limit.load(Ordering::Relaxed);
            limits.sm_limit[index] = device.sm_limit.load(Ordering::Relaxed);
            limits.sm_burst[index] = device.sm_burst.load(Ordering::Relaxed);
        }
        limits
    }

    /// Writes `limits` (as stored); the effective shares are left to their
    /// owner (the node monitor).
    pub(crate) fn store(&self, limits: &RegionLimits) {
        let stored = limits.as_stored();
        self.policy.store(stored.policy, Ordering::Relaxed);
        self.priority.store(stored.priority, Ordering::Relaxed);
        for (index, device) in self.devices.iter().enumerate() {
            device
                .memory_limit
                .store(stored.memory_limit[index], Ordering::Relaxed);
            device
                .swap_limit
                .store(stored.swap_limit[index], Ordering::Relaxed);
            device
                .sm_limit
                .store(stored.sm_limit[index], Ordering::Relaxed);
            device
                .sm_burst
                .store(stored.sm_burst[index], Ordering::Relaxed);
        }
    }

    /// Starts every device's effective share at its configured share.
    pub(crate) fn start_effective(&self, limits: &RegionLimits) {
        for (index, device) in self.devices.iter().enumerate() {
            device
                .sm_effective
                .store(limits.initial_effective(index), Ordering::Relaxed);
        }
    }

    /// Puts back `granted` where the limits held here differ from it. An
    /// effective share above what the granted burst allows is brought back
    /// to the granted share. Returns whether anything had been changed.
    pub(crate) fn restore(&self, granted: &RegionLimits) -> bool {
        let stored = granted.as_stored();
        let mut changed = self.load() != stored;
        if changed {
            self.store(granted);
        }
        for (index, device) in self.devices.iter().enumerate() {
            let ceiling = match stored.sm_burst[index] {
                0 => SHARE_UNLIMITED,
                burst => burst * (SHARE_FULL / 100),
            };
            if device.sm_effective.load(Ordering::Relaxed) > ceiling {
                device
                    .sm_effective
                    .store(granted.initial_effective(index), Ordering::Relaxed);
                changed = true;
            }
        }
        changed
    }
}
