//! The hash map the state keeps nodes, pods and Leases in.

use std::collections::HashMap;

/// A hash map with a fast (seeded) hasher: node names and pod UIDs are
/// looked up thousands of times per request.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
