//! HTTPS with the certificate and key given by flags.

use crate::harness::*;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use std::time::Duration;
use vgpu_scheduler::api::ApiSource;
use vgpu_scheduler::server::metrics::CERTIFICATE_EXPIRY;
use vgpu_scheduler::server::tls::{expiry_standing, ExpiryStanding, EXPIRY_WARNING};
use vgpu_scheduler::server::{tls_config, CertificateFiles, ServerError};
use vgpu_scheduler::Surface;
use vgpu_testkit::extender_client::ExtenderClient;

/// A TLS client that trusts only the CA in fixture `ca`, presenting the
/// certificate and key of fixtures `client`, if given.
fn connector(ca: &str, client: Option<(&str, &str)>) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(fixture_path(ca)).expect("CA");
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.expect("CA PEM")).expect("CA certificate");
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = rustls::pki_types::CertificateDer::pem_file_iter(fixture_path(cert))
                .expect("client certificate")
                .collect::<Result<Vec<_>, _>>()
                .expect("client certificate PEM");
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(fixture_path(key))
                .expect("client key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client certificate and key")
        }
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS client that trusts only the CA in fixture `ca`.
fn connector_trusting(ca: &str) -> tokio_rustls::TlsConnector {
    connector(ca, None)
}

/// One request over HTTPS, trusting only the test CA, as a client with
/// the certificate and key of fixtures `client` (if given); status and
/// body, or what failed (a handshake refused).
pub async fn https_as(
    addr: std::net::SocketAddr,
    client: Option<(&str, &str)>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, String), String> {
    let connector = connector("tls/ca.pem", client);
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let tls = connector
        .connect(name, stream)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| format!("HTTP over TLS: {e}"))?;
    tokio::spawn(connection);
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("response: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// One request over HTTPS, trusting only the test CA; returns status and body.
pub async fn https(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> (u16, String) {
    https_as(addr, None, method, path, body)
        .await
        .expect("an answer over HTTPS")
}

/// Some of what only kube-scheduler may call or see: verbs under each
/// prefix, `/debug/state` and a view.
const SCHEDULING_ENDPOINTS: [(&str, &str); 6] = [
    ("POST", "/filter"),
    ("POST", "/bind"),
    ("POST", "/scheduler/bind"),
    ("POST", "/apis/nvidia-gpu-scheduler/v1/schedule/bind"),
    ("GET", "/debug/state"),
    ("GET", "/apis/nvidia-gpu-scheduler/v1/gpupods"),
];

/// The test server's certificate and key.
fn test_certificate_files() -> Arc<CertificateFiles> {
    CertificateFiles::load(
        &fixture_path("tls/server.pem"),
        &fixture_path("tls/server.key"),
    )
    .expect("certificate files")
}

/// An extender on a real API server with one node, serving every route
/// on its plain port and `surface` over HTTPS with `tls` on a second one:
/// the server (stopped when dropped), the extender, the second address.
async fn with_secure_port(
    tls: Arc<rustls::ServerConfig>,
    surface: Surface,
) -> (RealServer, vgpu_scheduler::Running, std::net::SocketAddr) {
    let (server, client) = real_api_server().await;
    let api = Api::new(client);
    api.put_node(node("gpu-node-1", &[gpu("NVIDIA A10", 24)]))
        .await;
    api.put_lease("gpu-node-1", LONG_LEASE_SECONDS).await;
    let mut running = start_extender(
        &test_config(),
        &ApiSource::Kubeconfig(server.kubeconfig().to_path_buf()),
        None,
    )
    .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let secure = running
        .serve_also(listener, Some(tls), surface)
        .expect("second port");
    assert!(running.wait_ready(Duration::from_secs(20)).await);
    (server, running, secure)
}

#[tokio::test]
async fn serves_https_with_the_given_certificate() {
    let (server, client) = real_api_server().await;
    let api = Api::new(client);
    api.put_node(node("gpu-node-1", &[gpu("NVIDIA A10", 24)]))
        .await;
    api.put_node(node("gpu-node-2", &[gpu("NVIDIA A10", 24)]))
        .await;
    api.put_lease("gpu-node-1", LONG_LEASE_SECONDS).await;
    api.put_lease("gpu-node-2", LONG_LEASE_SECONDS).await;
    let tls = tls_config(
        &fixture_path("tls/server.pem"),
        &fixture_path("tls/server.key"),
    )
    .expect("TLS config");
    let running = start_extender(
        &test_config(),
        &ApiSource::Kubeconfig(server.kubeconfig().to_path_buf()),
        Some(tls),
    )
    .await;
    // Ready means both nodes and their Leases, written before, are in its
    // first lists.
    assert!(running.wait_ready(Duration::from_secs(20)).await);
    let addr = running.local_addr;

    let (status, health) = https(addr, "GET", "/healthz", Vec::new()).await;
    assert_eq!((status, health.as_str()), (200, "ok"));
    let (status, filter) = https(addr, "POST", "/filter", fixture_bytes("filter_args.json")).await;
    assert_eq!(status, 200);
    assert!(
        filter.contains(r#""NodeNames":["gpu-node-1","gpu-node-2"]"#),
        "{filter}"
    );

    // Plain HTTP to the HTTPS port gets nowhere.
    let plain = ExtenderClient::new(addr);
    assert!(plain.get("/healthz").await.is_err());
    running.stop();
}

#[tokio::test]
async fn plain_http_for_kube_scheduler_beside_https_for_webhooks() {
    let tls = tls_config(
        &fixture_path("tls/server.pem"),
        &fixture_path("tls/server.key"),
    )
    .expect("TLS config");
    let (_server, running, secure) = with_secure_port(tls, Surface::Webhooks).await;

    // The Elastic GPU Scheduler's routes over plain HTTP on the main port.
    let plain = ExtenderClient::new(running.local_addr);
    let (status, filter) = plain
        .post("/scheduler/filter", fixture_bytes("filter_args.json"))
        .await
        .expect("plain filter");
    let filter = String::from_utf8_lossy(&filter);
    assert_eq!(status, 200, "{filter}");
    assert!(filter.contains(r#""NodeNames":["gpu-node-1"]"#), "{filter}");
    // The webhook over HTTPS on the other.
    let (status, review) = https(
        secure,
        "POST",
        "/webhook/mutate",
        fixture_bytes("admission_review.json"),
    )
    .await;
    assert_eq!(status, 200, "{review}");
    assert!(review.contains(r#""allowed":true"#), "{review}");
    assert!(ExtenderClient::new(secure).get("/healthz").await.is_err());
    // The webhook port serves the API server's calls and the probes, not
    // kube-scheduler's verbs nor what the extender knows.
    let (status, health) = https(secure, "GET", "/healthz", Vec::new()).await;
    assert_eq!((status, health.as_str()), (200, "ok"));
    for (method, path) in SCHEDULING_ENDPOINTS
        .iter()
        .copied()
        .chain([("GET", "/metrics")])
    {
        let (status, _) = https(secure, method, path, fixture_bytes("bind_args.json")).await;
        assert_eq!(status, 404, "{method} {path} on the webhook port");
    }
    running.stop();
}

#[test]
fn bad_certificate_files_are_named() {
    let missing = fixture_path("tls/missing.pem");
    let error = tls_config(&missing, &fixture_path("tls/server.key")).expect_err("missing");
    assert!(matches!(error, ServerError::Certificate { .. }));
    assert!(error.to_string().contains("missing.pem"), "{error}");
    let error = tls_config(
        &fixture_path("tls/server.pem"),
        &fixture_path("tls/server.pem"),
    )
    .expect_err("no key");
    assert!(matches!(error, ServerError::Key { .. }), "{error}");
    let error = tls_config(
        &fixture_path("tls/server.key"),
        &fixture_path("tls/server.key"),
    )
    .expect_err("no cert");
    assert!(error.to_string().contains("no PEM certificate"), "{error}");
}

/// Whether a TLS handshake with `addr` succeeds for a client that trusts
/// only the CA in fixture `ca`.
async fn handshake_trusting(addr: std::net::SocketAddr, ca: &str) -> Result<(), String> {
    let connector = connector_trusting(ca);
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    connector
        .connect(name, stream)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Replaces `to` with fixture `from` in one step, as a Secret's volume
/// is updated.
fn replace_with(to: &std::path::Path, from: &str) {
    let staged = to.with_extension("new");
    std::fs::copy(fixture_path(from), &staged).expect("stage");
    std::fs::rename(&staged, to).expect("replace");
}

/// The chart's webhook certificate is renewed (by `helm upgrade` or
/// cert-manager) into the Secret the extender mounts; before, the
/// extender served the certificate it started with until restarted.
#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let dir = vgpu_testkit::unique_temp_dir("renewed-certificate");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::copy(fixture_path("tls/server.pem"), &cert).expect("cert");
    std::fs::copy(fixture_path("tls/server.key"), &key).expect("key");
    let files = CertificateFiles::load(&cert, &key).expect("certificate files");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("address");
    let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
    let config = files.server_config().expect("TLS config");
    tokio::spawn(vgpu_scheduler::server::serve(
        listener,
        router,
        Some(config),
        std::future::pending(),
    ));
    handshake_trusting(addr, "tls/ca.pem")
        .await
        .expect("the first certificate");
    assert!(handshake_trusting(addr, "tls/renewed-ca.pem")
        .await
        .is_err());

    // Caught half-written: the new certificate beside the old key.
    replace_with(&cert, "tls/renewed-server.pem");
    let error = files.reload().expect_err("a certificate without its key");
    assert!(matches!(error, ServerError::Pair { .. }), "{error}");
    handshake_trusting(addr, "tls/ca.pem")
        .await
        .expect("still the first certificate");

    // Complete: served from the next handshake after the files are read.
    replace_with(&key, "tls/renewed-server.key");
    let first_end = files.not_after_unix().expect("the first certificate's end");
    tokio::spawn(
        files
            .clone()
            .keep_reloading(Duration::from_millis(100), EXPIRY_WARNING),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while let Err(error) = handshake_trusting(addr, "tls/renewed-ca.pem").await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the renewed certificate not served after 20 s: {error}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        handshake_trusting(addr, "tls/ca.pem").await.is_err(),
        "the first certificate is no longer served"
    );
    assert!(!files.reload().expect("read again"), "nothing more changed");
    // What /metrics shows follows: `openssl x509 -enddate` of the renewed
    // fixture says Nov 3 06:08:44 2126 GMT.
    assert_ne!(files.not_after_unix(), Some(first_end));
    assert_eq!(files.not_after_unix(), Some(4_949_359_724));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A certificate made now by `openssl`, valid for `days`: its files.
fn certificate_valid_for(
    days: u32,
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ])
        .arg("-days")
        .arg(days.to_string())
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl");
    assert!(
        made.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    (cert, key)
}

fn unix_now() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock");
    i64::try_from(since.as_secs()).expect("seconds")
}

/// The served certificate's end is on the extender's `/metrics` and
/// judged against the warning's allowance; before, nothing told an
/// operator that the chart's certificate (renewed only by `helm upgrade`)
/// was about to be refused by the API server, which then fails every
/// vGPU pod's admission.
#[tokio::test]
async fn the_served_certificates_end_is_on_metrics_and_warned_about() {
    let dir = vgpu_testkit::unique_temp_dir("short-certificate");
    let (cert, key) = certificate_valid_for(3, &dir);
    let files = CertificateFiles::load(&cert, &key).expect("certificate files");
    let not_after = files.not_after_unix().expect("its end");
    let now = unix_now();
    let expected = now + 3 * 86_400;
    assert!(
        (not_after - expected).abs() <= 120,
        "ends at {not_after}, expected about {expected}"
    );
    assert_eq!(
        expiry_standing(not_after, now, EXPIRY_WARNING),
        ExpiryStanding::EndingSoon
    );
    assert_eq!(
        expiry_standing(not_after, now, Duration::from_secs(2 * 86_400)),
        ExpiryStanding::Valid
    );
    assert_eq!(
        expiry_standing(not_after, not_after, EXPIRY_WARNING),
        ExpiryStanding::Ended
    );

    let (server, client) = real_api_server().await;
    Api::new(client)
        .put_node(node("gpu-node-1", &[gpu("NVIDIA A10", 24)]))
        .await;
    let running = start_extender(
        &test_config(),
        &ApiSource::Kubeconfig(server.kubeconfig().to_path_buf()),
        None,
    )
    .await;
    let plain = ExtenderClient::new(running.local_addr);
    let (_, before) = plain.get("/metrics").await.expect("metrics");
    assert!(
        !String::from_utf8_lossy(&before).contains(CERTIFICATE_EXPIRY),
        "no certificate, no gauge"
    );
    running.report_certificate(files.clone());
    let (status, metrics) = plain.get("/metrics").await.expect("metrics");
    let metrics = String::from_utf8_lossy(&metrics);
    assert_eq!(status, 200);
    let shown: i64 = metrics
        .lines()
        .find_map(|line| {
            line.strip_prefix(&format!("{CERTIFICATE_EXPIRY} "))?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {CERTIFICATE_EXPIRY} in\n{metrics}"));
    assert_eq!(shown, not_after);
    assert!(metrics.contains(&format!("# TYPE {CERTIFICATE_EXPIRY} gauge")));
    running.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kube-scheduler elsewhere (the Elastic GPU and nvidia-gpu-scheduler
/// stanzas) reaches the verbs on the secure port with a client
/// certificate; before, it needed them served unauthenticated on the
/// pod's address (`--address 0.0.0.0`), to every pod of the cluster.
#[tokio::test]
async fn the_secure_port_serves_the_verbs_to_certified_clients_only() {
    let files = test_certificate_files();
    let config = files
        .server_config_verifying_clients(&fixture_path("tls/client-ca.pem"))
        .expect("TLS config with client CA");
    let (_server, running, secure) =
        with_secure_port(config, Surface::WebhooksAndCertifiedClients).await;

    let certified = Some(("tls/client.pem", "tls/client.key"));
    let (status, filter) = https_as(
        secure,
        certified,
        "POST",
        "/scheduler/filter",
        fixture_bytes("filter_args.json"),
    )
    .await
    .expect("answered");
    assert_eq!(status, 200, "{filter}");
    assert!(filter.contains(r#""NodeNames":["gpu-node-1"]"#), "{filter}");
    let (status, state) = https_as(secure, certified, "GET", "/debug/state", Vec::new())
        .await
        .expect("answered");
    assert_eq!(status, 200, "{state}");

    // Without a certificate: the webhooks and probes, and a refusal in
    // words for everything else.
    let (status, review) = https(
        secure,
        "POST",
        "/webhook/mutate",
        fixture_bytes("admission_review.json"),
    )
    .await;
    assert_eq!(status, 200, "{review}");
    assert_eq!(
        https(secure, "GET", "/healthz", Vec::new()).await,
        (200, "ok".to_string())
    );
    for (method, path) in SCHEDULING_ENDPOINTS {
        let (status, body) = https(secure, method, path, fixture_bytes("bind_args.json")).await;
        assert_eq!(status, 403, "{method} {path} without a certificate: {body}");
        assert!(body.contains("--client-ca"), "{body}");
    }
    // A client certificate no client CA signed: no answer at all.
    let stranger = https_as(
        secure,
        Some(("tls/stranger-client.pem", "tls/stranger-client.key")),
        "POST",
        "/filter",
        fixture_bytes("filter_args.json"),
    )
    .await;
    let refused = stranger.expect_err("a stranger's certificate is refused");
    assert!(
        !refused.starts_with("connect"),
        "refused by TLS, not unreachable: {refused}"
    );
    println!("a stranger's certificate: {refused}");
    running.stop();
}

#[test]
fn a_client_ca_file_without_a_certificate_is_named() {
    let files = test_certificate_files();
    let error = files
        .server_config_verifying_clients(&fixture_path("tls/server.key"))
        .expect_err("a key is no CA");
    assert!(matches!(error, ServerError::NoClientCa { .. }), "{error}");
    assert!(error.to_string().contains("server.key"), "{error}");
    let error = files
        .server_config_verifying_clients(&fixture_path("tls/missing.pem"))
        .expect_err("missing");
    assert!(matches!(error, ServerError::ClientCa { .. }), "{error}");
}
