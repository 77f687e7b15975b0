"""vGPU Jobs queued by Kueue against a ClusterQueue's quota of
`nvidia.com/gpu`, `gpumem` and `gpucores`, on the real control plane: Kueue's
controller manager built from its Go module (tests/cluster/kueue/build,
pinned in its go.mod), its CRDs from the same module, the chart on a
simulated node of two GPUs.

The ClusterQueue holds two vGPUs of 4 GiB and 50 %. Three Jobs ask for one
each: Kueue admits two (it unsuspends them; their pods run, placed by the
extender, capped at 4 GiB and 50 % in their regions) and keeps the third
suspended, its Workload saying the quota is used up. Once one admitted Job
is deleted, the third is admitted and runs at its caps.

Kueue runs without its admission webhooks (they would need the API server
to reach it over TLS): the Jobs are created suspended, as its webhook would
make them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import TARGET, ChartCluster, kubectl_json, wait_for  # noqa: E402
from controlplane import free_port  # noqa: E402

NAMESPACE = "queued"
FILL = HERE / "workloads/fill.py"
GIB = 1 << 30
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Where Kueue, its certificate management off, reads its metrics server's
# certificate (a fixed path in its main.go).
METRICS_CERTS = "/etc/kueue/metrics/certs"


def kueue_build() -> Path:
    done = subprocess.run([str(HERE / "kueue/build"), "--print-dir"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"tests/cluster/kueue/build failed: {done.stderr[-2000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kueue_cluster(tmp_path_factory):
    built = kueue_build()
    workdir = tmp_path_factory.mktemp("kueue-cluster")
    with ChartCluster(workdir, nodes=1, gpus=2, memory="16Gi") as cc:
        cluster = cc.cluster
        for crd in sorted((built / "crds").glob("*.yaml")):
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
        for crd in ("clusterqueues", "localqueues", "resourceflavors", "workloads"):
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.kueue.x-k8s.io", "--timeout=60s")
        certs = workdir / "kueue-certs"
        certs.mkdir()
        # Its webhook server must start (it serves nothing here: no
        # webhook configuration points at it).
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=kueue", "-keyout", str(certs / "tls.key"), "-out", str(certs / "tls.crt")],
                       check=True, capture_output=True)
        config = workdir / "kueue-config.yaml"
        config.write_text(json.dumps({
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{free_port()}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": free_port(), "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["batch/job"]},
        }))
        log = open(workdir / "kueue.log", "w")  # noqa: SIM115 -- open while it runs
        # Without its own certificate management Kueue reads its metrics
        # server's certificate from a fixed path: the same one, mounted
        # there for its process alone (a mount namespace of its own; only
        # the empty folder is left on the machine).
        Path(METRICS_CERTS).mkdir(parents=True, exist_ok=True)
        mounted = f'mount --bind "$0" {METRICS_CERTS} && exec "$@"'
        kueue = subprocess.Popen(cluster.command([
            "unshare", "--mount", "--propagation", "private", "sh", "-c", mounted, str(certs),
            str(built / "kueue"), "--config", str(config), "--kubeconfig", str(cluster.admin_kubeconfig),
            "--feature-gates=VisibilityOnDemand=false"]), stdout=log, stderr=subprocess.STDOUT)
        cc.kueue_log = workdir / "kueue.log"
        try:
            cluster.kubectl("create", "namespace", NAMESPACE)
            yield cc
        finally:
            kueue.terminate()
            try:
                kueue.wait(10)
            except subprocess.TimeoutExpired:
                kueue.kill()
                kueue.wait()
            log.close()


def logs(cc: ChartCluster):
    return lambda: cc.logs() + "\n--- kueue ---\n" + cc.kueue_log.read_text(errors="replace")[-6000:]


def queue_objects() -> list[dict]:
    quota = [{"name": "nvidia.com/gpu", "nominalQuota": 2},
             {"name": "nvidia.com/gpumem", "nominalQuota": 8192},
             {"name": "nvidia.com/gpucores", "nominalQuota": 100}]
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "vgpu"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "vgpus"},
         "spec": {"namespaceSelector": {},
                  "resourceGroups": [{"coveredResources": [q["name"] for q in quota],
                                      "flavors": [{"name": "vgpu", "resources": quota}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": NAMESPACE}, "spec": {"clusterQueue": "vgpus"}},
    ]


def vgpu_job(name: str) -> dict:
    """A HAMi-style Job of one vGPU (4 GiB, 50 %), queued as Kueue's
    webhook leaves a Job: suspended, naming its LocalQueue."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {QUEUE_LABEL: "team"}},
            "spec": {"suspend": True, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                                "command": [sys.executable, str(FILL), "256"],
                                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096",
                                                         "nvidia.com/gpucores": "50"}}}]}}}}


def job(cc: ChartCluster, name: str) -> dict:
    return kubectl_json(cc.cluster, "get", "job", name, "-n", NAMESPACE)


def running_pod(cc: ChartCluster, job_name: str) -> dict:
    def found():
        pods = kubectl_json(cc.cluster, "get", "pods", "-n", NAMESPACE, "-l", f"job-name={job_name}")["items"]
        return next((p for p in pods if p["status"].get("phase") == "Running"), None)
    return wait_for(f"job {job_name}'s pod Running", found, timeout=120, log=logs(cc))


def capped(cc: ChartCluster, pod: dict) -> dict:
    """The pod's region limits, once the monitor's and the plugin's work is
    in: what `vgpu inspect` reads."""
    uid = pod["metadata"]["uid"]
    path = cc.nodes[0].host_root / f"usr/local/vgpu/containers/{uid}_main/region.cache"
    shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"], capture_output=True, text=True,
                           check=True)
    return json.loads(shown.stdout)["devices"][0]["limits"]


def workload(cc: ChartCluster, pod: dict) -> dict:
    name = pod["metadata"]["name"]

    def report():
        lines = cc.nodes[0].container_log(NAMESPACE, name, "main").strip().splitlines()
        return lines[-1] if lines and lines[-1].startswith("{") else None
    return json.loads(wait_for(f"{name}'s report", report, timeout=60, log=logs(cc)))


def test_kueue_admits_vgpu_jobs_by_quota_and_they_run_at_their_caps(kueue_cluster):
    cc = kueue_cluster
    for obj in queue_objects():
        cc.cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def active():
        queue = kubectl_json(cc.cluster, "get", "clusterqueues.kueue.x-k8s.io", "vgpus")
        return any(c["type"] == "Active" and c["status"] == "True"
                   for c in queue.get("status", {}).get("conditions", []))
    wait_for("Kueue running and the ClusterQueue active", active, timeout=120, log=logs(cc))

    for name in ("first", "second", "third"):
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(vgpu_job(name)))

    def two_admitted():
        suspended = {name: job(cc, name)["spec"].get("suspend") for name in ("first", "second", "third")}
        return suspended if sorted(suspended.values()) == [False, False, True] else None
    suspended = wait_for("two Jobs admitted, one held", two_admitted, timeout=120, log=logs(cc))
    (held,) = [name for name, value in suspended.items() if value]
    admitted = [name for name, value in suspended.items() if not value]

    for name in admitted:
        pod = running_pod(cc, name)
        report = workload(cc, pod)
        assert report["total_mib"] == 4096, report
        limits = capped(cc, pod)
        assert (limits["memory"], limits["cores"]) == (4 * GIB, 50), limits

    def waiting_for_quota():
        workloads = kubectl_json(cc.cluster, "get", "workloads.kueue.x-k8s.io", "-n", NAMESPACE)["items"]
        mine = [w for w in workloads if w["metadata"]["ownerReferences"][0]["name"] == held]
        conditions = mine[0].get("status", {}).get("conditions", []) if mine else []
        return [c["message"] for c in conditions if c["type"] == "QuotaReserved" and c["status"] == "False"]
    messages = wait_for(f"{held}'s Workload waiting for quota", waiting_for_quota, timeout=60, log=logs(cc))
    assert any("nvidia.com/gpu" in message for message in messages), messages
    pods = kubectl_json(cc.cluster, "get", "pods", "-n", NAMESPACE, "-l", f"job-name={held}")["items"]
    assert pods == [], "a held Job makes no pod"

    cc.cluster.kubectl("delete", "job", admitted[0], "-n", NAMESPACE, "--cascade=foreground", "--wait=true",
                       "--timeout=60s")
    wait_for(f"{held} admitted once quota is free", lambda: job(cc, held)["spec"].get("suspend") is False,
             timeout=120, log=logs(cc))
    pod = running_pod(cc, held)
    limits = capped(cc, pod)
    assert (limits["memory"], limits["cores"]) == (4 * GIB, 50), limits
    cc.cluster.kubectl("delete", "job", "--all", "-n", NAMESPACE, "--cascade=foreground", "--wait=true",
                       "--timeout=60s")
