//! `vgpu cordon` and `vgpu uncordon`: single GPUs of a Kubernetes node out
//! of service and back, through the node annotation the extender and the
//! DRA driver read ([`vgpu_cluster::cordon`]). Running pods are left alone;
//! new vGPUs go elsewhere.
//!
//! The node is read, the list edited and written back with the node's
//! `resourceVersion`, so two edits at once never lose one (the later is
//! retried on the node as the earlier left it).

use crate::args::{CordonArgs, UncordonArgs};
use crate::cluster_api::{with_client, ConnectError};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use thiserror::Error;
use vgpu_cluster::cordon::{
    cordoned_gpus, edited_list, CORDONED_GPUS_ANNOTATION, HAMI_DEVICE_CORDON_ANNOTATION,
};
use vgpu_cluster::decision::{NodeInventory, NODE_INVENTORY_ANNOTATION};
use vgpu_dra::slice::{attribute, DRIVER_NAME};

/// Edits tried before giving up when the node keeps changing under them.
const ATTEMPTS: usize = 5;

#[derive(Debug, Error)]
pub enum CordonError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("node {0} not found")]
    NoNode(String),
    #[error("reading node {node}")]
    ReadNode {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("reading the ResourceSlices of node {node}")]
    ReadSlices {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing node {node}'s annotations")]
    Write {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("node {node} changed under {ATTEMPTS} edits in a row; nothing was changed, try again")]
    Contended { node: String },
    #[error("node {node} has no GPU {gpu}: its GPUs are {known}")]
    UnknownGpu {
        node: String,
        gpu: String,
        known: String,
    },
    #[error("node {node} lists no vGPU GPUs (no {NODE_INVENTORY_ANNOTATION} annotation and no {DRIVER_NAME} ResourceSlice): name GPUs by UUID")]
    NoGpus { node: String },
    #[error("writing the answer")]
    Output(#[from] std::io::Error),
}

/// One GPU of the node, as its plugin's inventory or its DRA slice lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KnownGpu {
    index: Option<u32>,
    uuid: String,
}

/// What a command asks of one node.
enum Change<'a> {
    Cordon(&'a [String]),
    Uncordon(&'a [String]),
    UncordonAll,
    /// Nothing: show the node's GPUs and which are cordoned.
    Show,
}

pub fn cordon(args: &CordonArgs, out: &mut impl Write) -> Result<(), CordonError> {
    let change = if args.gpus.is_empty() {
        Change::Show
    } else {
        Change::Cordon(&args.gpus)
    };
    run(&args.node, args.kubeconfig.as_ref(), change, out)
}

pub fn uncordon(args: &UncordonArgs, out: &mut impl Write) -> Result<(), CordonError> {
    let change = if args.all {
        Change::UncordonAll
    } else {
        Change::Uncordon(&args.gpus)
    };
    run(&args.node, args.kubeconfig.as_ref(), change, out)
}

fn run(
    node: &str,
    kubeconfig: Option<&PathBuf>,
    change: Change<'_>,
    out: &mut impl Write,
) -> Result<(), CordonError> {
    with_client(kubeconfig.map(PathBuf::as_path), |client| async move {
        edit(&client, node, &change, out).await
    })
}

async fn edit(
    client: &Client,
    name: &str,
    change: &Change<'_>,
    out: &mut impl Write,
) -> Result<(), CordonError> {
    let nodes: Api<Node> = Api::all(client.clone());
    for _ in 0..ATTEMPTS {
        let node = nodes
            .get_opt(name)
            .await
            .map_err(|source| CordonError::ReadNode {
                node: name.to_string(),
                source,
            })?
            .ok_or_else(|| CordonError::NoNode(name.to_string()))?;
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        let known = known_gpus(client, name, &annotations).await?;
        let cordoned: Vec<String> = cordoned_gpus(Some(&annotations))
            .into_iter()
            .map(str::to_string)
            .collect();
        let (add, remove): (Vec<String>, Vec<String>) = match change {
            Change::Show => {
                show(name, &known, &cordoned, out)?;
                return Ok(());
            }
            Change::Cordon(gpus) => (resolve(name, gpus, &known, &[])?, Vec::new()),
            Change::Uncordon(gpus) => (Vec::new(), resolve(name, gpus, &known, &cordoned)?),
            Change::UncordonAll => (Vec::new(), cordoned.clone()),
        };
        let add: Vec<&str> = add.iter().map(String::as_str).collect();
        let remove: Vec<&str> = remove.iter().map(String::as_str).collect();
        // Both spellings are read, so an uncordon clears a GPU from both;
        // a cordon writes vgpu's.
        let mut edits = serde_json::Map::new();
        for key in [CORDONED_GPUS_ANNOTATION, HAMI_DEVICE_CORDON_ANNOTATION] {
            let adds = if key == CORDONED_GPUS_ANNOTATION {
                add.as_slice()
            } else {
                &[]
            };
            let current = annotations.get(key).map(String::as_str);
            let next = edited_list(current, adds, &remove);
            if next != edited_list(current, &[], &[]) {
                edits.insert(
                    key.to_string(),
                    next.map_or(serde_json::Value::Null, Into::into),
                );
            }
        }
        if edits.is_empty() {
            writeln!(out, "node {name}: nothing to change")?;
            show(name, &known, &cordoned, out)?;
            return Ok(());
        }
        let patch = serde_json::json!({
            "metadata": {
                "resourceVersion": node.metadata.resource_version,
                "annotations": edits,
            }
        });
        match nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(written) => {
                let now: Vec<String> = cordoned_gpus(written.metadata.annotations.as_ref())
                    .into_iter()
                    .map(str::to_string)
                    .collect();
                for uuid in &add {
                    writeln!(out, "node {name}: {} cordoned", describe(uuid, &known))?;
                }
                for uuid in &remove {
                    writeln!(out, "node {name}: {} uncordoned", describe(uuid, &known))?;
                }
                tracing::info!(node = name, cordoned = ?now, "cordon list written");
                show(name, &known, &now, out)?;
                return Ok(());
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                tracing::info!(
                    node = name,
                    "the node changed while edited: reading it again"
                );
            }
            Err(source) => {
                return Err(CordonError::Write {
                    node: name.to_string(),
                    source,
                })
            }
        }
    }
    Err(CordonError::Contended {
        node: name.to_string(),
    })
}

/// The node's GPUs: its device plugin's inventory annotation, else the
/// devices of its DRA ResourceSlices (a GPU cordoned there has left them).
async fn known_gpus(
    client: &Client,
    node: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<Vec<KnownGpu>, CordonError> {
    if let Some(inventory) = annotations
        .get(NODE_INVENTORY_ANNOTATION)
        .and_then(|text| NodeInventory::parse(text).ok())
    {
        return Ok(inventory
            .gpus
            .into_iter()
            .map(|gpu| KnownGpu {
                index: Some(gpu.index),
                uuid: gpu.uuid,
            })
            .collect());
    }
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let listed = slices
        .list(
            &ListParams::default()
                .fields(&format!("spec.nodeName={node},spec.driver={DRIVER_NAME}")),
        )
        .await;
    let listed = match listed {
        Ok(listed) => listed,
        // A cluster without DRA's API: the inventory was all there was.
        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(Vec::new()),
        Err(source) => {
            return Err(CordonError::ReadSlices {
                node: node.to_string(),
                source,
            })
        }
    };
    let mut gpus: Vec<KnownGpu> = listed
        .items
        .iter()
        .flat_map(|slice| slice.spec.devices.iter().flatten())
        .filter_map(|device| {
            let attributes = device.attributes.as_ref()?;
            Some(KnownGpu {
                uuid: attributes.get(attribute::UUID)?.string.clone()?,
                index: attributes
                    .get(attribute::INDEX)
                    .and_then(|value| value.int)
                    .and_then(|index| u32::try_from(index).ok()),
            })
        })
        .collect();
    gpus.sort_by_key(|gpu| gpu.index);
    Ok(gpus)
}

/// Each named GPU as a UUID: an index or UUID the node lists, or (to
/// uncordon) one of `also`, the UUIDs cordoned now.
fn resolve(
    node: &str,
    named: &[String],
    known: &[KnownGpu],
    also: &[String],
) -> Result<Vec<String>, CordonError> {
    named
        .iter()
        .map(|gpu| {
            let found = known.iter().find(|k| match gpu.parse::<u32>() {
                Ok(index) => k.index == Some(index),
                Err(_) => k.uuid == *gpu,
            });
            if let Some(found) = found {
                return Ok(found.uuid.clone());
            }
            if also.contains(gpu) {
                return Ok(gpu.clone());
            }
            // Neither listing known (a DRA node whose every GPU is
            // cordoned, say): a UUID is taken as given.
            if known.is_empty() && gpu.starts_with("GPU-") {
                return Ok(gpu.clone());
            }
            if known.is_empty() {
                return Err(CordonError::NoGpus {
                    node: node.to_string(),
                });
            }
            Err(CordonError::UnknownGpu {
                node: node.to_string(),
                gpu: gpu.clone(),
                known: known
                    .iter()
                    .map(|k| describe(&k.uuid, known))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        })
        .collect()
}

fn describe(uuid: &str, known: &[KnownGpu]) -> String {
    match known.iter().find(|k| k.uuid == uuid).and_then(|k| k.index) {
        Some(index) => format!("{index} ({uuid})"),
        None => uuid.to_string(),
    }
}

fn show(
    node: &str,
    known: &[KnownGpu],
    cordoned: &[String],
    out: &mut impl Write,
) -> Result<(), CordonError> {
    for gpu in known {
        let state = if cordoned.contains(&gpu.uuid) {
            "cordoned"
        } else {
            "in service"
        };
        writeln!(
            out,
            "node {node}: GPU {}: {state}",
            describe(&gpu.uuid, known)
        )?;
    }
    for uuid in cordoned
        .iter()
        .filter(|uuid| !known.iter().any(|k| &k.uuid == *uuid))
    {
        writeln!(
            out,
            "node {node}: GPU {uuid}: cordoned (not listed by the node now)"
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known() -> Vec<KnownGpu> {
        vec![
            KnownGpu {
                index: Some(0),
                uuid: "GPU-a".into(),
            },
            KnownGpu {
                index: Some(1),
                uuid: "GPU-b".into(),
            },
        ]
    }

    #[test]
    fn gpus_are_named_by_index_or_uuid_and_unknown_ones_refused_with_the_list() {
        let named = ["1".to_string(), "GPU-a".to_string()];
        assert_eq!(
            resolve("n1", &named, &known(), &[]).expect("known"),
            ["GPU-b", "GPU-a"]
        );
        let error = resolve("n1", &["7".into()], &known(), &[]).expect_err("no GPU 7");
        assert_eq!(
            error.to_string(),
            "node n1 has no GPU 7: its GPUs are 0 (GPU-a), 1 (GPU-b)"
        );
        // A cordoned GPU the node no longer lists can still be uncordoned.
        assert_eq!(
            resolve("n1", &["GPU-gone".into()], &known(), &["GPU-gone".into()]).expect("cordoned"),
            ["GPU-gone"]
        );
        assert!(matches!(
            resolve("n1", &["0".into()], &[], &[]),
            Err(CordonError::NoGpus { .. })
        ));
        assert_eq!(
            resolve("n1", &["GPU-x".into()], &[], &[]).expect("a UUID"),
            ["GPU-x"]
        );
    }
}
