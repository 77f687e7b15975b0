"""Against a real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler built from Kubernetes' own modules): the chart installs,
upgrades and uninstalls with the real helm and passes the server's own
validation, and our monitor, running with a token the API server issued to
the chart's node ServiceAccount, names pods and records Events on them, and the extender, running with the
chart's arguments, certificate and ServiceAccount, syncs and serves, so a
missing RBAC rule in the chart fails here."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART = REPO / "deploy/helm/vgpu"
TARGET = Path(os.environ.get("VGPU_TARGET_DIR", REPO / "target/release")).resolve()
sys.path.insert(0, str(HERE))
from controlplane import ControlPlane, free_port, wait_for  # noqa: E402
from nodenet import TestNetwork  # noqa: E402

# The simulated-GPU sandbox the Python client tests use.
_spec = importlib.util.spec_from_file_location("python_clients", REPO / "tests/python/conftest.py")
python_clients = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(python_clients)

GIB = 1 << 30
HOLD = r"""
import sys
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
err, device = cu.cuDeviceGet(0)
err, context = cu.cuCtxCreate(0, device)
err, buffer = cu.cuMemAlloc(256 << 20)
assert err == cu.CUresult.CUDA_SUCCESS, err
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ControlPlane(tmp_path_factory.mktemp("control-plane")) as control_plane:
        yield control_plane


def objects(cluster, release: str) -> list[dict]:
    kinds = "daemonsets,deployments,services,serviceaccounts,configmaps,secrets,clusterroles,clusterrolebindings," \
            "mutatingwebhookconfigurations"
    listed = cluster.kubectl("get", kinds, "-A", "-l", f"app.kubernetes.io/instance={release}", "-o", "json")
    return json.loads(listed.stdout)["items"]


def test_the_chart_installs_upgrades_and_uninstalls_with_the_real_helm(cluster):
    cluster.helm("install", "vgpu", str(CHART), "-n", "vgpu-system", "--create-namespace")
    installed = objects(cluster, "vgpu")
    kinds = {item["kind"] for item in installed}
    assert {"DaemonSet", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "MutatingWebhookConfiguration", "ConfigMap", "Service"} <= kinds, kinds
    webhook = next(item for item in installed if item["kind"] == "MutatingWebhookConfiguration")
    assert webhook["webhooks"][0]["clientConfig"]["caBundle"], "the chart's CA reached the server"
    # The Grafana dashboard, stored whole for the sidecar to find by its label.
    dashboard = next(item for item in installed
                     if item["kind"] == "ConfigMap" and item["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["vgpu.json"]) == json.loads((CHART / "dashboards/vgpu.json").read_text())

    cluster.helm("upgrade", "vgpu", str(CHART), "-n", "vgpu-system", "--set", "scheduler.webhook.allowPrivileged=true")
    deployment = next(item for item in objects(cluster, "vgpu") if item["kind"] == "Deployment")
    extender = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if "--scheduler-name" in
                    " ".join(c.get("args", [])))
    assert "--allow-privileged-vgpu" in extender["args"]

    cluster.helm("uninstall", "vgpu", "-n", "vgpu-system")
    assert objects(cluster, "vgpu") == []


def test_a_hami_values_file_installs_unchanged_with_the_real_helm(cluster):
    """HAMi's values, given as its users keep them: helm installs the chart,
    the keys with a vgpu meaning in effect, the others named by the NOTES."""
    namespace = "hami-values"
    installed = cluster.helm("install", "hami", str(CHART), "-n", namespace, "--create-namespace",
                             "-f", str(REPO / "tests/deploy/peer-values/hami.yaml"))
    mapped, _, ignored = installed.stdout.partition("WARNING: these values")
    assert "devicePlugin.deviceSplitCount -> node.devicePlugin.splitCount: 4" in mapped, installed.stdout
    assert 'schedulerName -> scheduler.name: "hami-scheduler"' in mapped, installed.stdout
    for key in ("devicePlugin.deviceCoreScaling", "scheduler.extender.image", "mluResourceName", "devices.amd"):
        assert f"\n  {key}: " in ignored, installed.stdout
    installed_objects = objects(cluster, "hami")
    daemonset = next(item for item in installed_objects if item["kind"] == "DaemonSet")
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"gpu-pool": "shared"}
    plugin = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "device-plugin")
    assert "--split-count=4" in plugin["args"] and "--core-policy=force" in plugin["args"]
    deployment = next(item for item in installed_objects if item["kind"] == "Deployment")
    kube_scheduler = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                          if c["name"] == "kube-scheduler")
    assert kube_scheduler["image"] == "mirror.example.com/google_containers/kube-scheduler:v1.32.0"
    config = next(item for item in installed_objects
                  if item["kind"] == "ConfigMap" and item["metadata"]["name"] == "hami-vgpu-scheduler")
    assert "schedulerName: hami-scheduler" in config["data"]["config.yaml"]
    webhook = next(item for item in installed_objects if item["kind"] == "MutatingWebhookConfiguration")
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "istio-system"]} \
        in webhook["webhooks"][0]["namespaceSelector"]["matchExpressions"]
    cluster.helm("uninstall", "hami", "-n", namespace)
    assert objects(cluster, "hami") == []


def _openssl(*args: str) -> str:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, f"openssl {args}: {result.stderr}"
    return result.stdout


def test_an_upgrade_renews_the_charts_certificate_from_the_same_ca_once_it_is_due(cluster, tmp_path):
    from datetime import datetime, timezone

    namespace = "vgpu-renew"
    cluster.helm("install", "renew", str(CHART), "-n", namespace, "--create-namespace")
    name = next(item["metadata"]["name"] for item in objects(cluster, "renew")
                if item["kind"] == "Secret" and item["metadata"]["name"].endswith("-scheduler-tls"))

    def secret() -> dict:
        return json.loads(cluster.kubectl("get", "secret", name, "-n", namespace, "-o", "json").stdout)

    first = secret()
    # Not due: an upgrade keeps everything (lookup found the Secret).
    cluster.helm("upgrade", "renew", str(CHART), "-n", namespace)
    kept = secret()
    assert kept["data"] == first["data"]
    assert kept["metadata"]["annotations"] == first["metadata"]["annotations"]

    # Due (as a year later): the renewal date has passed.
    cluster.kubectl("annotate", "secret", name, "-n", namespace, "--overwrite",
                    "vgpu.io/renew-after=2026-01-01T00:00:00Z")
    cluster.helm("upgrade", "renew", str(CHART), "-n", namespace)
    renewed = secret()
    assert renewed["data"]["tls.crt"] != first["data"]["tls.crt"], "a new certificate"
    assert renewed["data"]["tls.key"] != first["data"]["tls.key"]
    assert renewed["data"]["ca.crt"] == first["data"]["ca.crt"], "from the same CA"
    assert renewed["data"]["ca.key"] == first["data"]["ca.key"]
    renew_after = datetime.fromisoformat(renewed["metadata"]["annotations"]["vgpu.io/renew-after"])
    assert (renew_after - datetime.now(timezone.utc)).days >= 274, renew_after
    for key in ("ca.crt", "tls.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(renewed["data"][key]))
    assert "OK" in _openssl("verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt"))
    # The API server's trust is unchanged: no call fails while the
    # extender moves to the new certificate.
    webhook = next(item for item in objects(cluster, "renew") if item["kind"] == "MutatingWebhookConfiguration")
    assert webhook["webhooks"][0]["clientConfig"]["caBundle"] == first["data"]["ca.crt"]
    cluster.helm("uninstall", "renew", "-n", namespace)


# cert-manager's published CRDs ship in its Go module (deploy/crds).
CERT_MANAGER_MODULE = "github.com/cert-manager/cert-manager@v1.21.2"


def cert_manager_crds() -> list[Path]:
    """cert-manager's own CRDs, from its Go module at the version pinned
    here (downloaded once into Go's module cache)."""
    done = subprocess.run(["go", "mod", "download", "-json", CERT_MANAGER_MODULE], capture_output=True, text=True,
                          timeout=600, check=False, cwd=HERE)
    assert done.returncode == 0, f"go mod download {CERT_MANAGER_MODULE}: {done.stderr}{done.stdout}"
    crds = sorted((Path(json.loads(done.stdout)["Dir"]) / "deploy/crds").glob("cert-manager.io_*.yaml"))
    assert {crd.name for crd in crds} >= {"cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml"}, crds
    return crds


def test_the_chart_asks_cert_manager_for_the_certificate_when_an_issuer_is_named(cluster, tmp_path):
    """With `certManager.issuer` the chart installs a Certificate that
    cert-manager's published schema accepts field for field, and leaves the
    webhook's CA to cert-manager's injector. cert-manager's controller is
    not run here: its binaries are Go modules of their own
    (cmd/controller, cmd/cainjector) that this machine's module proxy does
    not serve, so issuing and injecting are not exercised; the extender
    serving a Secret renewed in place is (tls.rs)."""
    for crd in cert_manager_crds():
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/certificates.cert-manager.io", "crd/issuers.cert-manager.io")
    namespace = "vgpu-cert-manager"
    cluster.kubectl("create", "namespace", namespace)
    issuer = {"apiVersion": "cert-manager.io/v1", "kind": "Issuer",
              "metadata": {"name": "vgpu-ca", "namespace": namespace}, "spec": {"selfSigned": {}}}
    cluster.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(issuer))
    cluster.helm("install", "cm", str(CHART), "-n", namespace,
                 "--set", "scheduler.webhook.certificate.certManager.issuer=vgpu-ca")
    try:
        listed = cluster.kubectl("get", "certificates", "-n", namespace, "-o", "json").stdout
        (certificate,) = json.loads(listed)["items"]
        spec = certificate["spec"]
        assert spec["issuerRef"] == {"name": "vgpu-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert (spec["duration"], spec["renewBefore"]) == ("8760h", "2160h"), "a year, renewed 90 days before"
        installed = objects(cluster, "cm")
        deployment = next(o for o in installed if o["kind"] == "Deployment")
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == spec["secretName"]
        service = next(o for o in installed if o["kind"] == "Service" and o["metadata"]["name"].endswith("-scheduler"))
        assert f"{service['metadata']['name']}.{namespace}.svc" in spec["dnsNames"]
        assert not [o for o in installed if o["kind"] == "Secret" and o["metadata"]["name"] == spec["secretName"]], \
            "cert-manager writes the Secret, not the chart"
        webhook = next(o for o in installed if o["kind"] == "MutatingWebhookConfiguration")
        assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
            f"{namespace}/{certificate['metadata']['name']}"
        assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]
        # Every field the chart wrote is one the schema knows (strict
        # validation refuses an unknown one, as the misspelled one shows).
        path = tmp_path / "certificate.json"
        path.write_text(json.dumps({"apiVersion": certificate["apiVersion"], "kind": "Certificate",
                                    "metadata": {"name": certificate["metadata"]["name"], "namespace": namespace},
                                    "spec": spec}))
        cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict", "--force-conflicts",
                        "-f", str(path))
        misspelled = dict(spec, renewBfore="720h")
        path.write_text(json.dumps({"apiVersion": certificate["apiVersion"], "kind": "Certificate",
                                    "metadata": {"name": "misspelled", "namespace": namespace}, "spec": misspelled}))
        refused = cluster.kubectl("create", "--dry-run=server", "--validate=strict", "-f", str(path), check=False)
        assert refused.returncode != 0 and "renewBfore" in refused.stderr, refused
    finally:
        cluster.helm("uninstall", "cm", "-n", namespace)


def metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def test_the_monitor_names_pods_and_records_events_as_the_charts_node_account(cluster, tmp_path):
    namespace = "vgpu-rbac"
    cluster.helm("install", "rbac", str(CHART), "-n", namespace, "--create-namespace")
    account = next(item["metadata"]["name"] for item in objects(cluster, "rbac")
                   if item["kind"] == "ServiceAccount" and item["metadata"]["name"].endswith("-node"))
    as_node_agent = cluster.token_kubeconfig(namespace, account, tmp_path / "node-agent.kubeconfig")

    # A pod on node gpu-node-1 whose decision grants 2 GiB and 30 %.
    decision = {"version": 1, "node": "gpu-node-1", "decidedUnixMs": 1, "containers": [
        {"name": "main", "init": False, "priority": 1,
         "devices": [{"uuid": "GPU-simulated", "memoryBytes": 2 * GIB, "coresPercent": 30}]}]}
    cluster.kubectl("create", "namespace", "team-d")
    # No extender runs here to answer the chart's webhook for a vGPU pod.
    cluster.kubectl("label", "namespace", "team-d", "vgpu.io/webhook=ignore")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "namespace": "team-d"},
           "spec": {"nodeName": "gpu-node-1", "containers": [{
               "name": "main", "image": "cuda",
               # What the decision grants is what it asks for: the monitor
               # restores a decision only as far as its pod asks.
               "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2048",
                                        "nvidia.com/gpucores": "30", "nvidia.com/priority": "1"}}}]}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    # The decision written as the chart's extender writes it: the chart's
    # admission policy lets no other account (the admin's included).
    as_extender = cluster.token_kubeconfig(namespace, "rbac-vgpu-scheduler", tmp_path / "extender.kubeconfig")
    cluster.kubectl("annotate", "pod", "trainer", "-n", "team-d", f"vgpu.io/decision={json.dumps(decision)}",
                    kubeconfig=as_extender)
    uid = cluster.kubectl("get", "pod", "trainer", "-n", "team-d", "-o", "jsonpath={.metadata.uid}").stdout

    # Its container's process under the shim, created with a 4 GiB cap: the
    # region says more than the decision granted.
    containers = tmp_path / "containers"
    (containers / f"{uid}_main").mkdir(parents=True)
    (tmp_path / "gpu").mkdir()
    sandbox = python_clients.Sandbox(tmp_path / "gpu")
    sandbox.env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(containers / f"{uid}_main" / "region.cache")
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "4Gi"
    holder = sandbox.spawn(HOLD)
    port = free_port()
    monitor_log = tmp_path / "monitor.log"
    monitor = None
    try:
        assert holder.stdout.readline().strip() == "ready"
        with open(monitor_log, "w") as log:
            monitor = subprocess.Popen(
                [str(TARGET / "vgpu-monitor"), f"--listen=127.0.0.1:{port}", f"--containers-dir={containers}",
                 "--no-nvml", f"--kubeconfig={as_node_agent}", "--node-name=gpu-node-1"],
                stdout=subprocess.DEVNULL, stderr=log)

        def read_log():
            return monitor_log.read_text(errors="replace")

        labels = 'namespace="team-d",pod="trainer",container="main"'
        restored = re.compile(r"^vgpu_container_limits_restored_total\{" + re.escape(labels) + r"\} ([0-9.]+)$", re.M)
        # Named through the API (list/watch pods as the node agent).
        wait_for("the monitor named the pod and restored its limits",
                 lambda: restored.search(metrics(port)), log=read_log)
        assert "vgpu_monitor_kubernetes_api_up 1" in metrics(port)

        def event():
            listed = cluster.kubectl("get", "events", "-n", "team-d", "-o", "json").stdout
            return [e for e in json.loads(listed)["items"] if e.get("reason") == "RegionLimitsChanged"]

        # Recorded as the node agent: events/create in the chart's RBAC.
        events = wait_for("the RegionLimitsChanged Event", event, log=read_log)
        assert events[0]["involvedObject"]["uid"] == uid
        assert events[0]["source"]["component"] == "vgpu-monitor"
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait(timeout=30)
        holder.stdin.close()
        holder.wait(timeout=60)
    cluster.helm("uninstall", "rbac", "-n", namespace)


class ChartExtender:
    """The extender as the installed chart runs it: its arguments, its
    serving certificate (from the Secret the chart made) and a token the API
    server issued to its ServiceAccount, started where the control plane
    runs."""

    def __init__(self, cluster, release: str, namespace: str, workdir: Path, extra: tuple[str, ...] = ()):
        self.cluster = cluster
        self.installed = objects(cluster, release)
        deployment = next(item for item in self.installed if item["kind"] == "Deployment")
        self.pod_spec = deployment["spec"]["template"]["spec"]
        self.container = next(c for c in self.pod_spec["containers"]
                              if c["command"] == ["/usr/local/bin/vgpu-scheduler"])
        secret_name = next(v["secret"]["secretName"] for v in self.pod_spec["volumes"] if v["name"] == "tls")
        secret = json.loads(cluster.kubectl("get", "secret", secret_name, "-n", namespace, "-o", "json").stdout)
        for key in ("tls.crt", "tls.key"):
            (workdir / key).write_bytes(base64.b64decode(secret["data"][key]))
        mount = next(m["mountPath"] for m in self.container["volumeMounts"] if m["name"] == "tls")
        self.ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.kubeconfig = cluster.token_kubeconfig(namespace, self.pod_spec["serviceAccountName"],
                                                   workdir / "scheduler-account.kubeconfig")
        # An `extra` flag replaces the chart's value of it.
        overridden = {flag.split("=", 1)[0] for flag in extra}
        args = [a.replace(mount, str(workdir)) for a in self.container["args"]
                if a.split("=", 1)[0] not in overridden]
        self.log_path = workdir / "extender.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(cluster.command([str(TARGET / "vgpu-scheduler"), *args, *extra,
                                                             f"--kubeconfig={self.kubeconfig}"]),
                                            stdout=subprocess.DEVNULL, stderr=log)
        # The chart's CA (the webhook's caBundle) signed the serving certificate.
        webhook = next(item for item in self.installed if item["kind"] == "MutatingWebhookConfiguration")
        self.ca = base64.b64decode(webhook["webhooks"][0]["clientConfig"]["caBundle"]).decode()

    def serve_service(self, namespace: str, address: str) -> None:
        """Points the chart's Service for the extender at `address`,
        standing in for the endpoint controllers (no kubelet runs the
        extender's pod)."""
        service = next(item for item in self.installed if item["kind"] == "Service"
                       and item["metadata"]["name"].endswith("-scheduler"))["metadata"]["name"]
        ports = [{"name": name, "port": port, "protocol": "TCP"} for name, port in self.ports.items()]
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": service, "namespace": namespace},
             "subsets": [{"addresses": [{"ip": address}], "ports": ports}]},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"{service}-test", "namespace": namespace,
                          "labels": {"kubernetes.io/service-name": service,
                                     "endpointslice.kubernetes.io/managed-by": "vgpu-tests"}},
             "addressType": "IPv4", "endpoints": [{"addresses": [address]}], "ports": ports},
        ]}))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def test_the_extender_runs_as_the_chart_runs_it(cluster, tmp_path):
    """Against the real API it lists and watches pods and nodes as its
    ServiceAccount (its RBAC), serves plain HTTP for kube-scheduler and HTTPS
    with the chart's certificate for the API server, and answers the
    admission webhook there."""
    namespace = "vgpu-extender"
    cluster.helm("install", "ext", str(CHART), "-n", namespace, "--create-namespace")
    plain, port = free_port(), free_port()
    extender = ChartExtender(cluster, "ext", namespace, tmp_path,
                             extra=(f"--port={plain}", f"--secure-port={port}", "--address=127.0.0.1"))
    context = ssl.create_default_context(cadata=extender.ca)
    context.check_hostname = False  # issued for the Service's DNS name, reached here by address

    def get(path):
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", timeout=2, context=context) as response:
                return response.status
        except OSError:
            return None

    def get_plain(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{plain}{path}", timeout=2) as response:
                return response.status
        except OSError:
            return None

    try:
        wait_for("the extender synced pods and nodes as its ServiceAccount", lambda: get("/readyz") == 200,
                 log=extender.log)
        assert get_plain("/readyz") == 200
        # The chart's certificate (a year) is on /metrics, as the extender
        # read it.
        with urllib.request.urlopen(f"http://127.0.0.1:{plain}/metrics", timeout=2) as response:
            text = response.read().decode()
        expiry = re.search(r"^vgpu_extender_certificate_expiry_timestamp_seconds (\d+)$", text, re.MULTILINE)
        assert expiry, text
        days_left = (int(expiry.group(1)) - time.time()) / 86400
        assert 364 < days_left <= 365, days_left
        assert "valid until" in extender.log(), extender.log()
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "1", "operation": "CREATE", "object": {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hami-style"},
                "spec": {"containers": [{"name": "main", "image": "cuda",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}
        request = urllib.request.Request(f"https://127.0.0.1:{port}/webhook/mutate", data=json.dumps(review).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            answer = json.loads(response.read())
        assert answer["response"]["allowed"] is True and answer["response"]["patchType"] == "JSONPatch"
    finally:
        extender.stop()
    cluster.helm("uninstall", "ext", "-n", namespace)


def gpu_node(name: str, uuid: str) -> tuple[dict, dict, dict]:
    """A Node as a kubelet with our device plugin would register it, its
    status, and the plugin's Lease: 10 vGPUs of one 80 GiB GPU, the plugin's
    inventory annotation, the share resources' totals, Ready; the Lease
    renewed now, lasting an hour."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": f"vgpu-{name}", "namespace": "kube-node-lease",
                          "labels": {"app.kubernetes.io/managed-by": "vgpu-device-plugin"}},
             "spec": {"holderIdentity": name, "leaseDurationSeconds": 3600,
                      "renewTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}}
    inventory = {"version": 1, "gpus": [
        {"uuid": uuid, "index": 0, "model": "NVIDIA H100", "memoryBytes": 80 * GIB, "smCount": 132,
         "splitCount": 10, "numa": None, "healthy": True}]}
    # With the totals of the share resources the plugin publishes (which the
    # chart's kube-scheduler counts too): memory in MiB, percentages per GPU.
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "10",
                 "nvidia.com/gpumem": str(80 * 1024), "nvidia.com/gpumem-percentage": "100",
                 "nvidia.com/gpucores": "100", "nvidia.com/priority": str(10 * (2**31 - 1)),
                 "elasticgpu.io/gpu-memory": str(80 * 1024), "elasticgpu.io/gpu-core": "100"}
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"gpu": "on"},
                         "annotations": {"vgpu.io/node-gpus": json.dumps(inventory)}}}
    status = {"status": {"capacity": resources, "allocatable": resources, "conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node",
         "lastHeartbeatTime": now, "lastTransitionTime": now}]}}
    return node, status, lease


def test_a_hami_pod_goes_through_the_webhook_kube_scheduler_and_the_extender(tmp_path):
    """Pods created through the real API server: it calls the chart's
    webhook over TLS with the chart's caBundle (a pod written for HAMi gets
    the vgpu scheduler; a privileged vGPU pod is refused with our words), and
    the real kube-scheduler, with the chart's scheduler configuration, places
    the pod through our extender, which binds it with its decision; a pod
    that fits nowhere stays Pending with the extender's reason. Everything
    runs in a network namespace whose address can be a Service endpoint
    (loopback cannot); the Service's endpoints are written here, standing in
    for the endpoint controllers (no kubelet runs the extender's pod)."""
    with TestNetwork() as network, ControlPlane(
        tmp_path / "control-plane", network=network,
        controllers="*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller,"
                    "-node-lifecycle-controller",
    ) as cluster:
        namespace = "vgpu-hook"
        # Every vGPU pod through the webhook (the API server's own admission
        # of them is compared with it below).
        cluster.helm("install", "hook", str(CHART), "-n", namespace, "--create-namespace",
                     "--set", "scheduler.webhook.failurePolicy=Fail", "--set", "scheduler.webhook.inProcess=false")
        uuid = "GPU-3b1f0c2e-8d4a-4f6b-9c7e-5a2d1e0f9b8c"
        node, status, lease = gpu_node("gpu-node-1", uuid)
        cluster.kubectl("create", "-f", "-", input=json.dumps(node))
        cluster.kubectl("create", "-f", "-", input=json.dumps(lease))
        cluster.kubectl("patch", "node", "gpu-node-1", "--subresource=status", "--type=merge", "-p", json.dumps(status))
        # The API server taints a new node not-ready; the node lifecycle
        # controller (off here: no kubelet renews a lease) would lift it.
        cluster.kubectl("patch", "node", "gpu-node-1", "--type=json", "-p",
                        json.dumps([{"op": "remove", "path": "/spec/taints"}]))
        extender = ChartExtender(cluster, "hook", namespace, tmp_path)
        extender.serve_service(namespace, network.address)
        # kube-scheduler as the chart runs it: its configuration from the
        # chart's ConfigMap, as its own ServiceAccount.
        config_map = next(item for item in extender.installed
                          if item["kind"] == "ConfigMap" and "config.yaml" in item.get("data", {}))
        config = tmp_path / "kube-scheduler.yaml"
        as_kube_scheduler = cluster.token_kubeconfig(namespace, "hook-vgpu-kube-scheduler",
                                                     tmp_path / "kube-scheduler.kubeconfig")
        config.write_text(config_map["data"]["config.yaml"]
                          + f"clientConnection:\n  kubeconfig: {as_kube_scheduler}\n")
        scheduler_log = tmp_path / "vgpu-kube-scheduler.log"
        with open(scheduler_log, "w") as log:
            scheduler = subprocess.Popen(cluster.command([
                str(cluster.bin / "kube-scheduler"), f"--config={config}", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}"]), stdout=log, stderr=subprocess.STDOUT)

        def logs():
            events = cluster.kubectl("get", "events", "-A", check=False).stdout
            nodes = cluster.kubectl("get", "nodes", "-o", "wide", check=False).stdout
            return (extender.log()[-3000:] + scheduler_log.read_text(errors="replace")[-3000:]
                    + cluster.log("kube-apiserver")[-1000:] + events[-3000:] + nodes)

        try:
            cluster.kubectl("create", "namespace", "team-e")
            hami = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hami-style", "namespace": "team-e"},
                    "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {"limits": {
                        "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}}}]}}

            def create(pod):
                done = cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod), check=False)
                return json.loads(done.stdout) if done.returncode == 0 else None

            pod = wait_for("the API server admitted the pod through the webhook", lambda: create(hami), log=logs)
            assert pod["spec"]["schedulerName"] == "vgpu-scheduler"

            privileged = json.loads(json.dumps(hami))
            privileged["metadata"]["name"] = "privileged"
            privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
            refused = cluster.kubectl("create", "-f", "-", input=json.dumps(privileged), check=False)
            assert refused.returncode != 0
            assert "asks for vGPUs and is privileged" in refused.stderr, refused.stderr

            too_big = json.loads(json.dumps(hami))
            too_big["metadata"]["name"] = "too-big"
            # Two GPUs of 50000 MiB: within the node's totals, which
            # kube-scheduler counts itself, but the node has one GPU; only the
            # extender can say so.
            too_big["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "50000"
            too_big["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "2"
            assert create(too_big) is not None

            def bound():
                found = json.loads(cluster.kubectl("get", "pod", "hami-style", "-n", "team-e", "-o", "json").stdout)
                return found if found["spec"].get("nodeName") else None

            placed = wait_for("kube-scheduler bound the pod through the extender", bound, timeout=60, log=logs)
            assert placed["spec"]["nodeName"] == "gpu-node-1"
            decision = json.loads(placed["metadata"]["annotations"]["vgpu.io/decision"])
            grant = decision["containers"][0]["devices"][0]
            assert (grant["uuid"], grant["memoryBytes"], grant["coresPercent"]) == (uuid, 4096 << 20, 30)

            def refusal():
                listed = json.loads(cluster.kubectl("get", "events", "-n", "team-e", "-o", "json").stdout)
                return [e["message"] for e in listed["items"]
                        if e["involvedObject"]["name"] == "too-big" and e.get("reason") == "FailedScheduling"]

            messages = wait_for("the unplaceable pod's FailedScheduling event", refusal, timeout=60, log=logs)
            # The extender's reason, as kube-scheduler renders it (it reads
            # reasons as format strings: a `%` in one came out garbled).
            assert any("with 50000 MiB and 30 percent compute each" in m for m in messages), messages
            assert not any("%!" in m for m in messages), messages
            pending = json.loads(cluster.kubectl("get", "pod", "too-big", "-n", "team-e", "-o", "json").stdout)
            assert pending["status"]["phase"] == "Pending" and not pending["spec"].get("nodeName")
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=30)
            extender.stop()


def admission_corpus() -> list[dict]:
    """Pods as tenants write them, one for each rule of vgpu's admission:
    vGPU containers with and without seccomp profiles (their own, their
    pod's), init containers, privileged and Unconfined ones, named
    schedulers and nodes, Elastic GPU resources, and pods naming a vGPU
    resource but no GPU, or none at all."""
    gpu = {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}}

    def pod(name, containers, init=(), **spec):
        body = {"containers": list(containers), **spec}
        if init:
            body["initContainers"] = list(init)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "tenant"}, "spec": body}

    def container(name, resources=None, **context):
        found = {"name": name, "image": "cuda"}
        if resources:
            found["resources"] = resources
        if context:
            found["securityContext"] = context
        return found

    localhost = {"type": "Localhost", "localhostProfile": "profiles/gpu.json"}
    return [
        pod("hami-style", [container("main", gpu)]),
        pod("sidecars", [container("main", gpu), container("log"), container("user", gpu, runAsUser=1000)]),
        pod("init", [container("main")], init=[container("warm", gpu)]),
        pod("pod-runtime-default", [container("main", gpu)],
            securityContext={"seccompProfile": {"type": "RuntimeDefault"}}),
        pod("pod-localhost", [container("main", gpu)], securityContext={"seccompProfile": localhost}),
        pod("own-localhost", [container("main", gpu, seccompProfile=localhost), container("other", gpu)]),
        pod("privileged", [container("main", gpu, privileged=True)]),
        pod("privileged-sidecar", [container("main", gpu), container("net", privileged=True)]),
        pod("privileged-init", [container("main", gpu)], init=[container("setup", gpu, privileged=True)]),
        pod("unconfined", [container("main", gpu, seccompProfile={"type": "Unconfined"})]),
        pod("pod-unconfined", [container("a", gpu, seccompProfile={"type": "RuntimeDefault"}), container("b", gpu)],
            securityContext={"seccompProfile": {"type": "Unconfined"}}),
        pod("unconfined-sidecar", [container("main", gpu), container("tool", seccompProfile={"type": "Unconfined"})]),
        pod("sys-admin", [container("main", gpu, capabilities={"add": ["CHOWN", "SYS_ADMIN"]})]),
        pod("baseline-capabilities", [container("main", gpu, capabilities={"add": ["NET_BIND_SERVICE"]}),
                                      container("mesh", capabilities={"add": ["NET_ADMIN", "NET_RAW"]})]),
        pod("proc-unmasked", [container("main", gpu, procMount="Unmasked")], hostUsers=False),
        pod("host-pid", [container("main", gpu)], hostPID=True),
        pod("host-ipc", [container("main", gpu)], hostIPC=True),
        pod("host-vgpu-dir", [container("main", gpu)],
            volumes=[{"name": "data", "hostPath": {"path": "/data"}},
                     {"name": "regions", "hostPath": {"path": "//usr/local/./vgpu/containers"}}]),
        pod("host-root", [container("main", gpu)], volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
        pod("host-proc", [container("main", gpu)], volumes=[{"name": "proc", "hostPath": {"path": "/proc/1"}}]),
        pod("host-data", [container("main", gpu)],
            volumes=[{"name": "data", "hostPath": {"path": "/usr/local/vgpu2"}}]),
        pod("own-scheduler", [container("main", gpu)], schedulerName="team-scheduler"),
        pod("default-scheduler", [container("main", gpu)], schedulerName="default-scheduler"),
        pod("on-a-node", [container("main", gpu)], nodeName="gpu-node-9"),
        pod("elastic", [container("main", {"limits": {"elasticgpu.io/gpu-memory": "2048",
                                                      "elasticgpu.io/gpu-core": "20"}})]),
        pod("memory-only", [container("main", {"limits": {"nvidia.com/gpumem": "4096"}})]),
        pod("no-gpu", [container("main")]),
    ]


def admitted(cluster, pod: dict) -> dict:
    """What admission made of `pod` (a server-side dry run: nothing is
    kept): the fields vgpu's admission sets, or the reason it was refused."""
    done = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod), check=False)
    if done.returncode != 0:
        # The reason as vgpu wrote it, without the API server's preamble
        # (which names the webhook or the policy that refused).
        return {"refused": re.sub(r"^.*denied (the )?request: ", "", done.stderr.strip())}
    spec = json.loads(done.stdout)["spec"]
    return {"schedulerName": spec.get("schedulerName"), "podSeccomp": spec.get("securityContext", {}),
            **{kind: [(c["name"], c.get("securityContext"), c.get("resources")) for c in spec.get(kind, [])]
               for kind in ("containers", "initContainers")}}


def mutate_calls(cluster, port: int) -> float:
    """The webhook calls the extender has answered (its /metrics on
    loopback, read where the extender runs)."""
    read = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    text = subprocess.run(cluster.command([sys.executable, "-c", read]), capture_output=True, text=True,
                          check=True).stdout
    found = re.search(r'^vgpu_extender_request_duration_seconds_count\{verb="mutate"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_api_server_admits_vgpu_pods_as_the_webhook_does_without_calling_it(tmp_path):
    """On Kubernetes 1.36 the chart has the API server admit plain vGPU
    pods itself (a MutatingAdmissionPolicy and a ValidatingAdmissionPolicy,
    templates/pod-admission.yaml). Every pod of the corpus comes out of it
    exactly as out of the extender's webhook, refusals in the same words;
    the webhook is called only for the pods that need the extender (here
    the Elastic GPU one), and for those naming no scheduler while the
    scheduler policy is not in force (as in the second after an install);
    with the extender stopped plain vGPU pods are still admitted, while
    that one is refused (failurePolicy Fail)."""
    with TestNetwork() as network, ControlPlane(
        tmp_path / "control-plane", network=network,
        controllers="*,-endpoints-controller,-endpointslice-controller,-endpointslice-mirroring-controller",
    ) as cluster:
        namespace = "vgpu-admit"
        cluster.helm("install", "admit", str(CHART), "-n", namespace, "--create-namespace",
                     "--set", "scheduler.webhook.inProcess=false")
        plain = free_port()
        extender = ChartExtender(cluster, "admit", namespace, tmp_path, extra=(f"--port={plain}",))
        corpus = admission_corpus()
        try:
            extender.serve_service(namespace, network.address)
            cluster.kubectl("create", "namespace", "tenant")
            wait_for("the tenant namespace's ServiceAccount",
                     lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", "tenant", check=False)
                     .returncode == 0)
            hami = corpus[0]
            wait_for("the webhook answering through the Service",
                     lambda: admitted(cluster, hami).get("schedulerName") == "vgpu-scheduler", log=extender.log)
            by_webhook = {pod["metadata"]["name"]: admitted(cluster, pod) for pod in corpus}
            webhook_calls = mutate_calls(cluster, plain)
            # The corpus says something: pods were mutated, refused and
            # left alone.
            assert by_webhook["sidecars"]["containers"][2][1] == {
                "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}, by_webhook["sidecars"]
            assert by_webhook["privileged"]["refused"].startswith("container main asks for vGPUs and is privileged")
            assert by_webhook["pod-unconfined"]["refused"].startswith("container b asks for vGPUs and runs seccomp "
                                                                      "Unconfined"), by_webhook["pod-unconfined"]
            for name, words in {"sys-admin": "container main asks for vGPUs and adds the capability SYS_ADMIN",
                                "proc-unmasked": "container main asks for vGPUs and mounts /proc Unmasked",
                                "host-pid": "the pod asks for vGPUs and sets hostPID",
                                "host-ipc": "the pod asks for vGPUs and sets hostIPC",
                                "host-vgpu-dir": "its volume regions mounts the node's //usr/local/./vgpu/containers, "
                                                 "which overlaps /usr/local/vgpu",
                                "host-root": "its volume root mounts the node's /, which overlaps /usr/local/vgpu",
                                "host-proc": "its volume proc mounts the node's /proc/1, which overlaps /proc"}.items():
                assert words in by_webhook[name].get("refused", ""), (name, by_webhook[name])
            for name in ("baseline-capabilities", "host-data"):
                assert by_webhook[name]["schedulerName"] == "vgpu-scheduler", (name, by_webhook[name])
            assert by_webhook["no-gpu"]["schedulerName"] == "default-scheduler"
            assert by_webhook["own-scheduler"]["schedulerName"] == "team-scheduler"
            assert by_webhook["elastic"]["containers"][0][2]["limits"]["nvidia.com/gpu"] == "1"

            upgraded = cluster.helm("upgrade", "admit", str(CHART), "-n", namespace,
                                    "--set", "scheduler.webhook.inProcess=true", check=False)
            assert upgraded.returncode == 0, upgraded.stderr
            kinds = cluster.kubectl("get", "mutatingadmissionpolicies,validatingadmissionpolicies", "-o",
                                    "jsonpath={.items[*].metadata.name}").stdout.split()
            assert {"admit-vgpu-vgpu-pods", "admit-vgpu-vgpu-confinement"} <= set(kinds), kinds

            def in_process() -> dict | None:
                # The policies and the webhook's narrower conditions are in
                # force once a vGPU pod is admitted without a webhook call.
                before = mutate_calls(cluster, plain)
                found = admitted(cluster, hami)
                webhook_called = mutate_calls(cluster, plain) != before
                return None if webhook_called or found.get("schedulerName") != "vgpu-scheduler" else found

            wait_for("the API server's own admission in force", in_process, timeout=60, log=extender.log)
            before = mutate_calls(cluster, plain)
            by_policy = {pod["metadata"]["name"]: admitted(cluster, pod) for pod in corpus}
            differ = {name: (by_webhook[name], by_policy[name]) for name in by_webhook
                      if by_webhook[name] != by_policy[name]}
            assert not differ, differ
            # Only the Elastic GPU pod reached the webhook.
            assert mutate_calls(cluster, plain) - before == 1, (before, mutate_calls(cluster, plain), webhook_calls)

            # The API server runs a policy only from its next refresh after
            # the policy and its binding are created (every second): as
            # right after an install, the scheduler policy is out of force
            # while its binding is gone. A vGPU pod naming no scheduler
            # created then goes to the webhook, not unadmitted to the
            # default scheduler (whose placement no node agent accepts).
            binding = json.loads(cluster.kubectl("get", "mutatingadmissionpolicybinding", "admit-vgpu-vgpu-pods",
                                                 "-o", "json").stdout)
            cluster.kubectl("delete", "mutatingadmissionpolicybinding", "admit-vgpu-vgpu-pods")

            def by_webhook_again() -> dict | None:
                before = mutate_calls(cluster, plain)
                found = admitted(cluster, hami)
                return found if mutate_calls(cluster, plain) != before else None

            found = wait_for("the webhook admitting a plain vGPU pod while the scheduler policy is out of force",
                             by_webhook_again, timeout=60, log=extender.log)
            assert found == by_webhook["hami-style"], found
            unnamed = [pod for pod in corpus if not {"schedulerName", "nodeName"} & set(pod["spec"])]
            differ = {pod["metadata"]["name"]: (by_webhook[pod["metadata"]["name"]], admitted(cluster, pod))
                      for pod in unnamed}
            differ = {name: pair for name, pair in differ.items() if pair[0] != pair[1]}
            assert not differ, differ
            for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
                binding["metadata"].pop(key, None)
            cluster.kubectl("create", "-f", "-", input=json.dumps(binding))
            wait_for("the API server's own admission in force again", in_process, timeout=60, log=extender.log)

            extender.stop()
            alone = {pod["metadata"]["name"]: admitted(cluster, pod) for pod in corpus}
            assert alone["hami-style"] == by_webhook["hami-style"]
            assert alone["privileged"] == by_webhook["privileged"]
            assert "failed calling webhook" in alone["elastic"]["refused"], alone["elastic"]
        finally:
            if extender.process.poll() is None:
                extender.stop()


def test_the_charts_admission_in_the_api_server_follows_its_values(cluster):
    """`helm template` offline: `inProcess: true` on a cluster without
    MutatingAdmissionPolicy fails, naming the value; `auto` there renders
    the webhook for every vGPU pod; with the API, `allowPrivileged` leaves
    only the scheduler name to set and nothing to refuse (the priority
    warning stays); with the webhook off there is no admission at all."""
    mutating = "--api-versions=admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"

    def template(*args: str) -> list[dict]:
        done = cluster.helm("template", "t", str(CHART), "--kube-version=1.36.3", *args)
        return [item for item in yaml.safe_load_all(done.stdout) if item]

    refused = cluster.helm("template", "t", str(CHART), "--kube-version=1.36.3",
                           "--set", "scheduler.webhook.inProcess=true", check=False)
    assert refused.returncode != 0 and "scheduler.webhook.inProcess=true" in refused.stderr, refused.stderr

    def kinds(items):
        return sorted(item["kind"] for item in items if "AdmissionPolicy" in item["kind"]
                      and item["metadata"]["name"].startswith("t-vgpu-vgpu-"))

    def webhook_condition(items):
        webhook = next(item for item in items if item["kind"] == "MutatingWebhookConfiguration")
        return webhook["webhooks"][0]["matchConditions"][0]["name"]

    offline = template()
    assert kinds(offline) == [] and webhook_condition(offline) == "asks-for-vgpus"
    served = template(mutating)
    # The pods' mutation, the confinement and the priority warning.
    assert kinds(served) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding",
                             "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                             "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"]
    assert webhook_condition(served) == "needs-the-extender"
    allowed = template(mutating, "--set", "scheduler.webhook.allowPrivileged=true")
    assert kinds(allowed) == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding",
                              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    # Nothing refused: what validates only warns of the priority.
    (warning,) = [item for item in allowed if item["kind"] == "ValidatingAdmissionPolicyBinding"
                  and item["metadata"]["name"].startswith("t-vgpu-vgpu-")]
    assert warning["metadata"]["name"] == "t-vgpu-vgpu-priority" and warning["spec"]["validationActions"] == ["Warn"]
    policy = next(item for item in allowed if item["kind"] == "MutatingAdmissionPolicy")
    (mutation,) = policy["spec"]["mutations"]
    assert "schedulerName" in mutation["jsonPatch"]["expression"]
    assert "seccompProfile" not in mutation["jsonPatch"]["expression"]
    assert kinds(template(mutating, "--set", "scheduler.webhook.inProcess=false")) == []
    assert kinds(template(mutating, "--set", "scheduler.webhook.enabled=false")) == []


def test_a_port_taken_before_the_api_server_binds_it_is_replaced_by_another(tmp_path, monkeypatch):
    """Between picking a free port and the server's bind, something else can
    take it: the launcher starts the server again on a fresh port instead of
    failing the test that needed a control plane."""
    import controlplane

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picks = []

        def pick() -> int:
            picks.append(None)
            # etcd asks for three ports; the API server's first is the taken one.
            return taken if len(picks) == 4 else free_port()

        monkeypatch.setattr(controlplane, "free_port", pick)
        with ControlPlane(tmp_path, api_only=True) as control_plane:
            assert control_plane.api_port != taken
            assert control_plane.server.endswith(f":{control_plane.api_port}")
            assert "address already in use" in control_plane.log("kube-apiserver")
            assert control_plane.kubectl("get", "namespaces").returncode == 0
            assert f":{control_plane.api_port}" in control_plane.admin_kubeconfig.read_text()
