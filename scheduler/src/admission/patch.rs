//! JSON patch (RFC 6902) operations, as the admission webhook answers
//! with them.

use k8s_openapi::api::core::v1::Container;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// `name` as one token of a JSON pointer (RFC 6901).
pub fn json_pointer_token(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// JSON patch operations adding `amounts` to a container's limits and
/// requests (an extended resource's request must equal its limit);
/// `base` is the pointer to its `resources`.
pub fn resource_patch(
    container: &Container,
    base: &str,
    amounts: &BTreeMap<String, String>,
) -> Vec<Value> {
    let resources = container.resources.as_ref();
    let mut patch = Vec::new();
    if resources.is_none() {
        patch.push(json!({"op": "add", "path": base, "value": {}}));
    }
    for (field, present) in [
        (
            "limits",
            resources.and_then(|r| r.limits.as_ref()).is_some(),
        ),
        (
            "requests",
            resources.and_then(|r| r.requests.as_ref()).is_some(),
        ),
    ] {
        if present {
            for (name, value) in amounts {
                patch.push(json!({
                    "op": "add",
                    "path": format!("{base}/{field}/{}", json_pointer_token(name)),
                    "value": value,
                }));
            }
        } else {
            patch.push(json!({"op": "add", "path": format!("{base}/{field}"), "value": amounts}));
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_tokens_escape_tilde_and_slash() {
        assert_eq!(json_pointer_token("nvidia.com/gpu"), "nvidia.com~1gpu");
        assert_eq!(json_pointer_token("a~b/c"), "a~0b~1c");
    }

    #[test]
    fn amounts_go_into_limits_and_requests_whether_present_or_not() {
        let amounts = BTreeMap::from([("nvidia.com/gpu".to_string(), "1".to_string())]);
        let bare: Container = serde_json::from_value(json!({"name": "c"})).expect("container");
        assert_eq!(
            resource_patch(&bare, "/r", &amounts),
            vec![
                json!({"op": "add", "path": "/r", "value": {}}),
                json!({"op": "add", "path": "/r/limits", "value": {"nvidia.com/gpu": "1"}}),
                json!({"op": "add", "path": "/r/requests", "value": {"nvidia.com/gpu": "1"}}),
            ]
        );
        let limited: Container =
            serde_json::from_value(json!({"name": "c", "resources": {"limits": {"cpu": "1"}}}))
                .expect("container");
        assert_eq!(
            resource_patch(&limited, "/r", &amounts),
            vec![
                json!({"op": "add", "path": "/r/limits/nvidia.com~1gpu", "value": "1"}),
                json!({"op": "add", "path": "/r/requests", "value": {"nvidia.com/gpu": "1"}}),
            ]
        );
    }
}
