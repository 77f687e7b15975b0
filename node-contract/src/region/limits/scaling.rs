//! Device memory scaling (HAMi's `deviceMemoryScaling`): a node offers its
//! GPUs' memory times a factor, and a factor above 1 oversubscribes it.
//!
//! The one home of the rule, used by the device plugin (what it publishes
//! and what it grants), the node monitor (what it restores) and, through
//! the published inventory, the scheduler extender:
//!
//! - A GPU of `M` bytes offers `floor(M × s)` bytes
//!   ([`MemoryScaling::offered`]); the extender counts grants (memory in
//!   MiB, and memory percentages, which are of the offered memory) against
//!   that.
//! - A container's grant `G` on such a GPU is split
//!   ([`MemoryScaling::split`]): `floor(G / s)` bytes of device memory (its
//!   cap), and the rest, `G − floor(G / s)`, of host memory as swap. Device
//!   caps are rounded down, so the caps of the containers on a GPU never add
//!   up to more than its memory.
//! - A factor of 1 or less changes no cap and adds no swap (below 1 the
//!   node keeps part of each GPU's memory back: it offers less).

use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// How many times its physical memory a GPU offers; finite and above 0.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct MemoryScaling(f64);

// Never NaN (checked at construction), so equality is an equivalence.
impl Eq for MemoryScaling {}

impl Default for MemoryScaling {
    fn default() -> Self {
        Self::ONE
    }
}

/// A scaling factor that cannot be used.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ScalingError {
    #[error("device memory scaling {0:?} is not a number (e.g. 1, 1.5 or 2)")]
    NotANumber(String),
    #[error("device memory scaling {0} must be a finite number above 0 (1: no scaling, 2: offer twice the memory)")]
    OutOfRange(f64),
}

/// One container's grant on one GPU, as device memory and host swap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemorySplit {
    /// Device memory cap in bytes.
    pub device: u64,
    /// Host memory the container may use as swap for the rest, in bytes.
    pub swap: u64,
}

impl MemoryScaling {
    /// No scaling: a GPU offers its memory.
    pub const ONE: Self = Self(1.0);

    pub fn new(factor: f64) -> Result<Self, ScalingError> {
        if factor.is_finite() && factor > 0.0 {
            Ok(Self(factor))
        } else {
            Err(ScalingError::OutOfRange(factor))
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// Whether grants are partly served from host memory.
    pub fn oversubscribes(self) -> bool {
        self.0 > 1.0
    }

    /// The memory a GPU of `physical` bytes offers.
    pub fn offered(self, physical: u64) -> u64 {
        if self == Self::ONE {
            return physical;
        }
        // `as` saturates; below 2^53 bytes (8 PiB) the product is exact
        // enough that flooring it is the rule's floor.
        (physical as f64 * self.0).floor() as u64
    }

    /// How a grant of `grant` bytes is held. A grant of 0 (uncapped) stays
    /// uncapped with no swap.
    pub fn split(self, grant: u64) -> MemorySplit {
        if !self.oversubscribes() || grant == 0 {
            return MemorySplit {
                device: grant,
                swap: 0,
            };
        }
        // At least one byte: the shim reads a cap of 0 as "uncapped".
        let device = ((grant as f64 / self.0).floor() as u64).clamp(1, grant);
        MemorySplit {
            device,
            swap: grant - device,
        }
    }
}

impl FromStr for MemoryScaling {
    type Err = ScalingError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        let factor: f64 = trimmed
            .parse()
            .map_err(|_| ScalingError::NotANumber(trimmed.to_string()))?;
        Self::new(factor)
    }
}

impl fmt::Display for MemoryScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn scaling(text: &str) -> MemoryScaling {
        text.parse().expect(text)
    }

    #[test]
    fn factors_parse_and_bad_ones_are_refused_saying_why() {
        assert_eq!(scaling("2").get(), 2.0);
        assert_eq!(scaling(" 1.5 ").get(), 1.5);
        assert_eq!(scaling("0.9").get(), 0.9);
        assert_eq!(MemoryScaling::default(), MemoryScaling::ONE);
        for bad in ["0", "-1", "-0.5", "NaN", "nan", "inf", "-inf", "1e400"] {
            let error = bad.parse::<MemoryScaling>().expect_err(bad);
            assert!(
                matches!(error, ScalingError::OutOfRange(_)),
                "{bad}: {error}"
            );
            assert!(error.to_string().contains("above 0"), "{error}");
        }
        for bad in ["", "two", "2x", "1,5", "150%"] {
            let error = bad.parse::<MemoryScaling>().expect_err(bad);
            assert!(
                matches!(error, ScalingError::NotANumber(_)),
                "{bad}: {error}"
            );
            assert!(error.to_string().contains("not a number"), "{error}");
        }
        assert!(MemoryScaling::new(f64::NAN).is_err());
    }

    #[test]
    fn a_gpu_offers_its_memory_times_the_factor() {
        assert_eq!(MemoryScaling::ONE.offered(24 * GIB), 24 * GIB);
        assert_eq!(scaling("2").offered(24 * GIB), 48 * GIB);
        assert_eq!(scaling("1.5").offered(16 * GIB), 24 * GIB);
        assert_eq!(scaling("0.5").offered(16 * GIB), 8 * GIB);
        // Rounded down to whole bytes.
        assert_eq!(scaling("1.5").offered(3), 4);
    }

    #[test]
    fn at_two_a_24_gib_grant_is_12_on_the_device_and_12_in_swap() {
        assert_eq!(
            scaling("2").split(24 * GIB),
            MemorySplit {
                device: 12 * GIB,
                swap: 12 * GIB
            }
        );
        // Two such grants fill a 24 GiB card exactly, and fit its offer.
        let offered = scaling("2").offered(24 * GIB);
        assert!(2 * 24 * GIB <= offered);
        assert_eq!(2 * scaling("2").split(24 * GIB).device, 24 * GIB);
    }

    #[test]
    fn splits_add_up_to_the_grant_and_device_parts_round_down() {
        for factor in ["1.1", "1.5", "2", "3", "7.25", "1000"] {
            let s = scaling(factor);
            for grant in [1, 3, 1 << 20, 1000 << 20, (24 * GIB) + 1, 80 * GIB] {
                let split = s.split(grant);
                assert_eq!(split.device + split.swap, grant, "{factor} {grant}");
                assert!(split.device >= 1, "never uncapped: {factor} {grant}");
                assert!(
                    split.device as f64 <= grant as f64 / s.get() + 1.0,
                    "{factor} {grant}: {split:?}"
                );
            }
        }
        assert_eq!(scaling("3").split(10).device, 3);
    }

    #[test]
    fn no_oversubscription_leaves_grants_alone() {
        for factor in ["1", "0.5"] {
            assert_eq!(
                scaling(factor).split(8 * GIB),
                MemorySplit {
                    device: 8 * GIB,
                    swap: 0
                }
            );
        }
        assert_eq!(scaling("2").split(0), MemorySplit::default());
        assert!(!scaling("1").oversubscribes());
        assert!(scaling("1.01").oversubscribes());
    }
}
