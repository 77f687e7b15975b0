"""A running pod resized without a restart, on the real control plane: the
chart on a simulated node of two GPUs, `vgpu resize` as the user's verb.

One pod asks for 70 % of the GPU and 8 GiB and runs a loop of 1 ms kernels
that reports how many ran each second. Resized to 50 %, 20 %, then 4 GiB,
each step is answered by the extender (`vgpu.io/resize-status`), carried
into the container's region by the node monitor, and measured on the
simulated GPU in the same process. With another pod taking the room it gave
back (pinned to that GPU: kube-scheduler counts requests per node, so the
room freed is taken on a node with room beside it), growing again is
refused with the reason; once that pod is gone, and
after the extender is killed and restarted by kubelet, the same request is
applied and measured, and the extender counts the new grant (a pod that
would need the room is refused). A request past what the pod asks for is
refused too.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))
from shares import UncappedRun, assert_share  # noqa: E402

from chartcluster import REPO, TARGET, ChartCluster, compile_workload, kill_9, kubectl_json, wait_for  # noqa: E402

NAMESPACE = "resize"
GIB = 1 << 30
# Seconds of 1 ms kernels each share is judged over, after one second for
# the change to take effect.
WINDOW = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("resize-cluster"), nodes=1, gpus=2, memory="16Gi") as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


def loop_pod(name: str, command: list[str], cores: int, memory_mib: int, on_gpu: str | None = None) -> dict:
    annotations = {"nvidia.com/use-gpuuuid": on_gpu} if on_gpu else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                                     "command": command,
                                     "resources": {"limits": {"nvidia.com/gpu": "1",
                                                              "nvidia.com/gpumem": str(memory_mib),
                                                              "nvidia.com/gpucores": str(cores)}}}]}}


def running(cc: ChartCluster, name: str) -> dict:
    def found():
        pod = kubectl_json(cc.cluster, "get", "pod", name, "-n", NAMESPACE)
        return pod if pod["status"].get("phase") == "Running" else None
    return wait_for(f"pod {name} Running", found, timeout=90, log=cc.logs)


def resize(cc: ChartCluster, pod: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(cc.cluster.command([str(TARGET / "vgpu"), "resize", pod, "-n", NAMESPACE, *options,
                                              "--timeout", "120", "--kubeconfig",
                                              str(cc.cluster.admin_kubeconfig)]),
                          capture_output=True, text=True, timeout=180, check=False)


def region_limits(cc: ChartCluster, uid: str) -> dict:
    path = cc.nodes[0].host_root / f"usr/local/vgpu/containers/{uid}_main/region.cache"
    shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"],
                           capture_output=True, text=True, check=True)
    return json.loads(shown.stdout)["devices"][0]["limits"]


def seconds(cc: ChartCluster, pod: str) -> list[int]:
    """Kernels of 1 ms the loop ran in each whole second so far."""
    log = cc.nodes[0].container_log(NAMESPACE, pod, "main")
    return [int(line.split("kernels=")[1]) for line in log.splitlines() if line.startswith("second=")]


def measured_share(cc: ChartCluster, pod: str, workload: Path, what: str, limit: int) -> float:
    """The loop's share over the WINDOW seconds after the next one, judged
    against the same program run uncapped beside it."""
    mark = len(seconds(cc, pod))
    uncapped = UncappedRun(workload, ["sync", "k1ms", str(WINDOW + 1)], cc.nodes[0].simulated_gpu, cc.workdir)
    counts = wait_for(f"{WINDOW + 1} more seconds of {pod}'s loop",
                      lambda: (lambda s: s if len(s) >= mark + 1 + WINDOW else None)(seconds(cc, pod)),
                      timeout=60, log=cc.logs)
    share = statistics.mean(counts[mark + 1:mark + 1 + WINDOW]) / 10
    reference = 100 * uncapped.launches() / (1000 * (WINDOW + 1))
    print(f"\n{what}: {share:.1f} % of the GPU (uncapped beside it: {reference:.1f} %)")
    assert_share(what, share, limit, reference, tolerance=8)
    return share


def test_a_running_pod_is_resized_measured_refused_and_kept_across_a_restart(cluster):
    cc = cluster
    workload = compile_workload("workload", cc.workdir, source=REPO / "testkit/programs/workload.c")
    loop = ["/usr/bin/env", "WORKLOAD_EVERY_SECOND=1", str(workload), "sync", "k1ms", "600"]
    uid = cc.cluster.kubectl("create", "-f", "-", "-o", "jsonpath={.metadata.uid}",
                             input=json.dumps(loop_pod("server", loop, 70, 8192))).stdout
    server = running(cc, "server")
    (gpu,) = [grant["uuid"] for grant in json.loads(server["metadata"]["annotations"]["vgpu.io/decision"])
              ["containers"][0]["devices"]]
    wait_for("the loop reporting", lambda: seconds(cc, "server"), timeout=60, log=cc.logs)
    assert region_limits(cc, uid)["cores"] == 70

    for cores in (50, 20):
        done = resize(cc, "server", "--cores", str(cores))
        assert done.returncode == 0, done.stderr
        assert f"resized to {cores} % compute" in done.stdout, done.stdout
        wait_for(f"the region at {cores} %", lambda c=cores: region_limits(cc, uid)["cores"] == c, timeout=30,
                 log=cc.logs)
        measured_share(cc, "server", workload, f"resized to {cores} %", cores)

    done = resize(cc, "server", "--memory", "4g")
    assert done.returncode == 0, done.stderr
    wait_for("the region's cap at 4 GiB", lambda: region_limits(cc, uid)["memory"] == 4 * GIB, timeout=30,
             log=cc.logs)

    # Past what the pod asks for: refused, nothing changed.
    past = resize(cc, "server", "--cores", "90")
    assert past.returncode == 1, past
    assert "more than the pod asks for" in past.stderr, past.stderr

    # The room given back is taken; growing again is refused with why.
    cc.cluster.kubectl("create", "-f", "-", input=json.dumps(loop_pod(
        "other", ["/bin/sleep", "600"], 60, 1024, on_gpu=gpu)))
    other = running(cc, "other")
    assert json.loads(other["metadata"]["annotations"]["vgpu.io/decision"])["containers"][0]["devices"][0][
        "uuid"] == gpu
    refused = resize(cc, "server", "--cores", "70")
    assert refused.returncode == 1, refused
    assert "has 40 % of its compute free for this pod, 70 % asked" in refused.stderr, refused.stderr
    assert region_limits(cc, uid)["cores"] == 20

    def refusal_event():
        events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", "involvedObject.name=server")["items"]
        return [e for e in events if e["reason"] == "ResizeRefused" and "70 % asked" in e["message"]]
    (event,) = wait_for("the refusal as an Event on the pod", refusal_event, timeout=30, log=cc.logs)
    assert event["type"] == "Warning", event
    cc.cluster.kubectl("delete", "pod", "other", "-n", NAMESPACE, "--wait=true", "--timeout=60s")

    # The extender killed and restarted by kubelet: the decision is the
    # pod's, so nothing is lost, and the same request is then applied.
    extender = kubectl_json(cc.cluster, "get", "pods", "-A", "-l",
                            "app.kubernetes.io/component=scheduler")["items"][0]["metadata"]["name"]
    kill_9(extender, "vgpu-scheduler")
    done = resize(cc, "server", "--cores", "70")
    assert done.returncode == 0, done.stderr
    wait_for("the region at 70 %", lambda: region_limits(cc, uid)["cores"] == 70, timeout=30, log=cc.logs)
    measured_share(cc, "server", workload, "resized back to 70 %", 70)
    decision = json.loads(kubectl_json(cc.cluster, "get", "pod", "server", "-n", NAMESPACE)
                          ["metadata"]["annotations"]["vgpu.io/decision"])
    (grant,) = decision["containers"][0]["devices"]
    assert (grant["coresPercent"], grant["memoryBytes"]) == (70, 4 * GIB), grant

    # The extender counts 70 %: a pod of 40 % on that GPU does not fit.
    cc.cluster.kubectl("create", "-f", "-", input=json.dumps(loop_pod("late", ["/bin/sleep", "600"], 40, 1024,
                                                                      on_gpu=gpu)))

    def refused_for_compute():
        events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", "involvedObject.name=late")["items"]
        return [e["message"] for e in events if e["reason"] == "FailedScheduling"]
    reasons = wait_for("the late pod refused", refused_for_compute, timeout=60, log=cc.logs)
    assert kubectl_json(cc.cluster, "get", "pod", "late", "-n", NAMESPACE)["spec"].get("nodeName") is None, reasons
    cc.cluster.kubectl("delete", "pod", "server", "late", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
