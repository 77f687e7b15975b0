//! Kubelet's DRA service, v1, and its plugin registration service,
//! generated from `proto/`.

pub mod dra_v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}
pub mod registration {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pluginregistration");
}
