"""HAMi's `deviceMemoryScaling` end to end, on the chart running on a
simulated node under the real control plane: the chart installed with
`node.devicePlugin.deviceMemoryScaling=2` on a node of one GPU offers twice
the card's memory; two pods each asking for the whole card's memory are
both placed on it, each gets half of it on the device and the other half as
host swap, and each writes and reads back all of the memory it can allocate;
a third such pod waits, the extender saying why.

The card is 2 GiB and stands for a 24 GiB one: every byte the pods use is
real memory of the machine running the test (the simulated GPU backs device
memory with host memory, and swap is host memory), and two pods of 24 GiB
would not fit this machine's RAM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import ChartCluster, kubectl_json, wait_for  # noqa: E402

NAMESPACE = "scaling"
FILL = HERE / "workloads/fill.py"
CARD_MIB = 2048
SCALING = 2
CHUNK_MIB = 64
# Device memory the shim charges each CUDA context against the device cap
# (the chart leaves VGPU_CONTEXT_RESERVE to the shim: at least 256 MiB).
CONTEXT_RESERVE_MIB = 256


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("scaling-cluster"), nodes=1, gpus=1, memory=f"{CARD_MIB}Mi",
                      helm_args=("--set", f"node.devicePlugin.deviceMemoryScaling={SCALING}")) as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


def whole_card_pod(name: str) -> dict:
    """A HAMi pod asking for one vGPU with the card's whole memory; its
    workload fills what it may allocate, verifies every byte, and holds
    it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "cuda", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                                     "command": [sys.executable, str(FILL), str(CHUNK_MIB), "--verify"],
                                     "resources": {"limits": {"nvidia.com/gpu": "1",
                                                              "nvidia.com/gpumem": str(CARD_MIB)}}}]}}


def pod_json(cc: ChartCluster, name: str) -> dict:
    return kubectl_json(cc.cluster, "get", "pod", name, "-n", NAMESPACE)


def running(cc: ChartCluster, name: str) -> dict:
    def found():
        pod = pod_json(cc, name)
        return pod if pod["status"].get("phase") == "Running" else None
    return wait_for(f"pod {name} Running", found, timeout=90, log=cc.logs)


def report(cc: ChartCluster, pod: dict) -> dict:
    node = cc.node(pod["spec"]["nodeName"])
    name = pod["metadata"]["name"]
    # Writing and reading 2 GiB through the simulated driver takes a while;
    # the shim's warnings come first, the workload's JSON report last.
    def last_line_report():
        lines = node.container_log(NAMESPACE, name, "cuda").strip().splitlines()
        return lines[-1] if lines and lines[-1].startswith("{") else None
    return json.loads(wait_for(f"{name}'s report", last_line_report, timeout=120, log=cc.logs))


def test_the_node_offers_twice_its_memory(chart_cluster):
    cc = chart_cluster
    node = kubectl_json(cc.cluster, "get", "node", "node-1")
    (gpu,) = json.loads(node["metadata"]["annotations"]["vgpu.io/node-gpus"])["gpus"]
    assert gpu["memoryBytes"] == CARD_MIB << 20
    assert gpu["offeredMemoryBytes"] == SCALING * CARD_MIB << 20
    # Kubelet's admission counts the offer, so it never refuses what the
    # extender placed.
    allocatable = wait_for("the share resources in the node's status", lambda: kubectl_json(
        cc.cluster, "get", "node", "node-1")["status"].get("allocatable", {}).get("nvidia.com/gpumem"),
        log=cc.logs)
    assert int(allocatable) == SCALING * CARD_MIB


def test_two_whole_card_pods_share_the_card_half_on_it_half_in_swap(chart_cluster):
    cc = chart_cluster
    names = ("whole-a", "whole-b")
    for name in names:
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(whole_card_pod(name)))
    pods = [running(cc, name) for name in names]
    uuids = set()
    for pod in pods:
        assert pod["spec"]["nodeName"] == "node-1"
        (container,) = json.loads(pod["metadata"]["annotations"]["vgpu.io/decision"])["containers"]
        (grant,) = container["devices"]
        assert grant["memoryBytes"] == CARD_MIB << 20, grant
        uuids.add(grant["uuid"])
    assert len(uuids) == 1, "both on the one card"

    chunks_on_device = (CARD_MIB // SCALING - CONTEXT_RESERVE_MIB) // CHUNK_MIB
    chunks_in_swap = (CARD_MIB - CARD_MIB // SCALING) // CHUNK_MIB
    for pod in pods:
        got = report(cc, pod)
        # The container sees its grant: 1 GiB cap + 1 GiB swap.
        assert got["total_mib"] == CARD_MIB and got["device_totals_mib"] == [CARD_MIB], got
        # Everything but the context's charge, then CUDA_ERROR_OUT_OF_MEMORY.
        assert (got["allocated_mib"], got["error"]) == (CARD_MIB - CONTEXT_RESERVE_MIB, 2), got
        assert got["host_chunks"] == chunks_in_swap, got
        assert got["allocated_mib"] == (chunks_on_device + chunks_in_swap) * CHUNK_MIB, got
        assert got["verified_mib"] == got["allocated_mib"] and got["wrong_chunks"] == 0, got

    # A third pod of the card's memory finds the offer taken: kube-scheduler
    # counts it against the node's allocatable (4096 MiB), the extender
    # against the GPU's offer; either may be the one to say so.
    cc.cluster.kubectl("create", "-f", "-", input=json.dumps(whole_card_pod("whole-c")))

    def refused():
        events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", "involvedObject.name=whole-c")["items"]
        return [e["message"] for e in events if e["reason"] == "FailedScheduling"
                and ("Insufficient nvidia.com/gpumem" in e["message"] or "MiB free" in e["message"])]
    wait_for("whole-c refused for memory", refused, timeout=60, log=cc.logs)
    assert pod_json(cc, "whole-c")["spec"].get("nodeName") is None
    cc.cluster.kubectl("delete", "pod", *names, "whole-c", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
