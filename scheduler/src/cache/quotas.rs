//! The namespaces' GPU quotas: standard ResourceQuota objects whose `hard`
//! names the vGPU memory or cores resource (`requests.nvidia.com/gpumem`,
//! `requests.nvidia.com/gpucores`, as Kubernetes spells a quota of an
//! extended resource).
//!
//! Kubernetes' own quota counts such a resource once per container, as the
//! container names it; a pod's vGPUs each take that much, and a memory
//! percentage or a whole GPU names no number at all. The extender counts
//! what each pod's decision grants on its GPUs instead
//! ([`crate::placement::quota`]), which is never less, so the API server's
//! count never refuses a pod the extender's admits. Several quotas in one
//! namespace: the smallest limit holds.

use crate::cache::book::Listing;
use crate::cache::fast_map::FastMap;
use k8s_openapi::api::core::v1::ResourceQuota;
use std::collections::BTreeMap;
use vgpu_cluster::resources::parse_whole_quantity;

/// The prefix of a quota's key on a requested resource.
pub const QUOTA_REQUESTS_PREFIX: &str = "requests.";

/// One ResourceQuota's limits on extended resources, by quota key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct QuotaLimits {
    namespace: String,
    /// `requests.<resource>` to the whole number it allows.
    hard: BTreeMap<String, u64>,
}

/// A namespace's limit on one resource, and the quota that sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    pub value: u64,
    /// The ResourceQuota's name.
    pub quota: String,
}

/// The ResourceQuotas that limit vGPU resources, by `namespace/name`.
#[derive(Debug, Default)]
pub struct QuotaBook {
    quotas: FastMap<String, QuotaLimits>,
    /// Namespaces with at least one quota on an extended resource, and how
    /// many (placement skips every other namespace with one look-up).
    namespaces: FastMap<String, usize>,
    relist: Option<FastMap<String, QuotaLimits>>,
    /// Watched: placements wait for the first complete list. Refused (no
    /// right to read quotas): none are enforced, rather than no pod placed.
    listing: Listing,
}

impl QuotaBook {
    /// The quotas are watched from now on: placements wait for their
    /// first list (or the watch's refusal).
    pub fn expect(&mut self) {
        self.listing.expect();
    }

    /// Whether placements may go ahead: the quotas are listed, not
    /// watched, or may not be read.
    pub fn ready(&self) -> bool {
        self.listing.ready()
    }

    /// The watch was refused: no quota is enforced until it is listed.
    pub fn refuse(&mut self) {
        self.listing.refuse();
    }

    /// Starts a complete list.
    pub fn begin_relist(&mut self) {
        self.relist = Some(FastMap::default());
    }

    /// Applies a ResourceQuota (from a list or the watch).
    pub fn apply(&mut self, quota: &ResourceQuota) {
        let Some((key, limits)) = read(quota) else {
            return;
        };
        if let Some(listed) = &mut self.relist {
            listed.insert(key.clone(), limits.clone());
        }
        self.put(key, limits);
    }

    /// A ResourceQuota was deleted.
    pub fn delete(&mut self, quota: &ResourceQuota) {
        if let Some(key) = quota_key(quota) {
            self.remove(&key);
        }
    }

    /// Ends a complete list: quotas it did not contain are gone.
    pub fn finish_relist(&mut self) {
        if let Some(listed) = self.relist.take() {
            let gone: Vec<String> = self
                .quotas
                .keys()
                .filter(|key| !listed.contains_key(*key))
                .cloned()
                .collect();
            for key in gone {
                self.remove(&key);
            }
        }
        if self.listing.listed() {
            tracing::info!(
                "Kubernetes API: {} namespace(s) with a quota on an extended resource",
                self.namespaces.len()
            );
        }
    }

    /// Whether any quota of `namespace` limits an extended resource.
    pub fn limits_namespace(&self, namespace: &str) -> bool {
        self.namespaces.contains_key(namespace)
    }

    /// The smallest limit `namespace`'s quotas set on `resource` (its quota
    /// key is `requests.<resource>`), if any sets one.
    pub fn limit(&self, namespace: &str, resource: &str) -> Option<Limit> {
        if !self.limits_namespace(namespace) {
            return None;
        }
        // Placement asks once or twice per node: no key is built for it.
        self.quotas
            .iter()
            .filter(|(_, limits)| limits.namespace == namespace)
            .filter_map(|(name, limits)| {
                let (_, &value) = limits
                    .hard
                    .iter()
                    .find(|(key, _)| key.strip_prefix(QUOTA_REQUESTS_PREFIX) == Some(resource))?;
                let quota = name.rsplit('/').next().unwrap_or(name).to_string();
                Some(Limit { value, quota })
            })
            .min_by(|a, b| a.value.cmp(&b.value).then_with(|| a.quota.cmp(&b.quota)))
    }

    /// The namespaces with a quota on an extended resource.
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.namespaces.keys().map(String::as_str)
    }

    fn put(&mut self, key: String, limits: QuotaLimits) {
        self.remove(&key);
        if limits.hard.is_empty() {
            return;
        }
        *self.namespaces.entry(limits.namespace.clone()).or_insert(0) += 1;
        self.quotas.insert(key, limits);
    }

    fn remove(&mut self, key: &str) {
        let Some(old) = self.quotas.remove(key) else {
            return;
        };
        if let Some(count) = self.namespaces.get_mut(&old.namespace) {
            *count -= 1;
            if *count == 0 {
                self.namespaces.remove(&old.namespace);
            }
        }
    }
}

/// `namespace/name` of a quota.
fn quota_key(quota: &ResourceQuota) -> Option<String> {
    let meta = &quota.metadata;
    Some(format!(
        "{}/{}",
        meta.namespace.as_deref()?,
        meta.name.as_deref()?
    ))
}

/// A quota's limits on extended resources (a key naming a resource with a
/// domain, `requests.example.com/thing`). A limit that is not a whole
/// number is left out, with a warning: the API server accepts `1.5` for
/// a resource whose unit is whole.
fn read(quota: &ResourceQuota) -> Option<(String, QuotaLimits)> {
    let key = quota_key(quota)?;
    let mut hard = BTreeMap::new();
    let given = quota.spec.as_ref().and_then(|spec| spec.hard.as_ref());
    for (resource, quantity) in given.into_iter().flatten() {
        if !resource.starts_with(QUOTA_REQUESTS_PREFIX) || !resource.contains('/') {
            continue;
        }
        match parse_whole_quantity(&quantity.0) {
            Ok(value) => {
                hard.insert(resource.clone(), value);
            }
            Err(error) => tracing::warn!(
                "ResourceQuota {key}: {resource}: {error}; this limit is not enforced by vgpu-scheduler"
            ),
        }
    }
    let namespace = quota.metadata.namespace.clone()?;
    Some((key, QuotaLimits { namespace, hard }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::fixtures::quota;

    #[test]
    fn the_smallest_limit_of_a_namespaces_quotas_holds() {
        let mut book = QuotaBook::default();
        book.begin_relist();
        book.apply(&quota(
            "a",
            "team",
            &[("requests.nvidia.com/gpumem", "64Ki")],
        ));
        book.apply(&quota(
            "a",
            "tight",
            &[("requests.nvidia.com/gpumem", "40000")],
        ));
        book.apply(&quota(
            "b",
            "other",
            &[("requests.nvidia.com/gpumem", "10")],
        ));
        book.finish_relist();
        assert_eq!(
            book.limit("a", "nvidia.com/gpumem"),
            Some(Limit {
                value: 40000,
                quota: "tight".into()
            })
        );
        assert_eq!(book.limit("a", "nvidia.com/gpucores"), None);
        assert_eq!(book.limit("c", "nvidia.com/gpumem"), None);
        book.delete(&quota("a", "tight", &[]));
        assert_eq!(
            book.limit("a", "nvidia.com/gpumem").map(|l| l.value),
            Some(65536)
        );
    }

    #[test]
    fn quotas_on_other_resources_limit_nothing_here() {
        let mut book = QuotaBook::default();
        book.apply(&quota("a", "cpu", &[("requests.cpu", "4"), ("pods", "10")]));
        book.apply(&quota("a", "odd", &[("requests.nvidia.com/gpumem", "1.5")]));
        assert!(!book.limits_namespace("a"));
    }

    #[test]
    fn a_relist_forgets_the_quotas_it_no_longer_holds() {
        let mut book = QuotaBook::default();
        book.apply(&quota("a", "q", &[("requests.nvidia.com/gpucores", "200")]));
        assert!(book.limits_namespace("a"));
        book.begin_relist();
        book.apply(&quota("b", "q", &[("requests.nvidia.com/gpucores", "100")]));
        book.finish_relist();
        assert!(!book.limits_namespace("a"));
        assert_eq!(book.namespaces().collect::<Vec<_>>(), vec!["b"]);
    }
}
