//! Elastic GPU's custom resources (group `elasticgpu.io`, installed by the
//! chart) and the conversion webhook between their two served versions.
//!
//! `v1alpha1` is the published schema and the stored version. `v1alpha` is
//! the form the Elastic GPU documentation's examples use; the API server
//! sends objects between the two through `POST /convert`
//! (`apiextensions.k8s.io/v1` `ConversionReview`):
//!
//! - ElasticGPUClaim: `spec.egpuClassName` (v1alpha) is
//!   `spec.elasticGPUClassName` (v1alpha1); nothing else differs.
//! - ElasticGPUClass: `reclaimPolicy` and `egpuBindingMode` (v1alpha, top
//!   level) have no field in v1alpha1; they are kept there in the
//!   annotations [`RECLAIM_POLICY_ANNOTATION`] and
//!   [`BINDING_MODE_ANNOTATION`], so a round trip loses nothing.
//!
//! Only labels and annotations of the metadata may change in a conversion
//! (the API server refuses anything else); everything else is copied.

use crate::admission::review::{Review, WebhookReply};
use crate::bounded::{check_shape, ShapeError, ShapeLimits};
use crate::vocabulary::elastic::{
    BINDING_MODE_ANNOTATION, README_VERSION, RECLAIM_POLICY_ANNOTATION, STORED_VERSION,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// The class fields that v1alpha1 keeps in annotations.
const CLASS_FIELDS: [(&str, &str); 2] = [
    ("reclaimPolicy", RECLAIM_POLICY_ANNOTATION),
    ("egpuBindingMode", BINDING_MODE_ANNOTATION),
];

#[derive(Debug, Deserialize)]
struct ReviewRequest {
    uid: String,
    #[serde(rename = "desiredAPIVersion")]
    desired_api_version: String,
    #[serde(default)]
    objects: Vec<Value>,
}

/// Why one object could not be converted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConversionError {
    #[error("cannot convert to {0:?}: vgpu serves {STORED_VERSION} and {README_VERSION}")]
    UnknownTarget(String),
    #[error("object {name:?}: apiVersion {version:?} is not one vgpu converts")]
    UnknownSource { name: String, version: String },
    #[error("object {name:?}: kind {kind:?} has one version only")]
    UnknownKind { name: String, kind: String },
    #[error("object {name:?}: {what}")]
    Malformed { name: String, what: String },
}

/// What a `ConversionReview` may hold: it is parsed whole into
/// `serde_json::Value`s (converted field by field), at most ~640 bytes an
/// object (a map's first B-tree node) and 32 a value: 32 MB and 16 MB at
/// most. Room for about 3,000 ElasticGPUClaims of 15 objects in one list
/// conversion.
const REVIEW_SHAPE: ShapeLimits = ShapeLimits {
    objects: 50_000,
    values: 500_000,
};

/// Answers one `ConversionReview`.
pub fn convert(body: &[u8]) -> WebhookReply {
    // Bodies that are not JSON are left to the parse below, which names
    // what is wrong with them.
    if let Ok(text) = std::str::from_utf8(body) {
        match check_shape(text, REVIEW_SHAPE) {
            Ok(()) | Err(ShapeError::Json(_)) => {}
            Err(too_large) => return WebhookReply {
                status: 413,
                body:
                    json!({ "error": format!("ConversionReview too large to read: {too_large}") })
                        .to_string()
                        .into_bytes(),
            },
        }
    }
    let (api_version, request) = match Review::<ReviewRequest>::read(body, "ConversionReview") {
        Ok(read) => read,
        Err(reply) => return reply,
    };
    let converted: Result<Vec<Value>, ConversionError> = request
        .objects
        .into_iter()
        .map(|object| convert_object(object, &request.desired_api_version))
        .collect();
    let response = match converted {
        Ok(objects) => json!({
            "uid": request.uid,
            "convertedObjects": objects,
            "result": {"status": "Success"},
        }),
        Err(error) => {
            tracing::info!(error = %error, "conversion refused");
            json!({
                "uid": request.uid,
                "convertedObjects": [],
                "result": {"status": "Failure", "message": error.to_string()},
            })
        }
    };
    let body = json!({
        "apiVersion": api_version.unwrap_or_else(|| "apiextensions.k8s.io/v1".into()),
        "kind": "ConversionReview",
        "response": response,
    });
    WebhookReply {
        status: 200,
        body: body.to_string().into_bytes(),
    }
}

/// `object` in `target` (an `apiVersion`).
pub fn convert_object(mut object: Value, target: &str) -> Result<Value, ConversionError> {
    if target != STORED_VERSION && target != README_VERSION {
        return Err(ConversionError::UnknownTarget(target.to_string()));
    }
    let name = object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let source = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if source != STORED_VERSION && source != README_VERSION {
        return Err(ConversionError::UnknownSource {
            name,
            version: source,
        });
    }
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let Some(fields) = object.as_object_mut() else {
        return Err(ConversionError::Malformed {
            name,
            what: "not a JSON object".into(),
        });
    };
    fields.insert("apiVersion".into(), Value::String(target.to_string()));
    if source == target {
        return Ok(object);
    }
    let to_stored = target == STORED_VERSION;
    match kind.as_str() {
        "ElasticGPUClaim" => {
            let (from, to) = if to_stored {
                ("egpuClassName", "elasticGPUClassName")
            } else {
                ("elasticGPUClassName", "egpuClassName")
            };
            if let Some(spec) = fields.get_mut("spec").and_then(Value::as_object_mut) {
                if let Some(class) = spec.remove(from) {
                    spec.insert(to.into(), class);
                }
            }
        }
        "ElasticGPUClass" => {
            if to_stored {
                for (field, annotation) in CLASS_FIELDS {
                    if let Some(value) = fields.remove(field) {
                        let text = match value {
                            Value::String(text) => text,
                            other => other.to_string(),
                        };
                        annotations(fields, &name)?.insert(annotation.into(), Value::String(text));
                    }
                }
            } else {
                for (field, annotation) in CLASS_FIELDS {
                    let kept = annotations(fields, &name)?.remove(annotation);
                    if let Some(value) = kept {
                        fields.insert(field.into(), value);
                    }
                }
                drop_empty_annotations(fields);
            }
        }
        _ => return Err(ConversionError::UnknownKind { name, kind }),
    }
    Ok(object)
}

/// The object's annotations, made when absent.
fn annotations<'a>(
    fields: &'a mut Map<String, Value>,
    name: &str,
) -> Result<&'a mut Map<String, Value>, ConversionError> {
    let malformed = |what: &str| ConversionError::Malformed {
        name: name.to_string(),
        what: what.to_string(),
    };
    let metadata = fields
        .entry("metadata")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| malformed("metadata is not an object"))?;
    let annotations = metadata.entry("annotations").or_insert_with(|| json!({}));
    if annotations.is_null() {
        *annotations = json!({});
    }
    annotations
        .as_object_mut()
        .ok_or_else(|| malformed("metadata.annotations is not an object"))
}

fn drop_empty_annotations(fields: &mut Map<String, Value>) {
    if let Some(metadata) = fields.get_mut("metadata").and_then(Value::as_object_mut) {
        if metadata
            .get("annotations")
            .and_then(Value::as_object)
            .is_some_and(Map::is_empty)
        {
            metadata.remove("annotations");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(objects: Value, target: &str) -> Vec<u8> {
        json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "ConversionReview",
            "request": {"uid": "u-1", "desiredAPIVersion": target, "objects": objects},
        })
        .to_string()
        .into_bytes()
    }

    fn answer(body: &[u8]) -> Value {
        let reply = convert(body);
        assert_eq!(reply.status, 200);
        serde_json::from_slice(&reply.body).expect("json")
    }

    #[test]
    fn the_readme_claim_and_class_round_trip() {
        let claim = json!({
            "apiVersion": README_VERSION, "kind": "ElasticGPUClaim",
            "metadata": {"name": "gpushare-egpuc-1", "namespace": "default", "uid": "x", "labels": {"a": "b"}},
            "spec": {"egpuClassName": "gpushare-egpuclass", "resources": {"requests": {
                "gpushare.provisioner.elasticgpu.io/gpu-core": 10,
                "gpushare.provisioner.elasticgpu.io/gpu-memory": 4}}},
        });
        let class = json!({
            "apiVersion": README_VERSION, "kind": "ElasticGPUClass",
            "metadata": {"name": "gpushare-egpuclass"},
            "provisioner": "gpushare.provisioner.elasticgpu.io",
            "reclaimPolicy": "Retain", "egpuBindingMode": "Immediate",
        });
        let stored = answer(&review(json!([claim, class]), STORED_VERSION));
        assert_eq!(stored["response"]["uid"], "u-1");
        assert_eq!(stored["response"]["result"]["status"], "Success");
        let [claim1, class1] = [0, 1].map(|i| stored["response"]["convertedObjects"][i].clone());
        assert_eq!(claim1["apiVersion"], STORED_VERSION);
        assert_eq!(claim1["spec"]["elasticGPUClassName"], "gpushare-egpuclass");
        assert!(claim1["spec"].get("egpuClassName").is_none());
        assert_eq!(claim1["metadata"], claim["metadata"], "metadata untouched");
        assert_eq!(
            class1["metadata"]["annotations"][RECLAIM_POLICY_ANNOTATION],
            "Retain"
        );
        assert_eq!(
            class1["metadata"]["annotations"][BINDING_MODE_ANNOTATION],
            "Immediate"
        );
        assert!(class1.get("reclaimPolicy").is_none());

        let back = answer(&review(json!([claim1, class1]), README_VERSION));
        let objects = &back["response"]["convertedObjects"];
        assert_eq!(objects[0], claim);
        assert_eq!(objects[1], class, "nothing lost, nothing added");
    }

    #[test]
    fn same_version_and_stored_only_objects_pass() {
        let class = json!({
            "apiVersion": STORED_VERSION, "kind": "ElasticGPUClass",
            "metadata": {"name": "c", "annotations": {"team": "x"}}, "provisioner": "p",
        });
        let same = convert_object(class.clone(), STORED_VERSION).expect("same");
        assert_eq!(same, class);
        // A class written in v1alpha1 reads in v1alpha without policies.
        let readme = convert_object(class, README_VERSION).expect("readme");
        assert_eq!(readme["metadata"]["annotations"], json!({"team": "x"}));
        assert!(readme.get("reclaimPolicy").is_none());
    }

    #[test]
    fn what_cannot_be_converted_is_refused_in_words() {
        let gpu = json!({"apiVersion": STORED_VERSION, "kind": "GPU", "metadata": {"name": "g"}});
        let failed = answer(&review(json!([gpu]), README_VERSION));
        assert_eq!(failed["response"]["result"]["status"], "Failure");
        let message = failed["response"]["result"]["message"]
            .as_str()
            .expect("message");
        assert!(
            message.contains("kind \"GPU\" has one version only"),
            "{message}"
        );
        assert_eq!(
            convert_object(json!({"apiVersion": "v1", "kind": "Pod"}), STORED_VERSION),
            Err(ConversionError::UnknownSource {
                name: String::new(),
                version: "v1".into()
            })
        );
        assert!(matches!(
            convert_object(json!({}), "elasticgpu.io/v2"),
            Err(ConversionError::UnknownTarget(_))
        ));
        for (body, words) in [
            (&b"["[..], "not a ConversionReview"),
            (
                br#"{"kind":"AdmissionReview"}"#,
                "expected kind ConversionReview",
            ),
            (br#"{"kind":"ConversionReview"}"#, "no request"),
        ] {
            let reply = convert(body);
            assert_eq!(reply.status, 400);
            assert!(String::from_utf8_lossy(&reply.body).contains(words));
        }
    }

    #[test]
    fn a_review_of_too_many_objects_is_refused_unparsed() {
        // 50,001 empty objects: 150 kB that would be 32 MB of maps.
        let objects = vec!["{}"; 50_001].join(",");
        let body = format!(
            r#"{{"kind":"ConversionReview","request":{{"uid":"u","desiredAPIVersion":"{STORED_VERSION}","objects":[{objects}]}}}}"#
        );
        let reply = convert(body.as_bytes());
        assert_eq!(reply.status, 413);
        let words = String::from_utf8_lossy(&reply.body).into_owned();
        assert!(words.contains("more than 50000 JSON objects"), "{words}");
    }
}
