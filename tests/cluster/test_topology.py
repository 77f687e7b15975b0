"""GPU topology from NVML to placement, on the chart under the real control
plane: one simulated node of four GPUs whose NVLink islands are {0, 2} and
{1, 3} and whose NUMA nodes are {0, 1} and {2, 3} (SIMGPU_NVLINK,
SIMGPU_NUMA). The device plugin reads them through NVML and publishes the
islands in the node inventory; a container asking for two GPUs gets two of
one island from the extender (which would otherwise take GPUs 0 and 1, the
first two by the policy), and its workload sees them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import ChartCluster, kubectl_json, wait_for  # noqa: E402

NAMESPACE = "topology"
FILL = HERE / "workloads/fill.py"


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("topology-cluster"), nodes=1, gpus=4, memory="8Gi",
                      gpu_env={"SIMGPU_NVLINK": "0,2;1,3", "SIMGPU_NUMA": "0,0,1,1"}) as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


def inventory(cc: ChartCluster) -> list[dict]:
    node = kubectl_json(cc.cluster, "get", "node", "node-1")
    return json.loads(node["metadata"]["annotations"]["vgpu.io/node-gpus"])["gpus"]


def test_the_inventory_carries_the_islands_and_numa_nodes_nvml_reports(chart_cluster):
    gpus = sorted(inventory(chart_cluster), key=lambda gpu: gpu["index"])
    assert [gpu.get("nvlinkIsland") for gpu in gpus] == [0, 1, 0, 1], gpus
    assert [gpu["numa"] for gpu in gpus] == [0, 0, 1, 1], gpus


def test_a_two_gpu_container_gets_one_nvlink_island(chart_cluster):
    cc = chart_cluster
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pair", "namespace": NAMESPACE},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": "cuda",
                                    "command": [sys.executable, str(FILL), "256"],
                                    "resources": {"limits": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1024"}}}]}}
    cc.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))

    def running():
        found = kubectl_json(cc.cluster, "get", "pod", "pair", "-n", NAMESPACE)
        return found if found["status"].get("phase") == "Running" else None
    found = wait_for("the two-GPU pod running", running, timeout=90, log=cc.logs)
    (container,) = json.loads(found["metadata"]["annotations"]["vgpu.io/decision"])["containers"]
    island_of = {gpu["uuid"]: gpu.get("nvlinkIsland") for gpu in inventory(cc)}
    islands = {island_of[device["uuid"]] for device in container["devices"]}
    assert len(container["devices"]) == 2 and len(islands) == 1, (container, island_of)
    node = cc.node("node-1")
    line = wait_for("the workload's report", lambda: (lines := node.container_log(NAMESPACE, "pair", "main")
                                                        .strip().splitlines()) and lines[-1].startswith("{")
                    and lines[-1], timeout=60, log=cc.logs)
    assert len(json.loads(line)["device_totals_mib"]) == 2, line
    cc.cluster.kubectl("delete", "pod", "pair", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
