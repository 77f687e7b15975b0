//! Elastic GPU's custom resources (group `elasticgpu.io`) as typed
//! objects in their stored version (`v1alpha1`, the published schema that
//! the chart installs): [`ElasticGpuClaim`], [`ElasticGpuClass`] and
//! [`ElasticGpu`]; their two served versions; and the annotations where the
//! stored version keeps a class's fields it has no place for
//! ([`crate::admission::conversion`]).
//!
//! Every field is optional, as in the schema. A part of an object that
//! does not have the schema's shape (possible only where the definitions
//! installed are looser than the published ones) is kept as written, with
//! why it could not be read ([`Shaped::Unreadable`]): the object still
//! reads, its owner gets a clear condition, and a write back loses
//! nothing.

use k8s_openapi::api::core::v1::{NodeSelector, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::core::TypeMeta;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// The API group.
pub const GROUP: &str = "elasticgpu.io";
/// The stored version's name.
pub const VERSION: &str = "v1alpha1";
/// The stored version: the published schema.
pub const STORED_VERSION: &str = "elasticgpu.io/v1alpha1";
/// The documentation's form.
pub const README_VERSION: &str = "elasticgpu.io/v1alpha";
/// Where a class's v1alpha `reclaimPolicy` is kept in v1alpha1.
pub const RECLAIM_POLICY_ANNOTATION: &str = "vgpu.io/elasticgpu-reclaim-policy";
/// Where a class's v1alpha `egpuBindingMode` is kept in v1alpha1.
pub const BINDING_MODE_ANNOTATION: &str = "vgpu.io/elasticgpu-binding-mode";
/// The finalizer through which a deleted claim vgpu provisioned is
/// reclaimed.
pub const FINALIZER: &str = "vgpu.io/elasticgpu-reclaim";

/// A part of an object: read as `T` when it has `T`'s shape, else kept as
/// written with the reason it could not be read.
#[derive(Clone, Debug, PartialEq)]
pub enum Shaped<T> {
    Read(T),
    Unreadable { written: Value, why: String },
}

impl<T: Default> Default for Shaped<T> {
    fn default() -> Self {
        Self::Read(T::default())
    }
}

impl<T> Shaped<T> {
    /// The part, if it could be read.
    pub fn read(&self) -> Result<&T, &str> {
        match self {
            Self::Read(part) => Ok(part),
            Self::Unreadable { why, .. } => Err(why),
        }
    }
}

impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for Shaped<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let written = Value::deserialize(deserializer)?;
        Ok(match T::deserialize(&written) {
            Ok(part) => Self::Read(part),
            Err(error) => Self::Unreadable {
                why: error.to_string(),
                written,
            },
        })
    }
}

impl<T: Serialize> Serialize for Shaped<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Read(part) => part.serialize(serializer),
            Self::Unreadable { written, .. } => written.serialize(serializer),
        }
    }
}

/// An amount as the schemas write it: an integer or a quantity string
/// (`4`, `"512Mi"`); anything else is kept to be refused in words.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Amount {
    Number(serde_json::Number),
    Text(String),
    Other(Value),
}

/// Amounts by resource name.
pub type Amounts = BTreeMap<String, Amount>;

/// `ElasticGPUClaim` (namespaced): a request for a GPU share, bound to an
/// `ElasticGPU`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ElasticGpuClaim {
    #[serde(flatten, default)]
    pub types: Option<TypeMeta>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Shaped<ClaimSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Shaped<ClaimStatus>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ClaimResources>,
    /// The ElasticGPU the claim is bound to.
    #[serde(
        rename = "elasticGPUName",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub elastic_gpu_name: Option<String>,
    /// The class that provides it.
    #[serde(
        rename = "elasticGPUClassName",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub elastic_gpu_class_name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimResources {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Amounts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<Amounts>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimStatus {
    /// `Pending`, `Bound` or `Lost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<ClaimCondition>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimCondition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// `ElasticGPUClass` (cluster-wide): a way of providing ElasticGPUs, named
/// by claims. Its fields sit beside the metadata, not in a spec.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ElasticGpuClass {
    #[serde(flatten, default)]
    pub types: Option<TypeMeta>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(flatten)]
    pub fields: Shaped<ClassFields>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassFields {
    /// The provisioner that makes this class's ElasticGPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<BTreeMap<String, String>>,
}

impl ElasticGpuClass {
    /// Its provisioner; empty when it names none or cannot be read.
    pub fn provisioner(&self) -> &str {
        self.fields
            .read()
            .ok()
            .and_then(|fields| fields.provisioner.as_deref())
            .unwrap_or_default()
    }

    /// One of the settings v1alpha1 keeps in annotations, or `default`.
    pub fn setting<'a>(&'a self, annotation: &str, default: &'a str) -> &'a str {
        self.metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(annotation))
            .map_or(default, String::as_str)
    }
}

/// `ElasticGPU` (cluster-wide): a GPU device a claim is bound to.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ElasticGpu {
    #[serde(flatten, default)]
    pub types: Option<TypeMeta>,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Shaped<ElasticGpuSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Shaped<ElasticGpuStatus>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Amounts>,
    /// A qGPU slice of a physical GPU.
    #[serde(rename = "qGPU", default, skip_serializing_if = "Option::is_none")]
    pub q_gpu: Option<QGpu>,
    /// Whole physical GPUs.
    #[serde(
        rename = "physicalGPU",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub physical_gpu: Option<PhysicalGpu>,
    /// A share of one physical GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_share: Option<GpuShare>,
    /// The claim bound to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<ObjectReference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_affinity: Option<ElasticGpuNodeAffinity>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QGpu {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paths: Option<Vec<String>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PhysicalGpu {
    #[serde(default)]
    pub gpu_names: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuShare {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_name: Option<String>,
}

/// The nodes that can use an ElasticGPU: any one of the terms matches.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ElasticGpuNodeAffinity {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required: Option<NodeSelector>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ElasticGpuStatus {
    /// `Pending`, `Available`, `Bound`, `Released` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The `apiVersion` and `kind` of a stored-version object of `kind`.
fn stored_type(kind: &str) -> Option<TypeMeta> {
    Some(TypeMeta {
        api_version: STORED_VERSION.into(),
        kind: kind.into(),
    })
}

impl ElasticGpu {
    /// A new ElasticGPU, as it is created.
    pub fn new(metadata: ObjectMeta, spec: ElasticGpuSpec) -> Self {
        Self {
            types: stored_type("ElasticGPU"),
            metadata,
            spec: Shaped::Read(spec),
            status: None,
        }
    }

    /// Its phase, when it has one that reads.
    pub fn phase(&self) -> Option<&str> {
        match &self.status {
            Some(Shaped::Read(status)) => status.phase.as_deref(),
            _ => None,
        }
    }
}

impl ElasticGpuClaim {
    /// Its phase, when it has one that reads.
    pub fn phase(&self) -> Option<&str> {
        match &self.status {
            Some(Shaped::Read(status)) => status.phase.as_deref(),
            _ => None,
        }
    }

    /// Its condition of `type_`, when its status reads and has one.
    pub fn condition(&self, type_: &str) -> Option<&ClaimCondition> {
        match &self.status {
            Some(Shaped::Read(status)) => status.conditions.iter().find(|c| c.type_ == type_),
            _ => None,
        }
    }

    /// The class it names, if it names one and its spec reads.
    pub fn class_name(&self) -> Option<&str> {
        self.spec
            .read()
            .ok()?
            .elastic_gpu_class_name
            .as_deref()
            .filter(|name| !name.is_empty())
    }

    /// The ElasticGPU it names, if it names one and its spec reads.
    pub fn elastic_gpu_name(&self) -> Option<&str> {
        self.spec
            .read()
            .ok()?
            .elastic_gpu_name
            .as_deref()
            .filter(|name| !name.is_empty())
    }
}

/// Implements [`kube::Resource`] for an object type of the stored version.
macro_rules! stored_resource {
    ($type:ty, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $type {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }

            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(GROUP)
            }

            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(VERSION)
            }

            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }

            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }

            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

stored_resource!(
    ElasticGpuClaim,
    "ElasticGPUClaim",
    "elasticgpuclaims",
    k8s_openapi::NamespaceResourceScope
);
stored_resource!(
    ElasticGpuClass,
    "ElasticGPUClass",
    "elasticgpuclasses",
    k8s_openapi::ClusterResourceScope
);
stored_resource!(
    ElasticGpu,
    "ElasticGPU",
    "elasticgpus",
    k8s_openapi::ClusterResourceScope
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use serde_json::json;

    #[test]
    fn the_readme_objects_read_in_the_stored_version() {
        let claim: ElasticGpuClaim = serde_json::from_value(json!({
            "apiVersion": STORED_VERSION, "kind": "ElasticGPUClaim",
            "metadata": {"name": "gpushare-egpuc-1", "namespace": "default"},
            "spec": {"elasticGPUClassName": "gpushare-egpuclass", "resources": {"requests": {
                "gpushare.provisioner.elasticgpu.io/gpu-core": 10,
                "gpushare.provisioner.elasticgpu.io/gpu-memory": "4Gi"}}},
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False",
                       "reason": "NoCapacity", "message": "m"}]},
        }))
        .expect("claim");
        assert_eq!(claim.class_name(), Some("gpushare-egpuclass"));
        assert_eq!(claim.phase(), Some("Pending"));
        assert_eq!(
            claim.condition("Ready").and_then(|c| c.reason.as_deref()),
            Some("NoCapacity")
        );
        let requests = claim.spec.read().expect("spec").resources.clone();
        let requests = requests.and_then(|r| r.requests).expect("requests");
        assert_eq!(
            requests["gpushare.provisioner.elasticgpu.io/gpu-core"],
            Amount::Number(10.into())
        );
        assert_eq!(
            requests["gpushare.provisioner.elasticgpu.io/gpu-memory"],
            Amount::Text("4Gi".into())
        );
        let class: ElasticGpuClass = serde_json::from_value(json!({
            "apiVersion": STORED_VERSION, "kind": "ElasticGPUClass",
            "metadata": {"name": "c", "annotations": {RECLAIM_POLICY_ANNOTATION: "Retain"}},
            "provisioner": "gpushare.provisioner.elasticgpu.io",
        }))
        .expect("class");
        assert_eq!(class.provisioner(), "gpushare.provisioner.elasticgpu.io");
        assert_eq!(class.setting(RECLAIM_POLICY_ANNOTATION, "Delete"), "Retain");
        assert_eq!(
            class.setting(BINDING_MODE_ANNOTATION, "Immediate"),
            "Immediate"
        );
        assert_eq!(
            ElasticGpuClaim::url_path(&(), Some("ns")),
            "/apis/elasticgpu.io/v1alpha1/namespaces/ns/elasticgpuclaims"
        );
        assert_eq!(
            ElasticGpu::url_path(&(), None),
            "/apis/elasticgpu.io/v1alpha1/elasticgpus"
        );
    }

    #[test]
    fn a_part_of_another_shape_is_kept_as_written_with_the_reason() {
        let written = json!({
            "metadata": {"name": "odd", "namespace": "ns"},
            "spec": {"elasticGPUClassName": ["not", "a", "name"], "extra": 1},
            "status": {"phase": "Pending"},
        });
        let claim: ElasticGpuClaim = serde_json::from_value(written.clone()).expect("reads");
        let why = claim.spec.read().expect_err("unreadable");
        assert!(why.contains("invalid type"), "{why}");
        assert_eq!(claim.class_name(), None);
        assert_eq!(claim.phase(), Some("Pending"), "the rest still reads");
        // Written back, nothing is lost.
        assert_eq!(serde_json::to_value(&claim).expect("json"), written);
        let class: ElasticGpuClass =
            serde_json::from_value(json!({"metadata": {"name": "c"}, "provisioner": 5}))
                .expect("reads");
        assert!(class.fields.read().is_err());
        assert_eq!(class.provisioner(), "");
    }

    #[test]
    fn a_new_elastic_gpu_is_written_in_the_stored_version() {
        let spec = ElasticGpuSpec {
            gpu_share: Some(GpuShare {
                gpu_name: Some("GPU-1".into()),
            }),
            ..ElasticGpuSpec::default()
        };
        let object = ElasticGpu::new(
            ObjectMeta {
                name: Some("egpu-1".into()),
                ..ObjectMeta::default()
            },
            spec,
        );
        assert_eq!(
            serde_json::to_value(&object).expect("json"),
            json!({
                "apiVersion": STORED_VERSION, "kind": "ElasticGPU",
                "metadata": {"name": "egpu-1"},
                "spec": {"gpuShare": {"gpuName": "GPU-1"}},
            })
        );
    }
}
