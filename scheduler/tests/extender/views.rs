//! nvidia-gpu-scheduler's views, `GET /apis/nvidia-gpu-scheduler/v1/gpupods`
//! and `gpunodes`: lists, and watches that follow the extender's state.

use crate::harness::*;
use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::collections::VecDeque;
use std::time::Duration;

const VIEWS: &str = "/apis/nvidia-gpu-scheduler/v1";

/// An open watch: its response body, read event by event.
struct Watch {
    body: Incoming,
    buffer: Vec<u8>,
    events: VecDeque<Value>,
}

impl Watch {
    async fn open(h: &Harness, path: &str) -> Self {
        let stream = tokio::net::TcpStream::connect(h.running().local_addr)
            .await
            .expect("connect");
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP");
        tokio::spawn(connection);
        let request = hyper::Request::builder()
            .method("GET")
            .uri(path)
            .header("host", "localhost")
            .body(Empty::<Bytes>::new())
            .expect("request");
        let response = sender.send_request(request).await.expect("response");
        assert_eq!(response.status(), 200);
        Self {
            body: response.into_body(),
            buffer: Vec::new(),
            events: VecDeque::new(),
        }
    }

    /// The next event, `None` once the server ended the watch.
    async fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(event) = self.events.pop_front() {
                return Some(event);
            }
            let frame = tokio::time::timeout(Duration::from_secs(20), self.body.frame())
                .await
                .expect("an event within 20 s")?
                .expect("body frame");
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
                while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = self.buffer.drain(..=end).collect();
                    self.events
                        .push_back(serde_json::from_slice(&line).expect("event JSON"));
                }
            }
        }
    }

    /// Skips events until one of `kind` for the object named `name` that
    /// satisfies `check`.
    async fn until(&mut self, kind: &str, name: &str, check: impl Fn(&Value) -> bool) -> Value {
        loop {
            let event = self.next().await.expect("the watch went on");
            if event["type"] == kind && event["object"]["metadata"]["name"] == name {
                let object = event["object"].clone();
                if check(&object) {
                    return object;
                }
            }
        }
    }
}

#[tokio::test]
async fn gpu_pods_and_nodes_are_listed_and_watched() {
    let h = Harness::start(test_config()).await;
    h.add_nodes(vec![node("n1", &[gpu("NVIDIA A10", 24)])])
        .await;

    let (status, body) = h
        .client
        .get(&format!("{VIEWS}/gpunodes"))
        .await
        .expect("list");
    assert_eq!(status, 200);
    let list: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(list["apiVersion"], "nvidia-gpu-scheduler/v1");
    assert_eq!(list["kind"], "GPUNodeList");
    let node = &list["items"][0];
    assert_eq!(node["kind"], "GPUNode");
    assert_eq!(node["metadata"]["name"], "n1");
    assert!(
        node["status"]["lease"]
            .as_str()
            .is_some_and(|l| l.starts_with("live")),
        "{node}"
    );
    assert_eq!(node["status"]["gpus"][0]["model"], "NVIDIA A10");

    let mut pods = Watch::open(&h, &format!("{VIEWS}/gpupods?watch=true")).await;
    let mut nodes = Watch::open(&h, &format!("{VIEWS}/gpunodes?watch=1")).await;
    // A watch starts with what exists.
    nodes.until("ADDED", "n1", |_| true).await;

    let p = h
        .create_pod(pod("p", &[vgpu("main", 1, 2048, 30)], &[]))
        .await;
    h.schedule(&p).await.expect("scheduled");
    let added = pods.until("ADDED", "p", |_| true).await;
    assert_eq!(added["kind"], "GPUPod");
    assert_eq!(added["metadata"]["namespace"], p["metadata"]["namespace"]);
    assert_eq!(added["spec"]["nodeName"], "n1");
    let device = &added["spec"]["containers"][0]["devices"][0];
    assert_eq!(device["memoryBytes"], 2048_u64 << 20);
    assert_eq!(device["coresPercent"], 30);
    assert_eq!(
        added["status"]["admitted"], false,
        "kubelet has not taken it"
    );
    h.allocate(&p).await;
    pods.until("MODIFIED", "p", |pod| {
        pod["status"]["allocatedContainers"] == serde_json::json!(["main"])
            && pod["status"]["pending"] == false
    })
    .await;
    // The node's GPU shows what the pod takes.
    nodes
        .until("MODIFIED", "n1", |node| {
            node["status"]["gpus"][0]["usage"]["memoryBytes"] == 2048_u64 << 20
        })
        .await;
    h.delete_pod(&p).await;
    pods.until("DELETED", "p", |_| true).await;
}

#[tokio::test]
async fn watches_end_at_their_timeout_and_bad_queries_are_refused() {
    let h = Harness::start(test_config()).await;
    let mut watch = Watch::open(&h, &format!("{VIEWS}/gpupods?watch=true&timeoutSeconds=1")).await;
    let started = tokio::time::Instant::now();
    assert!(watch.next().await.is_none(), "no pods, and the watch ends");
    assert!(started.elapsed() < Duration::from_secs(10));

    for (query, words) in [
        ("watch=yes", "watch=\"yes\": use true or false"),
        ("watch=true&timeoutSeconds=soon", "timeoutSeconds=\"soon\""),
    ] {
        let (status, body) = h
            .client
            .get(&format!("{VIEWS}/gpunodes?{query}"))
            .await
            .expect("answer");
        assert_eq!(status, 400);
        let status: Value = serde_json::from_slice(&body).expect("Status JSON");
        let message = status["message"].as_str().unwrap_or_default();
        assert!(message.contains(words), "{status}");
    }
}
