//! Who runs above the default priority. On a GPU, an active container of
//! a more important priority pauses every less important one of other
//! pods (the node monitor's arbitration), so asking `nvidia.com/priority:
//! 0` is taking from neighbours. A pod's word is not enough: only pods of
//! a PriorityClass the cluster's administrators named (the extender's
//! `--high-priority-class`; who may use a PriorityClass is theirs to
//! govern, e.g. by ResourceQuota scopes) run above the default. Any other
//! pod runs at the default priority, told so at admission and by an Event.
//!
//! The node checks only that a decision grants no more important a
//! priority than the pod asks for ([`no_more_important`]): the extender
//! may grant less.

use super::pod_request::PodRequest;
use std::collections::BTreeSet;
use vgpu_node_contract::region::DEFAULT_PRIORITY;

/// The priority a container runs at: the one asked for or granted, else
/// the default. Smaller is more important.
pub fn effective(priority: Option<i32>) -> i32 {
    priority.unwrap_or(DEFAULT_PRIORITY)
}

/// Whether `priority` is more important than the default.
pub fn above_default(priority: Option<i32>) -> bool {
    effective(priority) < DEFAULT_PRIORITY
}

/// Whether a decision's `decided` priority is no more important than the
/// `asked` one.
pub fn no_more_important(decided: Option<i32>, asked: Option<i32>) -> bool {
    effective(decided) >= effective(asked)
}

/// The PriorityClasses whose pods may run vGPU containers above the
/// default priority.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HighPriorityClasses(BTreeSet<String>);

impl HighPriorityClasses {
    pub fn new(names: impl IntoIterator<Item = String>) -> Self {
        Self(names.into_iter().collect())
    }

    /// The priority granted to a container that asks for `asked`, in a pod
    /// of `class` (its `priorityClassName`): `asked`, unless it is above
    /// the default and the class is not one of these (then the default).
    pub fn grant(&self, asked: Option<i32>, class: Option<&str>) -> Option<i32> {
        if above_default(asked) && !class.is_some_and(|class| self.0.contains(class)) {
            None
        } else {
            asked
        }
    }

    /// Why the containers of `request` that ask to run above the default
    /// priority (`resource`: the priority's resource name) are granted the
    /// default, if any is: one line for the pod's Event, admission's
    /// warning and logs.
    pub fn lowered(&self, request: &PodRequest, resource: &str) -> Option<String> {
        let class = request.priority_class.as_deref();
        let lowered: Vec<String> = request
            .containers
            .iter()
            .filter(|c| above_default(c.priority) && self.grant(c.priority, class).is_none())
            .map(|c| format!("{} ({})", c.name, effective(c.priority)))
            .collect();
        if lowered.is_empty() {
            return None;
        }
        let allowed = if self.0.is_empty() {
            "none".to_string()
        } else {
            self.0.iter().cloned().collect::<Vec<_>>().join(", ")
        };
        let class = class.map_or_else(
            || "no PriorityClass".to_string(),
            |c| format!("PriorityClass {c}"),
        );
        Some(format!(
            "containers asking for {resource} above the default pause other pods' vGPUs on the same GPU while they run, so only pods of the PriorityClasses in scheduler.highPriorityClasses ({allowed}) may; this pod ({class}) is not one of them, so its containers {} run at the default priority",
            lowered.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_named_classes_run_above_the_default() {
        let classes = HighPriorityClasses::new(["inference".to_string()]);
        assert_eq!(classes.grant(Some(0), Some("inference")), Some(0));
        assert_eq!(classes.grant(Some(0), Some("batch")), None);
        assert_eq!(classes.grant(Some(-5), None), None);
        // At or below the default, whatever the class.
        assert_eq!(classes.grant(Some(1), None), Some(1));
        assert_eq!(classes.grant(Some(7), Some("batch")), Some(7));
        assert_eq!(classes.grant(None, None), None);
        assert_eq!(
            HighPriorityClasses::default().grant(Some(0), Some("inference")),
            None
        );
    }

    #[test]
    fn a_decision_may_grant_a_less_important_priority_never_a_more_important_one() {
        assert!(no_more_important(None, Some(0)));
        assert!(no_more_important(Some(0), Some(0)));
        assert!(no_more_important(Some(3), None));
        assert!(!no_more_important(Some(0), None));
        assert!(!no_more_important(None, Some(5)));
        assert!(!no_more_important(Some(i32::MIN), Some(1)));
    }

    #[test]
    fn the_reason_names_the_lowered_containers_the_class_and_the_allowed_ones() {
        use crate::requests::pod_request::{ContainerKind, ContainerRequest, MemoryRequest};
        let container = |name: &str, priority| ContainerRequest {
            name: name.into(),
            kind: ContainerKind::App,
            count: 1,
            memory: MemoryRequest::Whole,
            cores: 0,
            priority,
        };
        let mut request = PodRequest {
            containers: vec![
                container("main", Some(0)),
                container("low", Some(1)),
                container("plain", None),
            ],
            priority_class: Some("batch".into()),
            ..PodRequest::default()
        };
        let classes = HighPriorityClasses::new(["inference".to_string()]);
        let why = classes
            .lowered(&request, "nvidia.com/priority")
            .expect("lowered");
        assert!(
            why.contains("(inference)") && why.contains("this pod (PriorityClass batch)"),
            "{why}"
        );
        assert!(
            why.ends_with("its containers main (0) run at the default priority"),
            "{why}"
        );
        request.priority_class = Some("inference".into());
        assert_eq!(classes.lowered(&request, "nvidia.com/priority"), None);
        request.priority_class = None;
        let why = HighPriorityClasses::default()
            .lowered(&request, "p")
            .expect("lowered");
        assert!(
            why.contains("scheduler.highPriorityClasses (none)")
                && why.contains("(no PriorityClass)"),
            "{why}"
        );
    }
}
