//! The Elastic GPU claims a pod names, looked up in the API before the
//! webhook answers: each must exist, name a class vgpu provisions (or
//! none), request a share vgpu can give, and be held by no live pod.

use crate::api::{ApiError, KubeApi};
use crate::vocabulary::claims::{claim_share, claims_held, ClaimError, ClaimShare, PROVISIONER};
use crate::vocabulary::elastic::ElasticGpuClaim;
use k8s_openapi::api::core::v1::Pod;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// What the webhook learnt of each claim a pod names: its share, `None`
/// for a claim whose class another provisioner serves (left to it), or
/// why the pod cannot have it.
pub type ClaimAnswers = BTreeMap<String, Result<Option<ClaimShare>, ClaimLookUpError>>;

/// How long the lookups may take: the webhook's own time limit is 5 s.
const LOOK_UP_PATIENCE: Duration = Duration::from_secs(3);

/// Why a pod cannot have a claim it names. (API errors are shared: one
/// answer may be read again for another container of the pod.)
#[derive(Clone, Debug, Error)]
pub enum ClaimLookUpError {
    #[error("reading ElasticGPUClaim {namespace}/{name} took over {} s; try again", LOOK_UP_PATIENCE.as_secs())]
    TooSlow { namespace: String, name: String },
    #[error("ElasticGPUClaim {name} not found in namespace {namespace}")]
    NotFound { namespace: String, name: String },
    #[error("reading ElasticGPUClaim {namespace}/{name}")]
    Read {
        namespace: String,
        name: String,
        #[source]
        source: Arc<ApiError>,
    },
    #[error("ElasticGPUClaim {name}: its class {class} does not exist")]
    NoClass { name: String, class: String },
    #[error("reading ElasticGPUClass {class}")]
    ReadClass {
        class: String,
        #[source]
        source: Arc<ApiError>,
    },
    #[error(transparent)]
    Share(#[from] ClaimError),
    #[error("listing the pods of namespace {namespace}")]
    ListPods {
        namespace: String,
        #[source]
        source: Arc<ApiError>,
    },
    #[error("ElasticGPUClaim {name} is in use by pod {namespace}/{holder}; one claim serves one pod at a time")]
    InUse {
        namespace: String,
        name: String,
        holder: String,
    },
    #[error("this extender runs without the Kubernetes API")]
    NoApi,
}

/// Looks up `claims` in `namespace` (see the module's description).
pub async fn look_up(api: &KubeApi, namespace: &str, claims: &[String]) -> ClaimAnswers {
    match tokio::time::timeout(LOOK_UP_PATIENCE, look_up_all(api, namespace, claims)).await {
        Ok(answers) => answers,
        Err(_) => claims
            .iter()
            .map(|name| {
                let why = ClaimLookUpError::TooSlow {
                    namespace: namespace.to_string(),
                    name: name.clone(),
                };
                (name.clone(), Err(why))
            })
            .collect(),
    }
}

async fn look_up_all(api: &KubeApi, namespace: &str, claims: &[String]) -> ClaimAnswers {
    let pods = api.pods_in(namespace).await.map_err(Arc::new);
    let mut answers = ClaimAnswers::new();
    for name in claims {
        let answer = match api.get_elastic_claim(namespace, name).await {
            Err(ApiError::NotFound(_)) => Err(ClaimLookUpError::NotFound {
                namespace: namespace.to_string(),
                name: name.clone(),
            }),
            Err(source) => Err(ClaimLookUpError::Read {
                namespace: namespace.to_string(),
                name: name.clone(),
                source: Arc::new(source),
            }),
            Ok(claim) => check_claim(api, namespace, name, &claim, &pods).await,
        };
        answers.insert(name.clone(), answer);
    }
    answers
}

async fn check_claim(
    api: &KubeApi,
    namespace: &str,
    name: &str,
    claim: &ElasticGpuClaim,
    pods: &Result<Vec<Pod>, Arc<ApiError>>,
) -> Result<Option<ClaimShare>, ClaimLookUpError> {
    if let Some(class) = claim.class_name() {
        let provisioner = match api.get_elastic_class(class).await {
            Ok(object) => object.provisioner().to_string(),
            Err(ApiError::NotFound(_)) => {
                return Err(ClaimLookUpError::NoClass {
                    name: name.to_string(),
                    class: class.to_string(),
                })
            }
            Err(source) => {
                return Err(ClaimLookUpError::ReadClass {
                    class: class.to_string(),
                    source: Arc::new(source),
                })
            }
        };
        if provisioner != PROVISIONER {
            tracing::debug!(
                "ElasticGPUClaim {namespace}/{name}: class {class} is provisioned by {provisioner:?}; left to it"
            );
            return Ok(None);
        }
    }
    let spec = claim.spec.read().map_err(|why| ClaimError::BadClaim {
        claim: name.to_string(),
        reason: format!("its spec does not have the published shape: {why}"),
    })?;
    let share = claim_share(name, spec)?;
    let pods = pods.as_ref().map_err(|source| ClaimLookUpError::ListPods {
        namespace: namespace.to_string(),
        source: source.clone(),
    })?;
    let holder = pods.iter().find(|pod| {
        let live = pod.metadata.deletion_timestamp.is_none()
            && !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            );
        live && claims_held(pod).contains(&name)
    });
    if let Some(holder) = holder {
        return Err(ClaimLookUpError::InUse {
            namespace: namespace.to_string(),
            name: name.to_string(),
            holder: holder.metadata.name.clone().unwrap_or_default(),
        });
    }
    Ok(Some(share))
}
