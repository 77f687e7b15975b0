//! `vgpu resize`: asks for a new share or cap for a running Kubernetes pod
//! (the `vgpu.io/resize` annotation, [`vgpu_cluster::resize`]) and waits
//! for the scheduler extender's answer.

use crate::args::ResizeArgs;
use crate::cluster_api::{with_client, ConnectError};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::Api;
use std::io::Write;
use std::time::{Duration, Instant};
use thiserror::Error;
use vgpu_cluster::resize::{
    Outcome, ResizeRequest, ResizeStatus, RESIZE_ANNOTATION, RESIZE_STATUS_ANNOTATION,
};

/// How often the pod is read while the answer is awaited.
const POLL: Duration = Duration::from_millis(250);

#[derive(Debug, Error)]
pub enum ResizeError {
    #[error("give --cores, --memory or both")]
    Nothing,
    #[error("--memory must be a whole number of MiB")]
    NotWholeMib,
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("pod {0} not found")]
    NoPod(String),
    #[error("asking pod {pod} for the resize")]
    Write {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("reading pod {pod}")]
    Read {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("refused: {0}")]
    Refused(String),
    #[error("no answer within {0} s (is vgpu-scheduler running? the request stays on the pod, and is answered when it is)")]
    NoAnswer(u64),
    #[error("writing the answer")]
    Output(#[from] std::io::Error),
}

impl ResizeError {
    /// 2 for what the command line asked wrongly, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Nothing | Self::NotWholeMib => 2,
            _ => 1,
        }
    }
}

/// The annotation's text for what the command line asks, asked at
/// `asked_unix_ms` (so the same figures asked again, after a refusal, are
/// a new request).
pub fn request_text(args: &ResizeArgs, asked_unix_ms: u128) -> Result<String, ResizeError> {
    let mut parts = Vec::new();
    if let Some(cores) = args.cores {
        parts.push(format!("cores={cores}"));
    }
    if let Some(bytes) = args.memory {
        if bytes % (1 << 20) != 0 || bytes == 0 {
            return Err(ResizeError::NotWholeMib);
        }
        parts.push(format!("memory={}Mi", bytes >> 20));
    }
    if parts.is_empty() {
        return Err(ResizeError::Nothing);
    }
    parts.push(format!("asked={asked_unix_ms}"));
    Ok(parts.join(","))
}

pub fn resize(args: &ResizeArgs, out: &mut impl Write) -> Result<(), ResizeError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis());
    let text = request_text(args, now)?;
    with_client(args.kubeconfig.as_deref(), |client| async move {
        let namespace = args
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        let pods: Api<Pod> = Api::namespaced(client, &namespace);
        let key = format!("{namespace}/{}", args.pod);
        ask_and_wait(&pods, &args.pod, &key, &text, args.timeout_seconds, out).await
    })
}

async fn ask_and_wait(
    pods: &Api<Pod>,
    name: &str,
    key: &str,
    text: &str,
    timeout_seconds: u64,
    out: &mut impl Write,
) -> Result<(), ResizeError> {
    let patch = serde_json::json!({ "metadata": { "annotations": { RESIZE_ANNOTATION: text } } });
    match pods
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {
            return Err(ResizeError::NoPod(key.to_string()))
        }
        Err(source) => {
            return Err(ResizeError::Write {
                pod: key.to_string(),
                source,
            })
        }
    }
    let described = ResizeRequest::parse(text)
        .map(|request| request.describe())
        .unwrap_or_else(|_| text.to_string());
    tracing::info!(
        pod = key,
        request = text,
        "asked; waiting for vgpu-scheduler's answer"
    );
    eprintln!("vgpu: asked pod {key} for {described}; waiting for vgpu-scheduler's answer");
    let started = Instant::now();
    loop {
        let pod = pods
            .get_opt(name)
            .await
            .map_err(|source| ResizeError::Read {
                pod: key.to_string(),
                source,
            })?
            .ok_or_else(|| ResizeError::NoPod(key.to_string()))?;
        let status = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(RESIZE_STATUS_ANNOTATION))
            .and_then(|text| serde_json::from_str::<ResizeStatus>(text).ok())
            .filter(|status| status.request == text);
        if let Some(status) = status {
            return match status.outcome {
                Outcome::Applied => {
                    writeln!(out, "pod {key}: {}", status.message)?;
                    Ok(())
                }
                Outcome::Refused => Err(ResizeError::Refused(status.message)),
            };
        }
        if started.elapsed() >= Duration::from_secs(timeout_seconds) {
            return Err(ResizeError::NoAnswer(timeout_seconds));
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cores: Option<u32>, memory: Option<u64>) -> ResizeArgs {
        ResizeArgs {
            pod: "p".into(),
            namespace: None,
            cores,
            memory,
            timeout_seconds: 30,
            kubeconfig: None,
        }
    }

    #[test]
    fn the_request_is_written_as_the_extender_reads_it() {
        let text = request_text(&args(Some(20), Some(4 << 30)), 7).expect("valid");
        assert_eq!(text, "cores=20,memory=4096Mi,asked=7");
        assert_eq!(
            ResizeRequest::parse(&text),
            Ok(ResizeRequest {
                cores: Some(20),
                memory_bytes: Some(4 << 30)
            })
        );
        assert!(matches!(
            request_text(&args(None, None), 7),
            Err(ResizeError::Nothing)
        ));
        assert!(matches!(
            request_text(&args(None, Some(1000)), 7),
            Err(ResizeError::NotWholeMib)
        ));
    }
}
