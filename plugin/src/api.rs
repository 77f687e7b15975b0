//! Kubelet's device plugin API, v1beta1, generated from `proto/api.proto`,
//! and the part of its PodResources API, v1, the plugin reads
//! (`proto/podresources.proto`).

pub mod v1beta1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}
pub mod podresources_v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}
