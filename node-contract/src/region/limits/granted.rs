//! The one conversion from what a container is granted (per GPU: memory,
//! a compute share, a burst) to the limits its region and grant hold, and
//! the rules every writer of limits shares: how a share is stored, how a
//! burst follows it, and the order a container numbers its GPUs in.

use super::scaling::{MemoryScaling, MemorySplit};
use super::{RegionLimits, UtilizationPolicy, DEFAULT_PRIORITY};
use crate::region::layout::{MAX_DEVICES, UNCAPPED_SHARE};
use thiserror::Error;

/// The stored form of a compute share of `percent`: a whole device (or
/// more) is no cap at all, and so is 0.
pub fn share_cap(percent: u32) -> u32 {
    if percent >= 100 {
        UNCAPPED_SHARE
    } else {
        percent
    }
}

/// Sorts `items` into the order a container numbers its GPUs: the node's
/// NVML index, which is PCI order, the order CUDA numbers the visible GPUs
/// in when `CUDA_DEVICE_ORDER=PCI_BUS_ID` (what vgpu sets). Items whose
/// index is unknown go last, in the order given.
pub fn device_order<T>(items: &mut [T], nvml_index: impl FnMut(&T) -> Option<u32>) {
    let mut nvml_index = nvml_index;
    items.sort_by_key(|item| nvml_index(item).map_or((1, 0), |index| (0, index)));
}

/// One GPU's grant, in the units pods ask in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceShare {
    /// Memory in bytes (0: uncapped).
    pub memory_bytes: u64,
    /// Compute share in percent (100 or more: the whole GPU, uncapped).
    pub cores_percent: u32,
    /// How far above its share the container may run while the GPU is
    /// idle, in percent; `None`: never above its share.
    pub burst_percent: Option<u32>,
}

/// What a node adds to every container's limits (the device plugin's and
/// the monitor's settings, from the same chart values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeLimits {
    pub policy: UtilizationPolicy,
    /// Host memory each device may borrow as swap beyond its grant (none
    /// when absent).
    pub swap_limit: Option<u64>,
    /// How grants are split into device memory and swap.
    pub memory_scaling: MemoryScaling,
}

impl NodeLimits {
    /// What a grant of `grant` bytes comes to on this node: the device
    /// memory cap, and the swap allowance, which is the grant's part in
    /// host memory ([`MemoryScaling::split`]) plus the node-wide
    /// `swap_limit`. The two add up because they are different things: the
    /// scaled part is memory the extender granted (counted against the
    /// GPU's offer), the node-wide swap lets every container go beyond its
    /// grant; so a container can always use its grant plus `swap_limit`,
    /// scaled or not.
    pub fn memory(&self, grant: u64) -> MemorySplit {
        let split = self.memory_scaling.split(grant);
        MemorySplit {
            device: split.device,
            swap: split.swap.saturating_add(self.swap_limit.unwrap_or(0)),
        }
    }

    /// Whether containers get `CUDA_OVERSUBSCRIBE` (some swap to use).
    pub fn oversubscribes(&self) -> bool {
        self.swap_limit.is_some_and(|bytes| bytes > 0) || self.memory_scaling.oversubscribes()
    }
}

/// The limits a container's grants come to, its devices in the order given
/// (the order CUDA numbers them in the container, [`device_order`]): what
/// the device plugin and the DRA driver create a region and grant with, and
/// what the monitor restores.
pub fn region_limits(
    shares: impl IntoIterator<Item = DeviceShare>,
    priority: Option<i32>,
    node: &NodeLimits,
) -> RegionLimits {
    let mut limits = RegionLimits {
        policy: node.policy as u32,
        priority: priority.unwrap_or(DEFAULT_PRIORITY),
        ..RegionLimits::default()
    };
    for (device, share) in shares.into_iter().take(MAX_DEVICES).enumerate() {
        let memory = node.memory(share.memory_bytes);
        limits.memory_limit[device] = memory.device;
        limits.swap_limit[device] = memory.swap;
        limits.sm_limit[device] = share_cap(share.cores_percent);
        limits.sm_burst[device] = share.burst_percent.unwrap_or(0);
    }
    limits
}

/// A burst asked for below the share it would lift.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
#[error("a burst of {burst} % is below the share of {cores} %")]
pub struct BurstBelowShare {
    pub burst: u32,
    pub cores: u32,
}

impl RegionLimits {
    /// Changes `device`'s share and burst, each where given: a share is
    /// stored as [`share_cap`] stores it, a burst that was not lending (at
    /// or below the old share) follows a new share, and a burst below the
    /// share is refused, changing nothing.
    pub fn set_share(
        &mut self,
        device: usize,
        cores: Option<u32>,
        burst: Option<u32>,
    ) -> Result<(), BurstBelowShare> {
        let share = cores.map_or(self.sm_limit[device], share_cap);
        if let Some(burst) = burst {
            if share != UNCAPPED_SHARE && burst < share {
                return Err(BurstBelowShare {
                    burst,
                    cores: share,
                });
            }
        }
        if cores.is_some() {
            self.sm_limit[device] = share;
            if burst.is_none() && self.sm_burst[device] < share {
                self.sm_burst[device] = share;
            }
        }
        if let Some(burst) = burst {
            self.sm_burst[device] = burst;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn share(memory_bytes: u64, cores_percent: u32, burst_percent: Option<u32>) -> DeviceShare {
        DeviceShare {
            memory_bytes,
            cores_percent,
            burst_percent,
        }
    }

    #[test]
    fn region_limits_follow_the_grants_in_the_order_given() {
        let node = NodeLimits {
            policy: UtilizationPolicy::Force,
            swap_limit: Some(GIB),
            memory_scaling: MemoryScaling::ONE,
        };
        let limits = region_limits(
            [share(8 * GIB, 100, None), share(4 * GIB, 30, Some(60))],
            None,
            &node,
        );
        assert_eq!(limits.memory_limit[..3], [8 * GIB, 4 * GIB, 0]);
        // A whole GPU is uncapped compute.
        assert_eq!(limits.sm_limit[..2], [UNCAPPED_SHARE, 30]);
        assert_eq!(limits.sm_burst[..2], [0, 60]);
        assert_eq!(limits.swap_limit[..3], [GIB, GIB, 0]);
        assert_eq!(limits.policy, UtilizationPolicy::Force as u32);
        assert_eq!(limits.priority, DEFAULT_PRIORITY);
        let one = [share(GIB, 10, None)];
        assert_eq!(
            region_limits(one, Some(-2), &NodeLimits::default()).priority,
            -2
        );
    }

    #[test]
    fn scaled_grants_are_split_into_device_memory_and_swap() {
        let scaled = NodeLimits {
            memory_scaling: "2".parse().expect("2"),
            ..NodeLimits::default()
        };
        assert!(scaled.oversubscribes());
        assert!(!NodeLimits::default().oversubscribes());
        // Two pods of 24 GiB on one 24 GiB card at scaling 2: each gets 12
        // GiB on the device and 12 GiB of swap.
        let limits = region_limits([share(24 * GIB, 50, None)], None, &scaled);
        assert_eq!(limits.memory_limit[..2], [12 * GIB, 0]);
        assert_eq!(limits.swap_limit[..2], [12 * GIB, 0]);
        // The node-wide swap comes on top of the scaled part.
        let both = NodeLimits {
            swap_limit: Some(GIB),
            ..scaled
        };
        let limits = region_limits(
            [share(24 * GIB, 50, None), share(3 * GIB, 50, None)],
            None,
            &both,
        );
        assert_eq!(limits.memory_limit[..2], [12 * GIB, 3 * GIB / 2]);
        assert_eq!(limits.swap_limit[..2], [13 * GIB, 3 * GIB / 2 + GIB]);
        // An uncapped grant stays uncapped, with the node-wide swap only.
        let limits = region_limits([share(0, 50, None)], None, &both);
        assert_eq!((limits.memory_limit[0], limits.swap_limit[0]), (0, GIB));
    }

    #[test]
    fn devices_are_numbered_by_nvml_index_with_unknown_ones_last() {
        let mut items = [("c", Some(2)), ("x", None), ("a", Some(0)), ("b", Some(1))];
        device_order(&mut items, |(_, index)| *index);
        let names: Vec<&str> = items.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["a", "b", "c", "x"]);
    }

    #[test]
    fn a_burst_follows_a_share_it_did_not_lend_above_and_is_never_below_it() {
        let mut limits = RegionLimits::default();
        limits.sm_limit[0] = 30;
        limits.sm_burst[0] = 30;
        limits.sm_limit[1] = 30;
        limits.sm_burst[1] = 80;
        limits.set_share(0, Some(50), None).expect("share");
        assert_eq!((limits.sm_limit[0], limits.sm_burst[0]), (50, 50));
        limits.set_share(1, Some(50), None).expect("share");
        assert_eq!((limits.sm_limit[1], limits.sm_burst[1]), (50, 80));
        assert_eq!(
            limits.set_share(1, None, Some(40)),
            Err(BurstBelowShare {
                burst: 40,
                cores: 50
            })
        );
        assert_eq!(
            limits.set_share(1, Some(90), Some(60)),
            Err(BurstBelowShare {
                burst: 60,
                cores: 90
            })
        );
        assert_eq!((limits.sm_limit[1], limits.sm_burst[1]), (50, 80));
        // A whole GPU is uncapped: any burst goes.
        limits.set_share(1, Some(100), Some(10)).expect("uncapped");
        assert_eq!((limits.sm_limit[1], limits.sm_burst[1]), (0, 10));
    }
}
