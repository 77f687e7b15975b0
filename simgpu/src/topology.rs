//! The simulated machine's topology: the NUMA node of each device and the
//! NVLinks between devices, from `SIMGPU_NUMA` and `SIMGPU_NVLINK`.
//!
//! Everything here is in the machine's device indices (a process that sees
//! only some devices still sees their links to the others, as a container
//! does on a real machine).
//!
//! * `SIMGPU_NUMA`: one NUMA node per device, in device order, separated by
//!   commas (`0,0,1,1`). Unset: NUMA is unknown (NVML's
//!   `nvmlDeviceGetNumaNodeId` says `NOT_SUPPORTED`, as on most PCIe
//!   machines) and every device counts as on one node.
//! * `SIMGPU_NVLINK`: groups separated by `;`, each a comma-separated list
//!   of at least two device indices; every pair in a group is joined by one
//!   NVLink (`0,2;1,3` makes two islands of two, `0,1,2,3` one all-to-all
//!   island, `0,1;1,2;2,3` a chain). A pair named twice gets two links, as
//!   real GPUs bond several links to one peer. A device has at most
//!   [`NVLINK_MAX_LINKS`] links, numbered in the order they are named.
//!   Unset or empty: the machine has no NVLink (NVML's NVLink queries say
//!   `NOT_SUPPORTED`).

/// `NVML_NVLINK_MAX_LINKS` of current NVML headers.
pub const NVLINK_MAX_LINKS: usize = 18;

/// `nvmlGpuTopologyLevel_t` values.
pub const NVML_TOPOLOGY_INTERNAL: u32 = 0;
pub const NVML_TOPOLOGY_NODE: u32 = 40;
pub const NVML_TOPOLOGY_SYSTEM: u32 = 50;

/// The machine's topology (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// NUMA node of each device; `None`: not configured.
    pub numa: Option<Vec<u32>>,
    /// Per device, the device at the far end of each of its links, in link
    /// order; `None`: the machine has no NVLink.
    pub nvlinks: Option<Vec<Vec<usize>>>,
}

/// What one link of one device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// The machine has no NVLink.
    NotSupported,
    /// The link number is past `NVLINK_MAX_LINKS`.
    OutOfRange,
    /// A link the device has, not connected.
    Inactive,
    /// Connected to this device (machine index).
    Active(usize),
}

impl Topology {
    /// NUMA node of device `machine`, if configured.
    pub fn numa_node(&self, machine: usize) -> Option<u32> {
        self.numa.as_ref()?.get(machine).copied()
    }

    /// Link `link` of device `machine`.
    pub fn link(&self, machine: usize, link: usize) -> Link {
        let Some(nvlinks) = &self.nvlinks else {
            return Link::NotSupported;
        };
        if link >= NVLINK_MAX_LINKS {
            return Link::OutOfRange;
        }
        match nvlinks.get(machine).and_then(|links| links.get(link)) {
            Some(&peer) => Link::Active(peer),
            None => Link::Inactive,
        }
    }

    /// `nvmlGpuTopologyLevel_t` of the closest common PCIe ancestor of two
    /// devices: the device itself, its NUMA node's host bridges, or the
    /// system (NVLink is no PCIe path and does not change this, as in NVML).
    pub fn common_ancestor(&self, a: usize, b: usize) -> u32 {
        if a == b {
            NVML_TOPOLOGY_INTERNAL
        } else if self.numa_node(a) == self.numa_node(b) {
            NVML_TOPOLOGY_NODE
        } else {
            NVML_TOPOLOGY_SYSTEM
        }
    }
}

/// Reads both variables for a machine of `devices` devices.
pub fn from_env(var: &impl Fn(&str) -> Option<String>, devices: usize) -> Result<Topology, String> {
    let numa = match var("SIMGPU_NUMA") {
        Some(text) => Some(parse_numa(&text, devices)?),
        None => None,
    };
    let nvlinks = match var("SIMGPU_NVLINK") {
        Some(text) if !text.trim().is_empty() => Some(parse_nvlink(&text, devices)?),
        _ => None,
    };
    Ok(Topology { numa, nvlinks })
}

/// `SIMGPU_NUMA`: exactly one node (0..=1023) per device.
pub fn parse_numa(text: &str, devices: usize) -> Result<Vec<u32>, String> {
    let bad = |why: String| format!("bad SIMGPU_NUMA={text:?}: {why}");
    let nodes = text
        .split(',')
        .map(|item| match item.trim().parse::<u32>() {
            Ok(node) if node <= 1023 => Ok(node),
            _ => Err(bad(format!(
                "{:?} is not a NUMA node (a whole number from 0 to 1023)",
                item.trim()
            ))),
        })
        .collect::<Result<Vec<u32>, String>>()?;
    if nodes.len() != devices {
        return Err(bad(format!(
            "{} node(s) for {devices} device(s); give one NUMA node per device, in device order",
            nodes.len()
        )));
    }
    Ok(nodes)
}

/// `SIMGPU_NVLINK`: groups of devices joined all-to-all (see the module
/// documentation); returns each device's peers in link order.
pub fn parse_nvlink(text: &str, devices: usize) -> Result<Vec<Vec<usize>>, String> {
    let bad = |why: String| format!("bad SIMGPU_NVLINK={text:?}: {why}");
    let mut links: Vec<Vec<usize>> = vec![Vec::new(); devices];
    for group in text.split(';').map(str::trim).filter(|g| !g.is_empty()) {
        let members = parse_group(group, devices).map_err(bad)?;
        for (k, &a) in members.iter().enumerate() {
            for &b in &members[k + 1..] {
                links[a].push(b);
                links[b].push(a);
            }
        }
    }
    if let Some((device, peers)) = links
        .iter()
        .enumerate()
        .find(|(_, peers)| peers.len() > NVLINK_MAX_LINKS)
    {
        return Err(bad(format!(
            "GPU {device} gets {} links, a GPU has at most {NVLINK_MAX_LINKS}",
            peers.len()
        )));
    }
    Ok(links)
}

/// One group: at least two distinct device indices.
fn parse_group(group: &str, devices: usize) -> Result<Vec<usize>, String> {
    let mut members: Vec<usize> = Vec::new();
    for item in group.split(',').map(str::trim) {
        let index = item.parse::<usize>().map_err(|_| {
            format!("{item:?} in group {group:?} is not a GPU index (groups are separated by ';', GPUs by ',')")
        })?;
        if index >= devices {
            return Err(format!(
                "GPU {index} in group {group:?} is no device of this machine (it has {devices}: 0 to {})",
                devices.saturating_sub(1)
            ));
        }
        if members.contains(&index) {
            return Err(format!(
                "GPU {index} is linked to itself (named twice in group {group:?})"
            ));
        }
        members.push(index);
    }
    if members.len() < 2 {
        return Err(format!(
            "group {group:?} names one GPU; a group needs at least two"
        ));
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numa_nodes_one_per_device() {
        assert_eq!(parse_numa("0, 0,1,1", 4), Ok(vec![0, 0, 1, 1]));
        for (text, needle) in [
            ("0,1", "2 node(s) for 4 device(s)"),
            ("0,1,1,1,0", "5 node(s)"),
            ("0,x,1,1", "\"x\" is not a NUMA node"),
            ("0,-1,1,1", "\"-1\""),
            ("0,,1,1", "\"\""),
            ("0,1024,1,1", "\"1024\""),
        ] {
            let error = parse_numa(text, 4).expect_err(text);
            assert!(error.contains(needle), "{text}: {error}");
            assert!(error.starts_with("bad SIMGPU_NUMA="), "{error}");
        }
    }

    #[test]
    fn groups_join_every_pair_in_link_order() {
        let links = parse_nvlink("0,2; 1,3", 4).expect("valid");
        assert_eq!(links, vec![vec![2], vec![3], vec![0], vec![1]]);
        let mesh = parse_nvlink("0,1,2", 3).expect("valid");
        assert_eq!(mesh, vec![vec![1, 2], vec![0, 2], vec![0, 1]]);
        // A pair named twice gets two links; a trailing ';' is harmless.
        let bonded = parse_nvlink("0,1;0,1;", 3).expect("valid");
        assert_eq!(bonded, vec![vec![1, 1], vec![0, 0], vec![]]);
    }

    #[test]
    fn bad_groups_are_named() {
        for (text, needle) in [
            (
                "0,4",
                "GPU 4 in group \"0,4\" is no device of this machine (it has 4",
            ),
            ("0,0", "GPU 0 is linked to itself"),
            ("1,2,1", "GPU 1 is linked to itself"),
            ("0,1;2", "group \"2\" names one GPU"),
            ("0,x", "\"x\" in group \"0,x\" is not a GPU index"),
            ("0-1", "\"0-1\" in group \"0-1\" is not a GPU index"),
            ("0,,1", "\"\" in group"),
        ] {
            let error = parse_nvlink(text, 4).expect_err(text);
            assert!(error.contains(needle), "{text}: {error}");
            assert!(error.starts_with("bad SIMGPU_NVLINK="), "{error}");
            assert!(!error.contains('\n'));
        }
        let too_many = vec!["0,1"; NVLINK_MAX_LINKS + 1].join(";");
        let error = parse_nvlink(&too_many, 2).expect_err("19 links");
        assert!(error.contains("GPU 0 gets 19 links"), "{error}");
        assert!(parse_nvlink(&vec!["0,1"; NVLINK_MAX_LINKS].join(";"), 2).is_ok());
    }

    #[test]
    fn links_and_ancestors() {
        let topology = Topology {
            numa: Some(vec![0, 0, 1, 1]),
            nvlinks: Some(parse_nvlink("0,2;1,3", 4).expect("valid")),
        };
        assert_eq!(topology.link(0, 0), Link::Active(2));
        assert_eq!(topology.link(3, 0), Link::Active(1));
        assert_eq!(topology.link(0, 1), Link::Inactive);
        assert_eq!(topology.link(0, NVLINK_MAX_LINKS - 1), Link::Inactive);
        assert_eq!(topology.link(0, NVLINK_MAX_LINKS), Link::OutOfRange);
        assert_eq!(topology.common_ancestor(1, 1), NVML_TOPOLOGY_INTERNAL);
        assert_eq!(topology.common_ancestor(0, 1), NVML_TOPOLOGY_NODE);
        assert_eq!(topology.common_ancestor(1, 2), NVML_TOPOLOGY_SYSTEM);
        assert_eq!(topology.numa_node(2), Some(1));
        let flat = Topology::default();
        assert_eq!(flat.link(0, 0), Link::NotSupported);
        assert_eq!(flat.numa_node(0), None);
        // Unknown NUMA: one node.
        assert_eq!(flat.common_ancestor(0, 3), NVML_TOPOLOGY_NODE);
    }

    #[test]
    fn unset_or_empty_means_none() {
        let none = from_env(&|_: &str| None, 4).expect("valid");
        assert_eq!(none, Topology::default());
        let empty = from_env(
            &|name: &str| (name == "SIMGPU_NVLINK").then(|| " ".to_string()),
            4,
        )
        .expect("valid");
        assert_eq!(empty.nvlinks, None);
    }
}
