//! Every GPU's processes summed by owner, with what the owner was granted
//! on that GPU: the unit both backstops judge.

use crate::owners::Owner;
use crate::unenforced::ProcessUse;
use std::collections::HashMap;

/// An owner's processes on one GPU, and its grant there (a cap, a share).
#[derive(Debug)]
pub struct Group<'a, T> {
    pub granted: T,
    pub members: Vec<&'a ProcessUse>,
}

/// An owner and a GPU (its UUID).
pub type OwnerOnGpu = (Owner, String);

/// Groups `live` by owner and GPU. A container's grant is `grants[(region
/// key, GPU UUID)]`; a pod whose container could not be told apart is held
/// to `pod_total` of its containers' grants there (`None`: not held, as
/// when one of them is unlimited). `pod_of` maps a region key to its pod's
/// UID. Owners without a grant on the GPU, and processes of no pod, are
/// left out.
pub fn by_owner<'a, T: Copy>(
    live: &[&'a ProcessUse],
    grants: &HashMap<(String, String), T>,
    pod_of: &HashMap<String, String>,
    pod_total: impl Fn(&[T]) -> Option<T>,
) -> HashMap<OwnerOnGpu, Group<'a, T>> {
    let mut groups: HashMap<OwnerOnGpu, Group<'a, T>> = HashMap::new();
    for &use_ in live {
        let id = (use_.owner.clone(), use_.gpu_uuid.clone());
        match &use_.owner {
            Owner::Region(key) => {
                let Some(&granted) = grants.get(&(key.clone(), use_.gpu_uuid.clone())) else {
                    continue;
                };
                groups
                    .entry(id)
                    .or_insert(Group {
                        granted,
                        members: Vec::new(),
                    })
                    .members
                    .push(use_);
            }
            Owner::Pod(uid) => {
                if groups.contains_key(&id) {
                    continue;
                }
                let of_pod: Vec<T> = pod_of
                    .iter()
                    .filter(|(_, pod)| *pod == uid)
                    .filter_map(|(key, _)| grants.get(&(key.clone(), use_.gpu_uuid.clone())))
                    .copied()
                    .collect();
                if of_pod.is_empty() {
                    continue;
                }
                let Some(granted) = pod_total(&of_pod) else {
                    continue;
                };
                // The pod answers for every process of its containers too.
                let members = live
                    .iter()
                    .copied()
                    .filter(|u| u.gpu_uuid == use_.gpu_uuid)
                    .filter(|u| match &u.owner {
                        Owner::Pod(other) => other == uid,
                        Owner::Region(key) => pod_of.get(key) == Some(uid),
                        Owner::Unknown => false,
                    })
                    .collect();
                groups.insert(id, Group { granted, members });
            }
            Owner::Unknown => {}
        }
    }
    groups
}
