"""Elastic GPU's resources end to end, on the chart running on simulated
nodes under the real control plane: the Elastic GPU Scheduler's own pod
examples (Deployments asking for `elasticgpu.io/gpu-memory: 256` and for
`elasticgpu.io/gpu-core: 200`) run under the shim at their caps; a
kube-scheduler configured with that project's extender stanza (plain HTTP
to port 39999 under `/scheduler`, `priorities`, its resources as
managedResources without ignoredByScheduler, in a v1
KubeSchedulerConfiguration) places pods through our extender; bad
requests get clear errors. The README's claims and classes, in its own
`v1alpha` form, are stored through the extender's conversion webhook. And
the Elastic GPU Scheduler's roadmap item: the `load-aware` policy places a
pod on the GPU measured least busy."""

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
    REPO,
    ChartCluster,
    compile_workload,
    extender_address,
    extra_kube_scheduler,
    kubectl_json,
    wait_for,
)

NAMESPACE = "elastic"
FILL = HERE / "workloads/fill.py"
# Device memory charged to the cap for each CUDA context (the shim's
# VGPU_CONTEXT_RESERVE default): what a workload can allocate is the cap less
# this.
CONTEXT_RESERVE_MIB = 256


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    # The Elastic GPU Scheduler's kube-scheduler runs outside the extender's
    # pod and reaches it through its Service.
    with ChartCluster(tmp_path_factory.mktemp("elastic-cluster"), nodes=2,
                      helm_args=("--set", "scheduler.extender.exposeVerbs=true")) as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


def seed_deployment(name: str, limits: dict[str, str], chunk_mib: int) -> dict:
    """The Elastic GPU Scheduler's example Deployment, with our workload as
    its command."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "cuda", "image": "nvidia/cuda:10.0-base",
                                         "command": [sys.executable, str(FILL), str(chunk_mib)],
                                         "resources": {"limits": limits}}]}}}}


def running_pod(cc: ChartCluster, selector: str) -> dict:
    def found():
        pods = kubectl_json(cc.cluster, "get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
        return pods[0] if len(pods) == 1 and pods[0]["status"].get("phase") == "Running" else None
    return wait_for(f"a Running pod {selector}", found, timeout=90, log=cc.logs)


def report(cc: ChartCluster, pod: dict, container: str) -> dict:
    node = cc.node(pod["spec"]["nodeName"])
    name = pod["metadata"]["name"]
    line = wait_for(f"{name}'s report", lambda: node.container_log(NAMESPACE, name, container).strip(),
                    timeout=30, log=cc.logs)
    return json.loads(line.splitlines()[-1])


def test_the_seed_examples_run_at_their_caps(chart_cluster):
    cc = chart_cluster
    for deployment in (seed_deployment("memory-256", {"elasticgpu.io/gpu-memory": "256"}, 64),
                       seed_deployment("cores-200", {"elasticgpu.io/gpu-core": "200"}, 256)):
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(deployment))

    pod = running_pod(cc, "app=memory-256")
    # The webhook gave the container the GPU count kubelet allocates by.
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["spec"]["schedulerName"] == "vgpu-scheduler"
    got = report(cc, pod, "cuda")
    # The one device shows the 256 MiB cap; its context takes all of it, so
    # the first 64 MiB allocation is refused with CUDA_ERROR_OUT_OF_MEMORY (2).
    assert got["device_totals_mib"] == [256], got
    assert (got["error"], got["allocated_mib"]) == (2, 256 - CONTEXT_RESERVE_MIB), got

    pod = running_pod(cc, "app=cores-200")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    got = report(cc, pod, "cuda")
    # Two whole GPUs of the node (16 GiB each), all their memory usable.
    assert got["device_totals_mib"] == [16384, 16384], got
    assert got["allocated_mib"] == 16384 - CONTEXT_RESERVE_MIB and got["error"] == 2, got
    for name in ("memory-256", "cores-200"):
        cc.cluster.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")


def test_the_elastic_gpu_scheduler_stanza_places_pods(chart_cluster):
    """A kube-scheduler of the cluster's own, configured as the Elastic GPU
    Scheduler's README says (in today's v1 configuration format: the Policy
    file it names is gone since Kubernetes 1.23), schedules through our
    extender over plain HTTP while the webhook is served over HTTPS."""
    cc = chart_cluster
    stanza = {
        "urlPrefix": f"http://{extender_address(cc)}:{EXTENDER_PORT}/scheduler",
        "filterVerb": "filter", "prioritizeVerb": "priorities", "bindVerb": "bind",
        "weight": 1, "enableHTTPS": False, "nodeCacheCapable": True,
        "managedResources": [{"name": "elasticgpu.io/gpu-memory"}, {"name": "elasticgpu.io/gpu-core"}],
    }
    with extra_kube_scheduler(cc, "elastic-gpu-scheduler", stanza) as scheduler_log:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stanza", "namespace": NAMESPACE},
               "spec": {"schedulerName": "elastic-gpu-scheduler", "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "main", "image": "nvidia/cuda:10.0-base",
                                        "command": [sys.executable, str(FILL), "128"],
                                        "resources": {"limits": {"elasticgpu.io/gpu-memory": "512",
                                                                 "elasticgpu.io/gpu-core": "30"}}}]}}
        created = json.loads(cc.cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout)
        # Named scheduler kept; the GPU count added all the same.
        assert created["spec"]["schedulerName"] == "elastic-gpu-scheduler"
        assert created["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

        def running():
            found = kubectl_json(cc.cluster, "get", "pod", "stanza", "-n", NAMESPACE)
            return found if found["status"].get("phase") == "Running" else None
        found = wait_for("the pod placed by the Elastic stanza running", running, timeout=90,
                         log=lambda: cc.logs() + "\n--- elastic kube-scheduler\n"
                         + scheduler_log.read_text(errors="replace")[-3000:])
        # Our extender decided it (its record is on the pod) and kube-scheduler's
        # profile reported the placement.
        assert "vgpu.io/decision" in found["metadata"]["annotations"]
        events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", "involvedObject.name=stanza")["items"]
        assert any(e["reason"] == "Scheduled" and e.get("reportingComponent") == "elastic-gpu-scheduler"
                   for e in events), events
        got = report(cc, found, "main")
        assert got["device_totals_mib"] == [512], got
        assert (got["error"], got["allocated_mib"]) == (2, 512 - CONTEXT_RESERVE_MIB), got
        cc.cluster.kubectl("delete", "pod", "stanza", "-n", NAMESPACE, "--wait=true", "--timeout=60s")


def test_bad_elastic_requests_get_clear_errors(chart_cluster):
    cc = chart_cluster

    def create(name: str, limits: dict[str, str]):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
               "spec": {"containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}]}}
        return cc.cluster.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)

    # The API server refuses what is no quantity, or a negative one, itself.
    refused = create("words", {"elasticgpu.io/gpu-memory": "lots"})
    assert refused.returncode != 0 and "quantities must match the regular expression" in refused.stderr, refused
    refused = create("negative", {"elasticgpu.io/gpu-core": "-10"})
    assert refused.returncode != 0 and "must be greater than or equal to 0" in refused.stderr, refused
    # What only vgpu knows is wrong is said in the pod's scheduling event.
    for name, limits, words in (
        ("odd-cores", {"elasticgpu.io/gpu-core": "150"}, "above 100 it must be a multiple of 100"),
        ("both-kinds", {"elasticgpu.io/gpu-core": "50", "nvidia.com/gpumem": "1024"}, "use one kind"),
    ):
        assert create(name, limits).returncode == 0

        def said(name=name, words=words):
            events = kubectl_json(cc.cluster, "get", "events", "-n", NAMESPACE,
                                  "--field-selector", f"involvedObject.name={name}")["items"]
            return [e["message"] for e in events if e["reason"] == "FailedScheduling" and words in e["message"]]
        assert wait_for(f"{name}: FailedScheduling saying {words!r}", said, timeout=60, log=cc.logs)
        pod = kubectl_json(cc.cluster, "get", "pod", name, "-n", NAMESPACE)
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
        cc.cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")


# The Elastic GPU README's example, in its own v1alpha form (with its YAML
# mistakes corrected: the pods' `metadata:` had the name on its own line and
# `annotations` outside metadata, and one container line was indented with
# a tab).
README_CLASS_AND_CLAIMS = """
apiVersion: elasticgpu.io/v1alpha
kind: ElasticGPUClass
metadata:
  name: gpushare-egpuclass
provisioner: gpushare.provisioner.elasticgpu.io
reclaimPolicy: Retain
egpuBindingMode: Immediate
---
apiVersion: elasticgpu.io/v1alpha
kind: ElasticGPUClaim
metadata:
  name: gpushare-egpuc-1
  namespace: elastic
spec:
  egpuClassName: gpushare-egpuclass
  resources:
    requests:
      gpushare.provisioner.elasticgpu.io/gpu-core: 10
      gpushare.provisioner.elasticgpu.io/gpu-memory: 4
---
apiVersion: elasticgpu.io/v1alpha
kind: ElasticGPUClaim
metadata:
  name: gpushare-egpuc-2
  namespace: elastic
spec:
  egpuClassName: gpushare-egpuclass
  resources:
    requests:
      gpushare.provisioner.elasticgpu.io/gpu-core: 10
      gpushare.provisioner.elasticgpu.io/gpu-memory: 4
"""


def test_the_readme_claims_are_stored_through_the_conversion_webhook(chart_cluster):
    """The API server converts the README's v1alpha objects to the stored
    v1alpha1 through the extender's /convert (HTTPS, the chart's CA), and
    back: both forms read the same objects, nothing lost."""
    cluster = chart_cluster.cluster
    applied = cluster.kubectl("apply", "-f", "-", input=README_CLASS_AND_CLAIMS, check=False)
    assert applied.returncode == 0, applied.stderr
    stored = kubectl_json(cluster, "get", "elasticgpuclaims.v1alpha1.elasticgpu.io", "gpushare-egpuc-1",
                          "-n", NAMESPACE)
    assert stored["apiVersion"] == "elasticgpu.io/v1alpha1"
    assert stored["spec"]["elasticGPUClassName"] == "gpushare-egpuclass"
    assert stored["spec"]["resources"]["requests"]["gpushare.provisioner.elasticgpu.io/gpu-core"] in (10, "10")
    stored_class = kubectl_json(cluster, "get", "elasticgpuclasses.v1alpha1.elasticgpu.io", "gpushare-egpuclass")
    annotations = stored_class["metadata"]["annotations"]
    assert annotations["vgpu.io/elasticgpu-reclaim-policy"] == "Retain"
    assert annotations["vgpu.io/elasticgpu-binding-mode"] == "Immediate"
    readme_class = kubectl_json(cluster, "get", "elasticgpuclasses.v1alpha.elasticgpu.io", "gpushare-egpuclass")
    assert (readme_class["reclaimPolicy"], readme_class["egpuBindingMode"]) == ("Retain", "Immediate")
    assert "vgpu.io/elasticgpu-reclaim-policy" not in readme_class["metadata"].get("annotations", {})
    claims = kubectl_json(cluster, "get", "elasticgpuclaims.v1alpha.elasticgpu.io", "-n", NAMESPACE)["items"]
    assert sorted(c["spec"]["egpuClassName"] for c in claims) == ["gpushare-egpuclass"] * 2
    cluster.kubectl("delete", "-f", "-", input=README_CLASS_AND_CLAIMS)


def test_load_aware_takes_the_gpu_measured_least_busy(chart_cluster):
    """Two pods hold equal grants (1024 MiB, 40 %) on the two GPUs of one
    node; one keeps its GPU busy, the other idles. Once the device plugin's
    measurement (NVML of the simulated GPU, smoothed) reaches the node
    inventory, a pod with the load-aware policy lands on the idle GPU, where
    fewest-tasks would have taken the first of the tied GPUs."""
    cc = chart_cluster
    cluster = cc.cluster
    workload = compile_workload("workload", cc.workdir, source=REPO / "testkit/programs/workload.c")
    node = kubectl_json(cluster, "get", "nodes")["items"][0]
    name = node["metadata"]["name"]

    def inventory() -> list[dict]:
        current = kubectl_json(cluster, "get", "node", name)
        return json.loads(current["metadata"]["annotations"]["vgpu.io/node-gpus"])["gpus"]
    busy_gpu, idle_gpu = (gpu["uuid"] for gpu in sorted(inventory(), key=lambda g: g["index"]))

    def pod(pod_name: str, gpus: str, command: list[str], policy: str | None = None) -> dict:
        annotations = {"nvidia.com/use-gpuuuid": gpus}
        if policy:
            annotations["vgpu.io/gpu-scheduler-policy"] = policy
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": NAMESPACE, "annotations": annotations},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "main", "image": "cuda:test", "command": command,
                                         "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024",
                                                                  "nvidia.com/gpucores": "40"}}}]}}
    for created in (pod("busy", busy_gpu, [str(workload), "sync", "k1ms", "600"]),
                    pod("idle", idle_gpu, [sys.executable, str(FILL), "64"])):
        cluster.kubectl("create", "-f", "-", input=json.dumps(created))
    for pod_name in ("busy", "idle"):
        wait_for(f"{pod_name} running", lambda pod_name=pod_name: kubectl_json(
            cluster, "get", "pod", pod_name, "-n", NAMESPACE)["status"].get("phase") == "Running",
            timeout=90, log=cc.logs)

    def measured():
        figures = {gpu["uuid"]: gpu.get("utilizationPercent") for gpu in inventory()}
        busy, idle = figures[busy_gpu], figures[idle_gpu]
        return (busy, idle) if busy is not None and idle is not None and busy >= 20 and idle < 10 else None
    busy, idle = wait_for("the node inventory showing the busy GPU busy and the idle one idle", measured,
                          timeout=90, log=lambda: json.dumps(inventory()) + cc.troubles())
    print(f"\nmeasured: busy GPU {busy} %, idle GPU {idle} % (both granted 40 %)")

    cluster.kubectl("create", "-f", "-", input=json.dumps(
        pod("placed", f"{busy_gpu},{idle_gpu}", [sys.executable, str(FILL), "64"], policy="load-aware")))
    placed = wait_for("the load-aware pod decided", lambda: kubectl_json(
        cluster, "get", "pod", "placed", "-n", NAMESPACE)["metadata"].get("annotations", {}).get("vgpu.io/decision"),
        timeout=60, log=cc.logs)
    decision = json.loads(placed)
    assert [d["uuid"] for d in decision["containers"][0]["devices"]] == [idle_gpu], decision
    for pod_name in ("placed", "busy", "idle"):
        cluster.kubectl("delete", "pod", pod_name, "-n", NAMESPACE, "--wait=false")


# The README's two pods, corrected (the name under metadata, annotations
# inside it, no tab), with our workload as the command.
def readme_pod(name: str, claim: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "annotations": {"egpuc.elasticgpu.io/test1": claim}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "test-cuda", "image": "nvidia/cuda:10.0-base",
                                     "command": [sys.executable, str(FILL), "256"]}]}}


def test_the_readme_pods_get_their_claims_shares(chart_cluster):
    """The README's class, claims (10 % and 4 of gpu-memory, read as GiB)
    and pods: each pod's container gets its claim's share from the webhook
    and runs at that cap; a third pod naming a claim in use, a pod whose
    annotation matches none of its containers, and a claim of an unknown
    class are refused at creation, saying why."""
    cc = chart_cluster
    cluster = cc.cluster
    cluster.kubectl("apply", "-f", "-", input=README_CLASS_AND_CLAIMS)
    for name, claim in (("test-cuda-1", "gpushare-egpuc-1"), ("test-cuda-2", "gpushare-egpuc-2")):
        created = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json",
                                             input=json.dumps(readme_pod(name, claim))).stdout)
        limits = created["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "10"}, limits
        assert created["metadata"]["annotations"]["vgpu.io/elasticgpu-claims"] == claim
        assert created["spec"]["schedulerName"] == "vgpu-scheduler"
    for name in ("test-cuda-1", "test-cuda-2"):
        def running(name=name):
            pod = kubectl_json(cluster, "get", "pod", name, "-n", NAMESPACE)
            return pod if pod["status"].get("phase") == "Running" else None
        pod = wait_for(f"{name} running", running, timeout=90, log=cc.logs)
        got = report(cc, pod, "test-cuda")
        assert got["device_totals_mib"] == [4096], got
        assert (got["error"], got["allocated_mib"]) == (2, 4096 - CONTEXT_RESERVE_MIB), got

    def refused(pod: dict) -> str:
        done = cluster.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)
        assert done.returncode != 0, f"{pod['metadata']['name']} was admitted"
        return done.stderr
    assert "is in use by pod elastic/test-cuda-1" in refused(readme_pod("third", "gpushare-egpuc-1"))
    two = readme_pod("two-containers", "gpushare-egpuc-2")
    two["spec"]["containers"].append({"name": "side", "image": "busybox", "command": ["sleep", "1"]})
    assert "names no container of this pod, which has 2 (test-cuda, side)" in refused(two)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "elasticgpu.io/v1alpha1", "kind": "ElasticGPUClaim",
        "metadata": {"name": "orphan", "namespace": NAMESPACE},
        "spec": {"elasticGPUClassName": "missing", "resources": {"requests": {
            "gpushare.provisioner.elasticgpu.io/gpu-core": 10}}}}))
    assert "its class missing does not exist" in refused(readme_pod("orphaned", "orphan"))
    assert "ElasticGPUClaim nowhere not found" in refused(readme_pod("unclaimed", "nowhere"))
    for name in ("test-cuda-1", "test-cuda-2"):
        cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    # The claim is free again once its pod is gone.
    cluster.kubectl("create", "-f", "-", input=json.dumps(readme_pod("again", "gpushare-egpuc-1")))
    cluster.kubectl("delete", "pod", "again", "-n", NAMESPACE, "--wait=false")
    cluster.kubectl("delete", "elasticgpuclaim", "orphan", "-n", NAMESPACE)
    cluster.kubectl("delete", "-f", "-", input=README_CLASS_AND_CLAIMS)


def elastic_class(name: str, reclaim: str, binding: str) -> dict:
    return {"apiVersion": "elasticgpu.io/v1alpha", "kind": "ElasticGPUClass", "metadata": {"name": name},
            "provisioner": "gpushare.provisioner.elasticgpu.io", "reclaimPolicy": reclaim, "egpuBindingMode": binding}


def elastic_claim(name: str, klass: str, requests: dict) -> dict:
    return {"apiVersion": "elasticgpu.io/v1alpha1", "kind": "ElasticGPUClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"elasticGPUClassName": klass, "resources": {"requests": requests}}}


def test_claims_are_bound_provisioned_and_reclaimed(chart_cluster):
    """The claim controller (in the extender): Immediate claims are bound
    to an ElasticGPU at once; WaitForFirstConsumer ones when their first
    pod is placed, on its GPU, and stay bound after the pod is gone;
    deleting a claim deletes (Delete) or releases (Retain) its ElasticGPU;
    claims it cannot satisfy say why in a Ready condition."""
    cc = chart_cluster
    cluster = cc.cluster
    share = {"gpushare.provisioner.elasticgpu.io/gpu-core": 20, "gpushare.provisioner.elasticgpu.io/gpu-memory": 1}
    for klass in (elastic_class("now-delete", "Delete", "Immediate"),
                  elastic_class("now-retain", "Retain", "Immediate"),
                  elastic_class("later", "Delete", "WaitForFirstConsumer")):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(klass))
    for claim in (elastic_claim("c-delete", "now-delete", share), elastic_claim("c-retain", "now-retain", share),
                  elastic_claim("c-later", "later", share), elastic_claim("c-noclass", "absent", share),
                  elastic_claim("c-huge", "now-delete", {"gpushare.provisioner.elasticgpu.io/gpu-memory": 1000})):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(claim))

    def claim(name: str) -> dict:
        return kubectl_json(cluster, "get", "elasticgpuclaims.v1alpha1.elasticgpu.io", name, "-n", NAMESPACE)

    def ready(name: str) -> dict | None:
        conditions = claim(name).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Ready"), None)

    def egpu(name: str) -> dict | None:
        found = cluster.kubectl("get", "elasticgpus.elasticgpu.io", name, "-o", "json", check=False)
        return json.loads(found.stdout) if found.returncode == 0 else None

    for name in ("c-delete", "c-retain"):
        wait_for(f"{name} bound", lambda name=name: claim(name).get("status", {}).get("phase") == "Bound",
                 timeout=60, log=cc.logs)
        bound = claim(name)
        gpu = egpu(bound["spec"]["elasticGPUName"])
        assert gpu["spec"]["claimRef"]["uid"] == bound["metadata"]["uid"], gpu
        assert gpu["spec"]["capacity"] == {"gpushare.provisioner.elasticgpu.io/gpu-core": "20",
                                           "gpushare.provisioner.elasticgpu.io/gpu-memory": "1024Mi"}, gpu
        assert gpu["status"]["phase"] == "Bound"
        assert ready(name)["reason"] == "Provisioned"
    for name, reason, words in (("c-noclass", "ClassNotFound", "ElasticGPUClass absent does not exist"),
                                ("c-huge", "Unsatisfiable", "the largest GPU in the cluster has 16384 MiB"),
                                ("c-later", "WaitingForFirstConsumer", "first pod")):
        condition = wait_for(f"{name}: {reason}", lambda name=name, reason=reason: (
            lambda c: c if c and c["reason"] == reason else None)(ready(name)), timeout=60, log=cc.logs)
        assert condition["status"] == "False" and words in condition["message"], condition
        assert claim(name)["status"]["phase"] == "Pending"

    # The first pod holding the WaitForFirstConsumer claim is placed: the
    # claim is provisioned on its GPU and node, and outlives the pod.
    cluster.kubectl("create", "-f", "-", input=json.dumps(readme_pod("consumer", "c-later")))
    placed = wait_for("the consumer decided", lambda: kubectl_json(
        cluster, "get", "pod", "consumer", "-n", NAMESPACE)["metadata"].get("annotations", {}).get("vgpu.io/decision"),
        timeout=60, log=cc.logs)
    decision = json.loads(placed)
    wait_for("c-later bound", lambda: claim("c-later").get("status", {}).get("phase") == "Bound", timeout=60,
             log=cc.logs)
    gpu = egpu(claim("c-later")["spec"]["elasticGPUName"])
    assert gpu["spec"]["gpuShare"]["gpuName"] == decision["containers"][0]["devices"][0]["uuid"], gpu
    terms = gpu["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert terms[0]["matchFields"][0]["values"] == [decision["node"]], terms
    cluster.kubectl("delete", "pod", "consumer", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    assert claim("c-later")["status"]["phase"] == "Bound"

    # Reclaim policies.
    deleted, retained = (claim(n)["spec"]["elasticGPUName"] for n in ("c-delete", "c-retain"))
    for name in ("c-delete", "c-retain", "c-later", "c-noclass", "c-huge"):
        cluster.kubectl("delete", "elasticgpuclaim", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    assert egpu(deleted) is None
    released = egpu(retained)
    assert released["status"]["phase"] == "Released", released
    cluster.kubectl("delete", "elasticgpu", retained)
    for klass in ("now-delete", "now-retain", "later"):
        cluster.kubectl("delete", "elasticgpuclass", klass)


def test_claims_survive_an_extender_killed_mid_way(chart_cluster):
    """kill -9 of the extender (the claim controller's process) with
    claims just created: once kubelet has restarted it, every claim is bound
    to exactly one ElasticGPU (names follow the claim, so nothing is given
    twice), rebuilt from the API alone."""
    import test_faults as faults  # its helpers; as a module, so its tests are not collected here

    cc = chart_cluster
    cluster = cc.cluster
    cluster.kubectl("apply", "-f", "-", input=json.dumps(elastic_class("restart", "Delete", "Immediate")))
    # With memory: a claim of compute alone would hold all of a GPU's memory
    # (what a pod asking for compute alone is given), so six would not fit.
    share = {"gpushare.provisioner.elasticgpu.io/gpu-core": 5, "gpushare.provisioner.elasticgpu.io/gpu-memory": "512Mi"}
    extender = faults.pod_names(cc, "app.kubernetes.io/component=scheduler")[0]["metadata"]["name"]
    names = [f"r-{i}" for i in range(6)]
    for index, name in enumerate(names):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(elastic_claim(name, "restart", share)))
        if index == 2:
            faults.kill_9(extender, "vgpu-scheduler")

    def all_bound():
        claims = kubectl_json(cluster, "get", "elasticgpuclaims.v1alpha1.elasticgpu.io", "-n", NAMESPACE)["items"]
        ours = [c for c in claims if c["metadata"]["name"] in names]
        return ours if len(ours) == len(names) and all(
            c.get("status", {}).get("phase") == "Bound" for c in ours) else None
    claims = wait_for("every claim bound after the restart", all_bound, timeout=120, log=cc.logs)
    gpus = kubectl_json(cluster, "get", "elasticgpus.elasticgpu.io")["items"]
    for claim in claims:
        holding = [g for g in gpus if g["spec"].get("claimRef", {}).get("uid") == claim["metadata"]["uid"]]
        assert [g["metadata"]["name"] for g in holding] == [claim["spec"]["elasticGPUName"]], holding
        assert "vgpu.io/decision" in holding[0]["metadata"]["annotations"], holding
    # Each slice counted once, by the extender that came back.
    address = f"http://{extender_address(cc)}:{EXTENDER_PORT}/debug/state"
    read = ("import urllib.request, sys; "
            f"sys.stdout.write(urllib.request.urlopen({address!r}, timeout=10).read().decode())")
    state = json.loads(subprocess.run(cluster.command([sys.executable, "-c", read]), capture_output=True, text=True,
                                      check=True).stdout)
    held = sorted(entry.split(" ")[1] for node in state["nodes"].values() for entry in node["reservations"]
                  if entry.split(" ")[1].startswith("(elastic/r-"))
    assert held == sorted(f"(elastic/{name})" for name in names), state
    for name in names:
        cluster.kubectl("delete", "elasticgpuclaim", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    assert not [g for g in kubectl_json(cluster, "get", "elasticgpus.elasticgpu.io")["items"]
                if g["spec"].get("claimRef", {}).get("name") in names]
    cluster.kubectl("delete", "elasticgpuclass", "restart")


def test_an_immediate_claims_slice_is_held_and_its_pods_run_on_it(chart_cluster):
    """An Immediate claim for 10 GiB is given its slice of one 16 GiB GPU
    when it is created, recorded on its ElasticGPU, and held: a pod wanting
    8 GiB of that GPU is not placed while the claim lives, although no pod
    runs there; the claim's own pod runs on that very GPU at its cap; once
    the claim is deleted, the 8 GiB pod fits."""
    cc = chart_cluster
    cluster = cc.cluster
    cluster.kubectl("apply", "-f", "-", input=json.dumps(elastic_class("held", "Delete", "Immediate")))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        elastic_claim("big", "held", {"gpushare.provisioner.elasticgpu.io/gpu-memory": 10})))

    def claim() -> dict:
        return kubectl_json(cluster, "get", "elasticgpuclaims.v1alpha1.elasticgpu.io", "big", "-n", NAMESPACE)
    wait_for("big bound", lambda: claim().get("status", {}).get("phase") == "Bound", timeout=60, log=cc.logs)
    gpu = kubectl_json(cluster, "get", "elasticgpus.elasticgpu.io", claim()["spec"]["elasticGPUName"])
    uuid = gpu["spec"]["gpuShare"]["gpuName"]
    node = gpu["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    slice_ = json.loads(gpu["metadata"]["annotations"]["vgpu.io/decision"])
    assert slice_["node"] == node, slice_
    assert slice_["containers"][0]["devices"] == [
        {"uuid": uuid, "memoryBytes": 10 << 30, "coresPercent": 0}], slice_

    def wanting_8_gib(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NAMESPACE, "annotations": {"nvidia.com/use-gpuuuid": uuid}},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "main", "image": "cuda:test",
                                         "command": [sys.executable, str(FILL), "64"],
                                         "resources": {"limits": {"nvidia.com/gpu": "1",
                                                                  "nvidia.com/gpumem": "8192"}}}]}}

    def failed_scheduling(name: str) -> str | None:
        events = kubectl_json(cluster, "get", "events", "-n", NAMESPACE,
                              "--field-selector", f"involvedObject.name={name},reason=FailedScheduling")["items"]
        return events[-1]["message"] if events else None
    cluster.kubectl("create", "-f", "-", input=json.dumps(wanting_8_gib("crowded")))
    why = wait_for("crowded turned down", lambda: failed_scheduling("crowded"), timeout=60, log=cc.logs)
    assert f"{uuid} has 6144 MiB free, container needs 8192 MiB" in why, why
    assert not kubectl_json(cluster, "get", "pod", "crowded", "-n", NAMESPACE)["spec"].get("nodeName"), why

    # The claim's pod: on the held GPU, at the claim's cap.
    cluster.kubectl("create", "-f", "-", input=json.dumps(readme_pod("holder", "big")))
    pod = wait_for("holder running", lambda: (lambda p: p if p["status"].get("phase") == "Running" else None)(
        kubectl_json(cluster, "get", "pod", "holder", "-n", NAMESPACE)), timeout=90, log=cc.logs)
    decision = json.loads(pod["metadata"]["annotations"]["vgpu.io/decision"])
    assert decision["node"] == node and decision["containers"][0]["devices"][0]["uuid"] == uuid, decision
    assert report(cc, pod, "test-cuda")["device_totals_mib"] == [10240]

    cluster.kubectl("delete", "pod", "holder", "crowded", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    cluster.kubectl("delete", "elasticgpuclaim", "big", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    cluster.kubectl("create", "-f", "-", input=json.dumps(wanting_8_gib("fits")))
    wait_for("the 8 GiB pod placed once the claim is gone", lambda: kubectl_json(
        cluster, "get", "pod", "fits", "-n", NAMESPACE)["spec"].get("nodeName"), timeout=60, log=cc.logs)
    cluster.kubectl("delete", "pod", "fits", "-n", NAMESPACE, "--wait=false")
    cluster.kubectl("delete", "elasticgpuclass", "held")
