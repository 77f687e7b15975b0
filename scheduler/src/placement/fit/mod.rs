//! Whether, and where, a pod's containers fit on one node's GPUs.
//!
//! A GPU takes a vGPU when it is healthy, not cordoned
//! ([`vgpu_cluster::cordon`]), of a wanted model and UUID, has a
//! free slot (fewer containers than its split count), enough free memory and
//! compute, and exclusivity holds both ways: a container asking for 100 %
//! compute takes the GPU alone (it must be empty, and nothing joins it
//! later). A container's vGPUs go to different GPUs; containers of one pod
//! may share a GPU.
//!
//! Init containers follow Kubernetes' lifetime rules: a regular init
//! container runs alone before the others, so it is placed against the
//! node's other pods (and the pod's sidecars) only, and its grant is counted
//! only while the pod has not started; sidecars (`restartPolicy: Always`)
//! run alongside and are placed with the regular containers.
//!
//! A container asking for several GPUs gets them from one NVLink island
//! when one island has enough GPUs that fit, else from one NUMA node, else
//! wherever the policy puts them: of the islands (NUMA nodes) that can hold
//! them all, the one the policy's order completes first, and in it the
//! GPUs the policy prefers.
//!
//! - [`gpu_check`]: one GPU for one vGPU, and the reasons in words.
//! - [`packing`]: every container of a pod on a node's GPUs.
//! - [`load`]: how loaded a node is, for the node policies.

pub mod gpu_check;
pub mod load;
pub mod packing;
#[cfg(test)]
mod tests;
