"""KubeShare 2.0's and nvidia-gpu-scheduler's pod specs, unchanged but for
image names and the workload's command, on the chart running on simulated
nodes under the real control plane (kube-apiserver, kube-scheduler, helm).
The cluster has two models: node-1's GPUs are GeForce GTX 1080s, node-2's
Tesla V100s, two of 16 GiB each.

- KubeShare's seed pod (labels only, `schedulerName: kubeshare-scheduler`)
  runs on its model at half a GPU; its seed Job's five pods run.
- nvidia-gpu-scheduler's `gpu.model` annotation takes a pod to its model;
  a model no node has leaves it Pending, the event saying why; a second
  kube-scheduler configured with that project's extender stanza (v1 format,
  bind verb added) places such a pod through our extender.
- An opportunistic pod (KubeShare priority 0) is evicted by the real
  kube-scheduler's preemption, through our preempt verb, to place a
  guaranteed one; the other opportunistic pod is left alone.
- A group of 5 with threshold 0.6 where only 2 fit: none is bound, each
  pod's events say why; where 3 fit: three are bound, two wait.
- Bad labels are refused at creation with the label named.
- A restarted device plugin checks its allocation records against
  kubelet's PodResources API (served by kubelet's own code on the
  simulated node) and names the container whose record is missing.
- Node health by the device plugins' Leases: with the plugins unable to
  renew (their RoleBinding in kube-node-lease deleted), a pod is still
  placed before the Leases run out; after their duration and the grace
  none is, its events saying so; once the plugins renew again, pods are
  placed again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import (  # noqa: E402
    EXTENDER_PORT,
    RELEASE_NAMESPACE,
    ChartCluster,
    extender_address,
    extra_kube_scheduler,
    kill_9,
    kubectl_json,
    wait_for,
)

NAMESPACE = "kubeshare"
FILL = HERE / "workloads/fill.py"
GTX = "NVIDIA GeForce GTX 1080"
V100 = "Tesla V100-SXM2-16GB"
GPU_MIB = 16384
# Device memory the shim charges each CUDA context (VGPU_CONTEXT_RESERVE).
CONTEXT_RESERVE_MIB = 256
# The plugins' Leases last 8 s (renewed every 2 s); the extender allows 2 s
# more: short, for the Lease test, and long enough for a loaded machine.
LEASE_SECONDS, LEASE_GRACE_SECONDS = 8, 2


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("kubeshare-cluster"), nodes=2, gpu_names=(GTX, V100),
                      helm_args=("--set", f"node.devicePlugin.leaseDurationSeconds={LEASE_SECONDS}",
                                 "--set", f"scheduler.extender.nodeLeaseGraceSeconds={LEASE_GRACE_SECONDS}",
                                 # nvidia-gpu-scheduler's kube-scheduler runs
                                 # outside the extender's pod.
                                 "--set", "scheduler.extender.exposeVerbs=true"),
                      ) as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


def create(cc: ChartCluster, manifest: dict, check: bool = True):
    return cc.cluster.kubectl("create", "-f", "-", input=json.dumps(manifest), check=check)


def kubeshare_pod(name: str, labels: dict[str, str], command: list[str] | None = None) -> dict:
    """KubeShare's seed pod spec, with our workload as its command."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"schedulerName": "kubeshare-scheduler", "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "pytorch", "image": "riyazhu/mnist:test",
                                     "command": command or [sys.executable, str(FILL), "256"],
                                     "imagePullPolicy": "IfNotPresent"}]}}


def pod_json(cc: ChartCluster, name: str) -> dict | None:
    result = cc.cluster.kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def running(cc: ChartCluster, name: str, timeout: float = 90) -> dict:
    def found():
        pod = pod_json(cc, name)
        return pod if pod and pod["status"].get("phase") == "Running" else None
    return wait_for(f"pod {name} Running", found, timeout=timeout, log=cc.logs)


def report(cc: ChartCluster, pod: dict) -> dict:
    node = cc.node(pod["spec"]["nodeName"])
    name = pod["metadata"]["name"]
    line = wait_for(f"{name}'s report", lambda: node.container_log(NAMESPACE, name, "pytorch").strip(),
                    timeout=30, log=cc.logs)
    return json.loads(line.splitlines()[-1])


def scheduling_events(cc: ChartCluster, name: str, words: str) -> list[str]:
    events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                          "--field-selector", f"involvedObject.name={name}")["items"]
    return [e["message"] for e in events if e["reason"] == "FailedScheduling" and words in e["message"]]


def preempt_calls(cc: ChartCluster) -> int:
    """How many preempt calls the extender has answered (its /metrics)."""
    address = f"http://{extender_address(cc)}:{EXTENDER_PORT}/metrics"
    read = ("import urllib.request, sys; "
            f"sys.stdout.write(urllib.request.urlopen({address!r}, timeout=10).read().decode())")
    text = subprocess.run(cc.cluster.command([sys.executable, "-c", read]), capture_output=True, text=True,
                          check=True).stdout
    counts = [line.split()[-1] for line in text.splitlines()
              if line.startswith("vgpu_extender_request_duration_seconds_count") and 'verb="preempt"' in line]
    return int(float(counts[0])) if counts else 0


def delete(cc: ChartCluster, *names: str) -> None:
    cc.cluster.kubectl("delete", "pod", *names, "-n", NAMESPACE, "--wait=true", "--timeout=60s",
                       "--ignore-not-found")


def test_the_kubeshare_seed_pod_runs_on_its_model_at_half_a_gpu(chart_cluster):
    cc = chart_cluster
    create(cc, kubeshare_pod("mnist", {"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0",
                                       "sharedgpu/gpu_model": "NVIDIA-GeForce-GTX-1080"}))
    pod = running(cc, "mnist")
    assert pod["spec"]["nodeName"] == "node-1", pod["spec"]["nodeName"]
    assert pod["spec"]["schedulerName"] == "vgpu-scheduler"
    # Priority 0 (the default): opportunistic, through the chart's class,
    # which the API server resolved to its value.
    assert pod["spec"]["priorityClassName"] == "vgpu-opportunistic"
    assert pod["spec"]["priority"] == -100 and pod["spec"]["preemptionPolicy"] == "Never"
    assert pod["metadata"]["annotations"]["vgpu.io/gpucores-burst"] == "100"
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpucores"] == "50" and limits["nvidia.com/gpumem-percentage"] == "50"
    got = report(cc, pod)
    # Half of the GPU's memory (KubeShare's default for gpu_mem), all of it
    # usable but the context's share.
    assert got["device_totals_mib"] == [GPU_MIB // 2], got
    assert (got["error"], got["allocated_mib"]) == (2, GPU_MIB // 2 - CONTEXT_RESERVE_MIB), got
    delete(cc, "mnist")


def test_the_kubeshare_seed_job_with_a_group_runs(chart_cluster):
    cc = chart_cluster
    labels = {"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "sharedgpu/group_name": "a",
              "sharedgpu/group_headcount": "5", "sharedgpu/group_threshold": "0.2", "sharedgpu/priority": "100"}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "lstm-g", "namespace": NAMESPACE, "labels": {"app": "lstm-g"}},
           "spec": {"completions": 5, "parallelism": 5, "template": {
               "metadata": {"name": "lstm-o", "labels": labels},
               "spec": {"schedulerName": "kubeshare-scheduler", "restartPolicy": "Never",
                        "containers": [{"name": "pytorch", "image": "riyazhu/lstm-wiki2:test",
                                        "command": [sys.executable, str(FILL), "1024", "--exit"],
                                        "imagePullPolicy": "IfNotPresent"}]}}}}
    create(cc, job)

    def finished():
        status = kubectl_json(cc.cluster, "get", "job", "lstm-g", "-n", NAMESPACE).get("status", {})
        return status if status.get("succeeded") == 5 else None
    wait_for("the Job's 5 pods succeeded", finished, timeout=120, log=cc.logs)
    pods = kubectl_json(cc.cluster, "get", "pods", "-n", NAMESPACE, "-l", "job-name=lstm-g")["items"]
    # Guaranteed (priority 100): no opportunistic class.
    assert all("priorityClassName" not in p["spec"] for p in pods), [p["spec"].get("priorityClassName") for p in pods]
    cc.cluster.kubectl("delete", "job", "lstm-g", "-n", NAMESPACE, "--cascade=foreground", "--wait=true",
                       "--timeout=60s")


def test_the_gpu_model_annotation_takes_a_pod_to_its_model(chart_cluster):
    cc = chart_cluster

    def annotated(name: str, model: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NAMESPACE,
                             "annotations": {"nvidia-gpu-scheduler/gpu.model": model}},
                "spec": {"terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "pytorch", "image": "cuda",
                                         "command": [sys.executable, str(FILL), "1024"],
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    create(cc, annotated("on-v100", V100))
    create(cc, annotated("on-a100", "NVIDIA A100-SXM4-80GB"))
    assert running(cc, "on-v100")["spec"]["nodeName"] == "node-2"
    assert wait_for("on-a100: FailedScheduling naming the model",
                    lambda: scheduling_events(cc, "on-a100", "not the nvidia-gpu-scheduler/gpu.model"),
                    timeout=60, log=cc.logs)
    assert not pod_json(cc, "on-a100")["spec"].get("nodeName")
    delete(cc, "on-v100", "on-a100")


def test_the_nvidia_gpu_scheduler_stanza_places_pods(chart_cluster):
    """A kube-scheduler of the cluster's own, configured with
    nvidia-gpu-scheduler's extender stanza (its urlPrefix, filter,
    prioritize and preempt verbs; in today's v1 format, and with our bind
    verb added, as scheduler/README.md says) places a pod with the
    gpu.model annotation on its model through our extender."""
    cc = chart_cluster
    stanza = {
        "urlPrefix": f"http://{extender_address(cc)}:{EXTENDER_PORT}/apis/nvidia-gpu-scheduler/v1/schedule",
        "filterVerb": "filter", "prioritizeVerb": "prioritize", "preemptVerb": "preempt",
        "bindVerb": "bind", "weight": 1, "enableHTTPS": False, "nodeCacheCapable": True,
        "ignorable": False, "managedResources": [{"name": "nvidia.com/gpu", "ignoredByScheduler": False}],
    }
    with extra_kube_scheduler(cc, "nvidia-gpu-scheduler", stanza) as scheduler_log:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "ngs", "namespace": NAMESPACE,
                            "annotations": {"nvidia-gpu-scheduler/gpu.model": "Tesla-V100-SXM2-16GB"}},
               "spec": {"schedulerName": "nvidia-gpu-scheduler", "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "pytorch", "image": "cuda",
                                        "command": [sys.executable, str(FILL), "256"],
                                        "resources": {"limits": {"nvidia.com/gpu": "1",
                                                                 "nvidia.com/gpumem": "2048"}}}]}}
        created = json.loads(cc.cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout)
        assert created["spec"]["schedulerName"] == "nvidia-gpu-scheduler", "a named scheduler is kept"
        found = wait_for("the pod placed by nvidia-gpu-scheduler's stanza running",
                         lambda: (p := pod_json(cc, "ngs")) and p["status"].get("phase") == "Running" and p,
                         timeout=90, log=lambda: cc.logs() + "\n--- nvidia-gpu-scheduler kube-scheduler\n"
                         + scheduler_log.read_text(errors="replace")[-3000:])
        assert found["spec"]["nodeName"] == "node-2", "the V100 node"
        assert "vgpu.io/decision" in found["metadata"]["annotations"], "our extender decided it"
        events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", "involvedObject.name=ngs")["items"]
        assert any(e["reason"] == "Scheduled" and e.get("reportingComponent") == "nvidia-gpu-scheduler"
                   for e in events), events
        got = report(cc, found)
        assert got["device_totals_mib"] == [2048], got
        delete(cc, "ngs")


def test_a_guaranteed_pod_preempts_an_opportunistic_one(chart_cluster):
    cc = chart_cluster
    model = {"sharedgpu/gpu_model": "Tesla-V100-SXM2-16GB"}
    # Two opportunistic pods take 80 % of each V100.
    for name in ("idle-1", "idle-2"):
        create(cc, kubeshare_pod(name, {"sharedgpu/gpu_request": "0.8", **model}))
    first, second = running(cc, "idle-1"), running(cc, "idle-2")
    assert {first["spec"]["nodeName"], second["spec"]["nodeName"]} == {"node-2"}
    # A guaranteed pod wanting half of a V100 fits on neither GPU: the real
    # kube-scheduler preempts, asking our preempt verb which pods to evict.
    calls_before = preempt_calls(cc)
    create(cc, kubeshare_pod("urgent", {"sharedgpu/gpu_request": "0.5", "sharedgpu/priority": "50", **model}))
    pod = running(cc, "urgent", timeout=120)
    assert pod["spec"]["nodeName"] == "node-2"
    assert pod["spec"].get("priority", 0) == 0
    # Exactly one opportunistic pod was evicted: one GPU was enough.
    left = [name for name in ("idle-1", "idle-2") if (p := pod_json(cc, name)) and
            not p["metadata"].get("deletionTimestamp")]
    assert len(left) == 1, left
    assert running(cc, left[0])["spec"]["nodeName"] == "node-2"
    assert preempt_calls(cc) > calls_before
    delete(cc, "urgent", *left)


def test_a_group_waits_for_its_quorum_and_is_placed_together(chart_cluster):
    cc = chart_cluster
    model = {"sharedgpu/gpu_model": "Tesla-V100-SXM2-16GB", "sharedgpu/priority": "10"}

    def group(name: str, request: str) -> list[str]:
        labels = {"sharedgpu/gpu_request": request, "sharedgpu/group_name": name,
                  "sharedgpu/group_headcount": "5", "sharedgpu/group_threshold": "0.6", **model}
        names = [f"{name}-{i}" for i in range(5)]
        for pod in names:
            create(cc, kubeshare_pod(pod, labels))
        return names

    def phases(names: list[str]) -> dict[str, str]:
        return {name: (pod_json(cc, name) or {}).get("status", {}).get("phase", "gone") for name in names}

    # Two V100s, pods of 0.6: room for 2 of the 3 needed (5 x 0.6). None
    # is bound, and each pod's events say why: a pod tried before enough of
    # its group existed says so (kube-scheduler retries it at its next
    # cluster event, not when a group member is created); once the group is
    # complete, the room is what is short.
    wide = group("wide", "0.6")
    for name in wide:
        wait_for(f"{name}: FailedScheduling naming its group",
                 lambda name=name: scheduling_events(cc, name, "group kubeshare/wide: "),
                 timeout=60, log=cc.logs)
    wait_for("the group's room named as short", lambda: scheduling_events(
        cc, wide[-1], "group kubeshare/wide: only 2 of the 3 pods"), timeout=60, log=cc.logs)
    assert all(not pod_json(cc, name)["spec"].get("nodeName") for name in wide)
    delete(cc, *wide)

    # Room for 3 halves (one of the four is taken): three are bound
    # together, two wait.
    create(cc, kubeshare_pod("blocker", {"sharedgpu/gpu_request": "0.5", **model}))
    running(cc, "blocker")
    half = group("half", "0.5")
    wait_for("three of the group Running", lambda: list(phases(half).values()).count("Running") == 3,
             timeout=90, log=cc.logs)
    waiting = [name for name, phase in phases(half).items() if phase == "Pending"]
    assert len(waiting) == 2, phases(half)
    assert all(not pod_json(cc, name)["spec"].get("nodeName") for name in waiting)
    delete(cc, "blocker", *half)


def test_bad_kubeshare_labels_are_refused_naming_the_label(chart_cluster):
    cc = chart_cluster
    for labels, words in (
        ({"sharedgpu/gpu_request": "1.5"}, "above 1 it must be a whole number of GPUs"),
        ({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "0.3"}, "is below sharedgpu/gpu_request"),
        ({"sharedgpu/gpu_request": "half"}, "not a decimal number"),
        ({"sharedgpu/gpu_request": "0.5", "sharedgpu/group_name": "b"}, "sharedgpu/group_headcount is missing"),
    ):
        refused = create(cc, kubeshare_pod("bad", labels), check=False)
        assert refused.returncode != 0 and words in refused.stderr, (labels, refused.stderr)
        assert pod_json(cc, "bad") is None


def lease_renewals(cc: ChartCluster) -> dict[str, str]:
    """Each node's device plugin Lease: node -> renewTime."""
    leases = kubectl_json(cc.cluster, "get", "leases", "-n", "kube-node-lease",
                          "-l", "app.kubernetes.io/managed-by=vgpu-device-plugin")["items"]
    return {lease["spec"]["holderIdentity"]: lease["spec"]["renewTime"] for lease in leases}


def extender_leases(cc: ChartCluster) -> dict[str, str]:
    """Each node's Lease as the extender judges it (its /debug/state)."""
    address = f"http://{extender_address(cc)}:{EXTENDER_PORT}/debug/state"
    read = ("import urllib.request, sys; "
            f"sys.stdout.write(urllib.request.urlopen({address!r}, timeout=10).read().decode())")
    text = subprocess.run(cc.cluster.command([sys.executable, "-c", read]), capture_output=True, text=True,
                          check=True).stdout
    return {name: node["lease"] for name, node in json.loads(text)["nodes"].items()}


def test_nodes_whose_plugins_stop_renewing_their_leases_get_no_new_pods(chart_cluster):
    cc = chart_cluster
    model = {"sharedgpu/gpu_model": "Tesla-V100-SXM2-16GB", "sharedgpu/priority": "10"}
    first = lease_renewals(cc)
    assert set(first) == {"node-1", "node-2"}, first
    wait_for("both Leases renewed", lambda: all(lease_renewals(cc).get(n) != r for n, r in first.items()),
             timeout=30, log=cc.logs)
    # The plugins lose the right to renew: their Leases stop where they are
    # (the plugins go on serving Allocate).
    binding = next(b for b in kubectl_json(cc.cluster, "get", "rolebindings", "-n", "kube-node-lease")["items"]
                   if b["metadata"]["name"].endswith("-node-leases"))
    cc.cluster.kubectl("delete", "rolebinding", binding["metadata"]["name"], "-n", "kube-node-lease")
    try:
        # Before the Leases run out, a pod is still placed (after, none is
        # until the test restores the binding).
        create(cc, kubeshare_pod("before-expiry", {"sharedgpu/gpu_request": "0.5", **model}))
        running(cc, "before-expiry", timeout=60)
        # After the duration and the grace, the extender turns both nodes
        # down, and the pod's events say why.
        wait_for("both Leases expired in the extender's eyes",
                 lambda: all(v.startswith("expired") for v in extender_leases(cc).values()),
                 timeout=LEASE_SECONDS + LEASE_GRACE_SECONDS + 30, log=cc.logs)
        stopped = lease_renewals(cc)
        create(cc, kubeshare_pod("after-expiry", {"sharedgpu/gpu_request": "0.5", **model}))
        wait_for("after-expiry: FailedScheduling naming the Lease",
                 lambda: scheduling_events(cc, "after-expiry", "last renewed its Lease"),
                 timeout=60, log=cc.logs)
        assert not pod_json(cc, "after-expiry")["spec"].get("nodeName")
    finally:
        restored = {key: binding[key] for key in ("apiVersion", "kind", "roleRef", "subjects")}
        restored["metadata"] = {key: binding["metadata"][key] for key in ("name", "namespace", "labels")}
        cc.cluster.kubectl("apply", "-f", "-", input=json.dumps(restored))
    # Renewing again: the nodes take pods again (the waiting one is retried
    # at kube-scheduler's next event: the new pod's placement).
    wait_for("both Leases renewed again", lambda: all(lease_renewals(cc).get(n) != r for n, r in stopped.items()),
             timeout=60, log=cc.logs)
    wait_for("both Leases live in the extender's eyes",
             lambda: all(v.startswith("live") for v in extender_leases(cc).values()), timeout=30, log=cc.logs)
    create(cc, kubeshare_pod("renewed", {"sharedgpu/gpu_request": "0.25", **model}))
    assert running(cc, "renewed")["spec"]["nodeName"] == "node-2"
    assert running(cc, "after-expiry", timeout=120)["spec"]["nodeName"] == "node-2"
    delete(cc, "before-expiry", "after-expiry", "renewed")


def test_a_restarted_plugin_checks_its_records_against_kubelets_with_one_gone_from_its_pod(chart_cluster):
    cc = chart_cluster
    model = {"sharedgpu/gpu_model": "Tesla-V100-SXM2-16GB", "sharedgpu/priority": "10"}
    for name in ("kept", "unrecorded"):
        create(cc, kubeshare_pod(name, {"sharedgpu/gpu_request": "0.25", **model}))
    for name in ("kept", "unrecorded"):
        running(cc, name)
    # One pod's allocation record goes missing from the pod, if the plugin
    # wrote one (kubelet still holds its devices, and its region is on the
    # node); then node-2's plugin is killed and restarted by its pod.
    # (Removed as the extender's account: the chart's admission policy
    # lets no other account, the admin's included, write vgpu's records.)
    as_extender = cc.cluster.token_kubeconfig(RELEASE_NAMESPACE, "vgpu-scheduler", cc.workdir / "extender.kubeconfig")
    if "vgpu.io/allocated" in kubectl_json(cc.cluster, "get", "pod", "unrecorded", "-n", NAMESPACE)["metadata"].get(
            "annotations", {}):
        cc.cluster.kubectl("annotate", "pod", "unrecorded", "-n", NAMESPACE, "vgpu.io/allocated-",
                           kubeconfig=as_extender)
    agent = next(p for p in kubectl_json(cc.cluster, "get", "pods", "-n", RELEASE_NAMESPACE,
                                         "-l", "app.kubernetes.io/component=node")["items"]
                 if p["spec"]["nodeName"] == "node-2")["metadata"]["name"]
    node = cc.node("node-2")

    def plugin_log() -> str:
        return node.container_log(RELEASE_NAMESPACE, agent, "device-plugin")
    checks_before = plugin_log().count("PodResources check:")
    kill_9(agent, "vgpu-device-plugin")

    def checked():
        log = plugin_log()
        return log if log.count("container(s) agree with kubelet's records") > checks_before else None
    log = wait_for("the restarted plugin's PodResources check", checked, timeout=90, log=cc.logs)
    # The plugin's own record of a served container is its region on the
    # node: it reads it back, writes no annotation for a pod kubelet has
    # admitted (its status says so), and both containers agree with kubelet.
    record = kubectl_json(cc.cluster, "get", "pod", "unrecorded", "-n", NAMESPACE)["metadata"]["annotations"]
    assert "vgpu.io/allocated" not in record, record
    assert "PodResources check: 2 container(s) agree with kubelet's records, 0 differ" in log, log[-3000:]
    delete(cc, "kept", "unrecorded")
