"""The chart on simulated nodes made of the real kubelet's device-plugin
code, under the real control plane: `helm install` is all it takes. The
DaemonSet's pods (our plugin and monitor, with the chart's arguments,
volumes and ServiceAccount tokens) run on every node and register with the
node's kubelet code; the scheduler Deployment's pod (the real kube-scheduler
with the chart's configuration, and our extender) runs on a node and is the
webhook's Service endpoint. A pod written for HAMi then goes the whole way:
mutated by our webhook (called by the API server over TLS), placed by
kube-scheduler through our extender, allocated by our plugin through
kubelet's device-plugin client, and run under the shim, which stops it at
its memory cap; the monitor names it in /metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART = REPO / "deploy/helm/vgpu"
TARGET = Path(os.environ.get("VGPU_TARGET_DIR", REPO / "target/release")).resolve()
sys.path.insert(0, str(HERE))
from controlplane import ControlPlane, wait_for  # noqa: E402
from nodenet import TestNetwork  # noqa: E402
from simnodes import NodeImage, SimulatedNode  # noqa: E402

RELEASE_NAMESPACE = "vgpu-system"


def shim_library() -> Path:
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    return Path(named).resolve() if named else TARGET / "libvgpu.so"


def image(cluster: ControlPlane, root: Path, shared: list[Path]) -> NodeImage:
    """One root for the chart's two images (ours and kube-scheduler's) and
    the test workloads: our binaries where the Dockerfile puts them, the
    real kube-scheduler on PATH, this Python for the workloads."""
    binaries = {f"/usr/local/bin/{name}": TARGET / name
                for name in ("vgpu-device-plugin", "vgpu-monitor", "vgpu-scheduler")}
    binaries["/usr/local/lib/vgpu/libvgpu.so"] = shim_library()
    binaries["/usr/local/bin/kube-scheduler"] = cluster.bin / "kube-scheduler"
    for path in binaries.values():
        if not path.is_file():
            pytest.fail(f"{path} is missing: build the release binaries first (scripts/test does)")
    python = Path(sys.base_prefix).resolve()
    extra = [] if str(python).startswith("/usr") else [python]
    return NodeImage(root, binaries, [*shared, REPO, *extra])


def kubectl_json(cluster: ControlPlane, *args: str):
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def workload_pod(name: str, namespace: str, limits: dict[str, str], chunk_mib: int = 256) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": [{
                "name": "main", "image": "cuda:test",
                "command": [sys.executable, str(HERE / "workloads/fill.py"), str(chunk_mib)],
                "resources": {"limits": limits}}]}}


class ChartCluster:
    """A control plane, `nodes` simulated nodes and the chart installed
    with the real helm, its pods running on those nodes."""

    def __init__(self, workdir: Path, nodes: int, gpus: int = 2, memory: str = "16Gi", helm_args: tuple = ()):
        self.workdir = workdir
        self.count, self.gpus, self.memory, self.helm_args = nodes, gpus, memory, helm_args
        self.nodes: list[SimulatedNode] = []

    def __enter__(self) -> ChartCluster:
        self.network = TestNetwork().__enter__()
        try:
            self.cluster = ControlPlane(self.workdir / "control-plane", network=self.network).__enter__()
            self.network_forwarding()
            shared = [self.workdir]
            self.image = image(self.cluster, self.workdir / "image", shared)
            for index in range(1, self.count + 1):
                node = SimulatedNode(self.cluster, self.network, index, self.image, self.workdir / f"node-{index}",
                                     gpus=self.gpus, memory=self.memory, labels={"gpu": "on"},
                                     simulated_gpu=TARGET / "libsimgpu.so")
                self.nodes.append(node)
                node.start()
            # What the NVIDIA container toolkit sets up on a GPU cluster;
            # the chart's node agent runs with it.
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                "handler": "nvidia"}))
            self.cluster.helm("install", "vgpu", str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
                              "--set", "image.pullPolicy=Never", *self.helm_args)
            self.wait_until_serving()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for node in reversed(self.nodes):
            node.stop()
        if hasattr(self, "cluster"):
            self.cluster.stop()
        self.network.__exit__()

    def network_forwarding(self) -> None:
        from simnodes import enable_forwarding
        enable_forwarding(self.network)

    def logs(self) -> str:
        parts = []
        for node in self.nodes:
            parts.append(f"--- {node.name} simnode\n{node.log()[-2500:]}")
            for folder in sorted((node.workdir / "pods").glob("*")):
                for log in sorted(folder.glob("*.log")):
                    parts.append(f"--- {node.name} {folder.name}/{log.name}\n"
                                 f"{log.read_text(errors='replace')[-1500:]}")
        parts.append(self.cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout)
        parts.append(self.cluster.kubectl("get", "events", "-A", check=False).stdout[-4000:])
        return "\n".join(parts)

    def wait_until_serving(self) -> None:
        """Every node's plugin has registered and published its GPUs, and
        the webhook's Service has a ready endpoint."""
        def plugins_registered():
            nodes = kubectl_json(self.cluster, "get", "nodes")["items"]
            counts = [int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) for node in nodes]
            published = all("vgpu.io/node-gpus" in node["metadata"].get("annotations", {}) for node in nodes)
            return len(nodes) == self.count and all(counts) and published
        wait_for("every node's plugin registered with its kubelet and published its GPUs", plugins_registered,
                 timeout=120, log=self.logs)

        def endpoint_ready():
            slices = kubectl_json(self.cluster, "get", "endpointslices", "-n", RELEASE_NAMESPACE)["items"]
            return any(endpoint.get("conditions", {}).get("ready") for item in slices
                       if item["metadata"]["labels"].get("kubernetes.io/service-name", "").endswith("-scheduler")
                       for endpoint in item.get("endpoints") or [])
        wait_for("the extender's pod ready behind its Service", endpoint_ready, timeout=120, log=self.logs)

    def node(self, name: str) -> SimulatedNode:
        return next(node for node in self.nodes if node.name == name)


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("chart-cluster"), nodes=2) as running:
        yield running


def test_the_chart_runs_on_simulated_nodes(chart_cluster):
    """helm install alone brings every part up: each node's DaemonSet pod
    runs (the init container put the shim on the node's disk), the plugin
    advertises split GPUs to kubelet's code, the monitor serves metrics on
    the node's address."""
    cluster = chart_cluster.cluster
    daemonset = kubectl_json(cluster, "get", "daemonsets", "-n", RELEASE_NAMESPACE)["items"][0]
    wait_for("the node agent ready on both nodes", lambda: kubectl_json(
        cluster, "get", "daemonset", daemonset["metadata"]["name"], "-n", RELEASE_NAMESPACE
    )["status"].get("numberReady") == 2, timeout=60, log=chart_cluster.logs)
    for node in chart_cluster.nodes:
        assert (node.host_root / "usr/local/vgpu/libvgpu.so").read_bytes() == shim_library().read_bytes()
        found = kubectl_json(cluster, "get", "node", node.name)
        assert found["status"]["capacity"]["nvidia.com/gpu"] == str(chart_cluster.gpus * 10)
        inventory = json.loads(found["metadata"]["annotations"]["vgpu.io/node-gpus"])
        assert len(inventory["gpus"]) == chart_cluster.gpus
        text = wait_for(f"{node.name}'s monitor serving", lambda node=node: _metrics(node), log=chart_cluster.logs)
        assert "vgpu_gpu_memory_total_bytes" in text or "vgpu_" in text


def _metrics(node: SimulatedNode) -> str:
    try:
        return node.get(f"http://{node.address}:31992/metrics")
    except OSError:
        return ""


def test_a_hami_pod_runs_under_the_shim_at_its_cap(chart_cluster):
    cluster = chart_cluster.cluster
    cluster.kubectl("create", "namespace", "team-a")
    pod = workload_pod("hami", "team-a", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024",
                                          "nvidia.com/gpucores": "30"})
    created = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout)
    assert created["spec"]["schedulerName"] == "vgpu-scheduler", "the webhook gave the pod our scheduler"

    def running():
        found = kubectl_json(cluster, "get", "pod", "hami", "-n", "team-a")
        return found if found["status"].get("phase") in ("Running", "Succeeded", "Failed") else None
    found = wait_for("the HAMi pod running", running, timeout=90, log=chart_cluster.logs)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    node = chart_cluster.node(found["spec"]["nodeName"])
    line = wait_for("the workload's report", lambda: node.container_log("team-a", "hami", "main").strip(),
                    timeout=30, log=chart_cluster.logs)
    report = json.loads(line.splitlines()[-1])
    # 1024 MiB cap, 256 MiB chunks: the shim refuses the allocation that
    # would pass the cap with CUDA_ERROR_OUT_OF_MEMORY (2); the device
    # shows the cap as its total.
    assert report["error"] == 2, report
    assert 512 <= report["allocated_mib"] <= 1024, report
    assert report["total_mib"] == 1024, report

    def named():
        text = _metrics(node)
        lines = [line for line in text.splitlines()
                 if 'namespace="team-a"' in line and 'pod="hami"' in line and 'container="main"' in line]
        return lines
    lines = wait_for("the monitor naming the pod's container", named, timeout=30, log=chart_cluster.logs)
    assert lines

    cluster.kubectl("delete", "pod", "hami", "-n", "team-a", "--wait=true", "--timeout=60s")
