//! Nodes from the watch.

use super::{recompute_node, ClusterState};
use crate::cache::book::Book;
use crate::cache::gpus::NodeGpus;
use crate::cache::nodes::{Inventory, NodeEntry};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher::Event;
use std::sync::Arc;
use vgpu_cluster::cordon::cordoned_gpus;
use vgpu_cluster::decision::NodeInventory;
use vgpu_cluster::decision::NODE_INVENTORY_ANNOTATION;
use vgpu_cluster::report::with_causes;
use vgpu_cluster::resources::parse_whole_quantity;

impl Book<Node> for ClusterState {
    const KIND: &'static str = "node";

    fn apply_event(&mut self, event: Event<Node>) {
        match event {
            Event::Init => self.begin_node_relist(),
            Event::InitApply(node) | Event::Apply(node) => self.apply_node(&node),
            Event::InitDone => self.finish_node_relist(),
            Event::Delete(node) => self.delete_node(&node),
        }
    }
}

impl ClusterState {
    /// Starts a complete list of nodes.
    fn begin_node_relist(&mut self) {
        self.node_relist = Some(Vec::new());
    }

    /// Applies a node (from a list or the watch).
    fn apply_node(&mut self, node: &Node) {
        let name = match &node.metadata.name {
            Some(name) => name.clone(),
            None => return,
        };
        self.note_node_version(node);
        if let Some(seen) = &mut self.node_relist {
            seen.push(name.clone());
        }
        let parsed = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_INVENTORY_ANNOTATION))
            .map(|text| NodeInventory::parse(text));
        let entry = self
            .nodes
            .entry(name.clone())
            .or_insert_with(NodeEntry::new);
        entry.in_api = true;
        entry.extended_allocatable = node
            .status
            .as_ref()
            .and_then(|status| status.allocatable.as_ref())
            .map(|allocatable| {
                allocatable
                    .iter()
                    .filter(|(name, _)| name.contains('/'))
                    .filter_map(|(name, quantity)| {
                        parse_whole_quantity(&quantity.0)
                            .ok()
                            .map(|amount| (name.clone(), amount))
                    })
                    .collect()
            })
            .unwrap_or_default();
        entry.several_pending = matches!(&parsed, Some(Ok(inventory)) if inventory.several_pending);
        let (inventory, gpus) = match parsed {
            None => (Inventory::Missing, Vec::new()),
            Some(Err(error)) => {
                if !matches!(entry.inventory, Inventory::Invalid(_)) {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "node {name}: unreadable GPU inventory"
                    );
                }
                (Inventory::Invalid(with_causes(&error)), Vec::new())
            }
            Some(Ok(inventory)) => (Inventory::Valid, inventory.gpus),
        };
        entry.inventory = inventory;
        if entry.gpus.gpus != gpus {
            let models = &mut self.models;
            entry.gpus = NodeGpus::with_models(gpus, |model| {
                models
                    .entry(model.to_string())
                    .or_insert_with(|| Arc::from(model))
                    .clone()
            });
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, &name);
        }
        if let Some(entry) = self.nodes.get_mut(&name) {
            let cordoned = cordoned_gpus(node.metadata.annotations.as_ref());
            let NodeGpus { gpus, hot } = &mut entry.gpus;
            for (gpu, hot) in gpus.iter().zip(hot.iter_mut()) {
                hot.cordoned = cordoned.contains(&gpu.uuid.as_str());
            }
        }
        self.updates += 1;
    }

    /// Ends a complete list of nodes: nodes it did not contain are gone.
    fn finish_node_relist(&mut self) {
        if let Some(seen) = self.node_relist.take() {
            let seen: std::collections::HashSet<String> = seen.into_iter().collect();
            let gone: Vec<String> = self
                .nodes
                .keys()
                .filter(|name| !seen.contains(*name))
                .cloned()
                .collect();
            for name in gone {
                self.remove_node(&name);
            }
        }
        if !self.nodes_synced {
            tracing::info!("Kubernetes API: {} node(s) listed", self.nodes.len());
        }
        self.nodes_synced = true;
    }

    /// Remembers the newest node version seen (a relist must not go back
    /// before it).
    fn note_node_version(&mut self, node: &Node) {
        if let Some(version) = node
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
        {
            self.seen_node_version = self.seen_node_version.max(version);
        }
    }

    /// A node was deleted.
    fn delete_node(&mut self, node: &Node) {
        self.note_node_version(node);
        if let Some(name) = &node.metadata.name {
            self.remove_node(name);
        }
    }

    fn remove_node(&mut self, name: &str) {
        let keep = match self.nodes.get_mut(name) {
            Some(entry) => {
                entry.in_api = false;
                entry.inventory = Inventory::Missing;
                entry.several_pending = false;
                entry.gpus = NodeGpus::default();
                !entry.pods.is_empty() || !entry.reservations.is_empty()
            }
            None => return,
        };
        if keep {
            recompute_node(&mut self.nodes, &self.pods, &self.reservations, name);
        } else {
            self.nodes.remove(name);
        }
        self.updates += 1;
    }
}
