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
import statistics
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import (  # noqa: E402
    RELEASE_NAMESPACE,
    REPO,
    ChartCluster,
    SimulatedNode,
    compile_workload,
    kubectl_json,
    shim_library,
    wait_for,
)
from placement import count  # noqa: E402


def workload_pod(name: str, namespace: str, limits: dict[str, str], chunk_mib: int = 256) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": [{
                "name": "main", "image": "cuda:test",
                "command": [sys.executable, str(HERE / "workloads/fill.py"), str(chunk_mib)],
                "resources": {"limits": limits}}]}}


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
        # The plugin offers the share resources in the node's status (with
        # the chart's RBAC), so kube-scheduler's retry hint sees a node
        # that can hold what a vGPU pod asks for.
        gpu_mib = sum(gpu.get("offeredMemoryBytes", gpu["memoryBytes"]) >> 20 for gpu in inventory["gpus"])
        shares = wait_for(f"{node.name}'s share resources in its status", lambda node=node: {
            name: quantity for name, quantity in kubectl_json(cluster, "get", "node", node.name)
            ["status"].get("allocatable", {}).items() if name in (
                "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage")} or None,
            log=chart_cluster.logs)
        assert count(shares["nvidia.com/gpumem"]) == gpu_mib, shares
        assert count(shares["nvidia.com/gpucores"]) == 100 * chart_cluster.gpus, shares
        assert count(shares["nvidia.com/gpumem-percentage"]) == 100 * chart_cluster.gpus, shares
        text = wait_for(f"{node.name}'s monitor serving", lambda node=node: _metrics(node), log=chart_cluster.logs)
        # The monitor reports this node's own GPUs, read through its NVML.
        totals = [line for line in text.splitlines() if line.startswith("vgpu_gpu_memory_total_bytes{")]
        for gpu in inventory["gpus"]:
            assert any(gpu["uuid"] in line for line in totals), (gpu["uuid"], totals)


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


def test_a_hami_pod_is_held_at_its_compute_share(chart_cluster):
    """A pod asking for `gpucores: 30` launches 1 ms kernels back to back
    (the project's launch-pattern workload); the device time it gets, as
    the node's monitor measures it from the simulated GPU through NVML
    (not from the shim), is held near 30 % of the device."""
    cluster = chart_cluster.cluster
    workload = compile_workload("workload", chart_cluster.workdir, source=REPO / "testkit/programs/workload.c")
    cluster.kubectl("create", "namespace", "team-b")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "share", "namespace": "team-b"},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [{
               "name": "main", "image": "cuda:test", "command": [str(workload), "sync", "k1ms", "60"],
               "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024",
                                        "nvidia.com/gpucores": "30"}}}]}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    found = wait_for("the share pod running", lambda: (lambda p: p if p["status"].get("phase") == "Running" else None)(
        kubectl_json(cluster, "get", "pod", "share", "-n", "team-b")), timeout=90, log=chart_cluster.logs)
    node = chart_cluster.node(found["spec"]["nodeName"])
    wait_for("the workload ready", lambda: "ready" in node.container_log("team-b", "share", "main"),
             timeout=30, log=chart_cluster.logs)

    def figure(name: str):
        for line in _metrics(node).splitlines():
            if line.startswith(name + "{") and 'namespace="team-b"' in line and 'pod="share"' in line:
                return float(line.rsplit(" ", 1)[1])
        return None
    assert wait_for("the configured share", lambda: figure("vgpu_container_compute_share_ratio"),
                    log=chart_cluster.logs) == pytest.approx(0.30)
    # The monitor's window is one second; take readings until five full
    # windows have passed since the first, after two seconds of warm-up.
    first = wait_for("a utilization reading", lambda: figure("vgpu_container_utilization_ratio") is not None,
                     log=chart_cluster.logs)
    assert first
    started = time.monotonic()
    readings = []
    while time.monotonic() - started < 7:
        value = figure("vgpu_container_utilization_ratio")
        if time.monotonic() - started >= 2 and value is not None:
            readings.append(value)
        time.sleep(0.5)  # a sampling interval, not a wait for anything
    achieved = statistics.median(readings)
    print(f"\ngpucores 30: achieved {achieved:.3f} of the device (median of {len(readings)} monitor readings)")
    assert 0.22 <= achieved <= 0.38, readings
    cluster.kubectl("delete", "pod", "share", "-n", "team-b", "--wait=true", "--timeout=60s")

