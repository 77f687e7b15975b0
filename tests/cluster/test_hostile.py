"""A hostile tenant, and a node agent's stolen identity, against the chart
on simulated nodes under the real control plane (kube-apiserver 1.36 with
RBAC, the chart installed by the real helm): each attack is a test that
the chart without its admission policy (admissionPolicy.enabled=false, or
the chart before it had one) lets through, and that the chart refuses.

The tenant is a service account bound to the `admin` ClusterRole in its own
namespace: every right a namespace owner has. Its pods ask for vGPUs as
HAMi's pods do, so the webhook sends them to vgpu's scheduler.

- It rewrites or removes the decision of its running pod (memoryBytes 0 is
  uncapped in the region): refused.
- It creates a pod that carries a decision and an allocation record:
  refused.
- It creates a pod naming its node itself (spec.nodeName, which no
  scheduler then checks) with a forged decision for that node's GPU:
  refused.
- It creates, while admission is not in force (as before the install), a
  privileged vGPU pod and one with no seccomp profile, naming the vgpu
  scheduler itself: neither is placed (the extender checks again).
- The node agent of node-1, with the token its pod has, writes a vGPU
  annotation or a label of a pod on node-2, node-2's Node or node-2's
  Lease: refused; the node agent's account with a token not bound to its
  pod writes no pod at all. On node-1's own pods it changes the
  allocation record and nothing else (not the decision, not a label):
  refused.
- What vgpu itself does still works: the extender places both pods and
  records its decisions, each node's plugin serves its container, the
  node agent of node-1 updates the record of a pod on node-1, the tenant
  sets the annotations users set (vgpu.io/gpu-scheduler-policy) and any
  of its own; and the API server type-checked the policies without a
  warning.

One control plane and one chart install serve every test (module fixture);
the fixture prints how long they took. VGPU_CHART names another chart
directory to run these against (e.g. an older release's, to see the
attacks succeed there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import chartcluster  # noqa: E402
from chartcluster import RELEASE_NAMESPACE, ChartCluster, kubectl_json, wait_for  # noqa: E402
from controlplane import kubeconfig  # noqa: E402

if os.environ.get("VGPU_CHART"):
    chartcluster.CHART = Path(os.environ["VGPU_CHART"]).resolve()

TENANT = "tenant"
RELEASE = "vgpu"
NODE_ACCOUNT = f"{RELEASE}-node"
DECISION = "vgpu.io/decision"
ALLOCATED = "vgpu.io/allocated"
HIGH_CLASS = "vgpu-inference"


class Hostile:
    """The running cluster and the identities the attacks use."""

    def __init__(self, cc: ChartCluster, workdir: Path):
        self.cc = cc
        self.workdir = workdir
        self.tenant = Path()
        self.root = Path()
        self.agent_1 = Path()

    def kubectl(self, identity: Path, *args: str, input: str | None = None):
        return self.cc.cluster.kubectl(*args, kubeconfig=identity, input=input, check=False)

    def pod(self, name: str) -> dict:
        return kubectl_json(self.cc.cluster, "get", "pod", name, "-n", TENANT)

    def annotations(self, name: str) -> dict:
        return self.pod(name)["metadata"].get("annotations", {})


def vgpu_pod(name: str, node: str | None = None, annotations: dict | None = None) -> dict:
    """A pod as a HAMi user writes it: one vGPU of 1 GiB and 10 %."""
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "cuda:test", "command": ["/usr/bin/sleep", "3600"],
                            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024",
                                                     "nvidia.com/gpucores": "10"}}}]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": TENANT, "annotations": annotations or {}}, "spec": spec}


def uncapped(decision_text: str) -> str:
    """The same decision with every grant uncapped and the whole GPU's time."""
    forged = json.loads(decision_text)
    for container in forged["containers"]:
        for device in container["devices"]:
            device["memoryBytes"] = 0
            device["coresPercent"] = 100
    return json.dumps(forged)


def refused_by_policy(done, *words: str) -> None:
    """The API server refused the request, and its admission policy did."""
    assert done.returncode != 0, f"the API server accepted it:\n{done.stdout}"
    for word in ("ValidatingAdmissionPolicy", *words):
        assert word in done.stderr, done.stderr


def patch_status(hostile, identity: Path, node: str, patch: dict):
    """A merge patch of `node`'s status as `identity` (a kubeconfig with a
    token), sent as is: kubectl's patch reads the object first, which a
    node agent's role (patch only) does not allow."""
    user = json.loads(identity.read_text())["users"][0]["user"]
    cluster = hostile.cc.cluster
    script = """
import json, ssl, sys, urllib.error, urllib.request
url, ca, token, body = sys.argv[1:]
request = urllib.request.Request(url, data=body.encode(), method="PATCH", headers={
    "Authorization": "Bearer " + token, "Content-Type": "application/merge-patch+json"})
try:
    with urllib.request.urlopen(request, timeout=10, context=ssl.create_default_context(cafile=ca)) as answer:
        print(answer.status)
except urllib.error.HTTPError as error:
    print(error.code)
    print(error.read().decode(), file=sys.stderr)
"""
    return subprocess.run(cluster.command([
        sys.executable, "-c", script, f"{cluster.server}/api/v1/nodes/{node}/status", str(cluster.pki / "ca.crt"),
        user["token"], json.dumps(patch)]), check=False, capture_output=True, text=True, timeout=60)


def agent_token(cc: ChartCluster, node: str) -> str:
    """The token kubelet mounted into the node agent's pod on `node`: the
    credentials its device plugin and monitor use."""
    pods = kubectl_json(cc.cluster, "get", "pods", "-n", RELEASE_NAMESPACE,
                        "-l", "app.kubernetes.io/component=node")["items"]
    (agent,) = [pod["metadata"]["name"] for pod in pods if pod["spec"].get("nodeName") == node]
    folder = cc.node(node).pod_dir(RELEASE_NAMESPACE, agent)
    assert folder is not None, f"{node} keeps nothing of {agent}"
    (token,) = (folder / "volumes").glob("kube-api-access-*/token")
    return token.read_text().strip()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    started = time.monotonic()
    workdir = tmp_path_factory.mktemp("hostile")
    # The PriorityClass pods may run vGPUs above the default priority with
    # (a chart from before the setting runs without it).
    values = (chartcluster.CHART / "values.yaml").read_text()
    helm_args = ("--set", f"scheduler.highPriorityClasses={{{HIGH_CLASS}}}") if "highPriorityClasses" in values else ()
    with ChartCluster(workdir, nodes=2, gpus=1, helm_args=helm_args) as cc:
        up = time.monotonic() - started
        world = Hostile(cc, workdir)
        cluster = cc.cluster
        cluster.kubectl("create", "namespace", TENANT)
        cluster.kubectl("create", "serviceaccount", "owner", "-n", TENANT)
        cluster.kubectl("create", "rolebinding", "owner", "--clusterrole=admin",
                        f"--serviceaccount={TENANT}:owner", "-n", TENANT)
        world.tenant = cluster.token_kubeconfig(TENANT, "owner", workdir / "tenant.kubeconfig")
        # The same namespace's owner as self-service platforms make it: a
        # Role granting every verb on every resource there.
        cluster.kubectl("create", "serviceaccount", "root", "-n", TENANT)
        cluster.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "everything", "namespace": TENANT},
            "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}))
        cluster.kubectl("create", "rolebinding", "root", "--role=everything", f"--serviceaccount={TENANT}:root",
                        "-n", TENANT)
        world.root = cluster.token_kubeconfig(TENANT, "root", workdir / "root.kubeconfig")
        world.agent_1 = workdir / "agent-1.kubeconfig"
        world.agent_1.write_text(kubeconfig(cluster.server, cluster.pki, {"token": agent_token(cc, "node-1")}))

        # Where the chart has a policy, the API server enforces it a moment
        # after it is stored: wait for that (a server-side dry run of the
        # simplest forgery) so no attack runs before it.
        policies = kubectl_json(cluster, "get", "validatingadmissionpolicies",
                                "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        if policies:
            probe = json.dumps(vgpu_pod("probe", annotations={DECISION: "{}"}))
            wait_for("the admission policy enforced", lambda: cluster.kubectl(
                "create", "--dry-run=server", "-f", "-", input=probe, check=False).returncode != 0,
                timeout=30, log=cc.logs)

        # The tenant's two vGPU pods, one on each node, placed by the chart.
        for index in (1, 2):
            created = world.kubectl(world.tenant, "create", "-f", "-", input=json.dumps(vgpu_pod(
                f"own-{index}", node=f"node-{index}", annotations={"vgpu.io/gpu-scheduler-policy": "binpack"})))
            assert created.returncode == 0, created.stderr
        for index in (1, 2):
            wait_for(f"own-{index} Running", lambda index=index: (
                world.pod(f"own-{index}")["status"].get("phase") == "Running"), timeout=90, log=cc.logs)
        # Each pod's allocation record, for the attacks below to go at: the
        # plugin's, or (where kubelet's status showed the pod admitted
        # before the plugin got to it, and the plugin then wrote none) the
        # same record written by the extender's account, which may.
        as_extender = cluster.token_kubeconfig(RELEASE_NAMESPACE, f"{RELEASE}-scheduler",
                                               workdir / "extender.kubeconfig")
        for index in (1, 2):
            if ALLOCATED not in world.annotations(f"own-{index}"):
                done = world.kubectl(as_extender, "annotate", "--overwrite", "pod", f"own-{index}", "-n", TENANT,
                                     f'{ALLOCATED}=["main"]')
                assert done.returncode == 0, done.stderr
        ready = time.monotonic() - started
        yield world
    print(f"\ntest_hostile: chart cluster up in {up:.1f} s, tenant's pods running at {ready:.1f} s, "
          f"everything (tests and teardown included) {time.monotonic() - started:.1f} s")


def test_a_tenant_cannot_rewrite_the_decision_of_its_running_pod(hostile):
    before = hostile.annotations("own-1")
    forged = hostile.kubectl(hostile.tenant, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                             f"{DECISION}={uncapped(before[DECISION])}")
    refused_by_policy(forged, DECISION)
    removed = hostile.kubectl(hostile.tenant, "annotate", "pod", "own-1", "-n", TENANT, f"{DECISION}-", f"{ALLOCATED}-")
    refused_by_policy(removed, DECISION, ALLOCATED)
    after = hostile.annotations("own-1")
    assert (after[DECISION], after[ALLOCATED]) == (before[DECISION], before[ALLOCATED])


def test_a_tenant_allowed_to_write_pod_status_cannot_rewrite_a_record_through_it(hostile):
    """pods/status may change a pod's annotations too: a tenant given that
    subresource (as a tenant's own controller might be) can neither forge
    nor remove a record through it, while a status write that leaves the
    records alone goes through (kubelets' writes take that path)."""
    cluster = hostile.cc.cluster
    cluster.kubectl("create", "role", "status-writer", "--verb=get,patch,update", "--resource=pods/status",
                    "-n", TENANT)
    cluster.kubectl("create", "rolebinding", "status-writer", "--role=status-writer",
                    f"--serviceaccount={TENANT}:owner", "-n", TENANT)
    before = hostile.annotations("own-1")
    path = ["patch", "pod", "own-1", "-n", TENANT, "--subresource=status", "--type=merge", "-p"]
    forged = hostile.kubectl(hostile.tenant, *path, json.dumps(
        {"metadata": {"annotations": {DECISION: uncapped(before[DECISION])}}}))
    refused_by_policy(forged, DECISION)
    removed = hostile.kubectl(hostile.tenant, *path, json.dumps({"metadata": {"annotations": {ALLOCATED: None}}}))
    refused_by_policy(removed, ALLOCATED)
    harmless = hostile.kubectl(hostile.tenant, *path, json.dumps({"metadata": {"annotations": {"team": "ml"}}}))
    assert harmless.returncode == 0, harmless.stderr
    after = hostile.annotations("own-1")
    assert (after[DECISION], after[ALLOCATED], after["team"]) == (before[DECISION], before[ALLOCATED], "ml")


def test_a_tenant_allowed_to_bind_cannot_carry_a_decision_in_a_binding(hostile):
    """The extender writes a decision in the pod's Binding, whose
    annotations the API server merges into the pod: a tenant that may bind
    its own pods (as one running its own scheduler would) cannot do the
    same with a forged, uncapped decision."""
    cluster = hostile.cc.cluster
    cluster.kubectl("create", "role", "binder", "--verb=create", "--resource=pods/binding", "-n", TENANT)
    cluster.kubectl("create", "rolebinding", "binder", "--role=binder", f"--serviceaccount={TENANT}:owner",
                    "-n", TENANT)
    # A node nobody has: no scheduler binds it meanwhile.
    created = hostile.kubectl(hostile.tenant, "create", "-f", "-",
                              input=json.dumps(vgpu_pod("self-bound", node="nowhere")))
    assert created.returncode == 0, created.stderr
    forged = json.loads(uncapped(hostile.annotations("own-1")[DECISION]))
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "self-bound", "namespace": TENANT, "annotations": {DECISION: json.dumps(forged)}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": forged["node"]}}
    path = f"/api/v1/namespaces/{TENANT}/pods/self-bound/binding"
    bound = hostile.kubectl(hostile.tenant, "create", "--raw", path, "-f", "-", input=json.dumps(binding))
    refused_by_policy(bound, "scheduler extender")
    pod = hostile.pod("self-bound")
    assert not pod["spec"].get("nodeName"), pod["spec"]
    assert DECISION not in hostile.annotations("self-bound")


def test_a_tenant_resizing_its_pod_gets_no_more_than_it_asked_for(hostile):
    """The resize request is the tenant's to write; the answer and the
    decision are not: a request past the pod's own (1 GiB, 10 %) is
    refused by the extender, and a status written by the tenant is refused
    by the API server."""
    before = hostile.annotations("own-1")
    request = "cores=100,memory=80Gi,asked=1"
    asked = hostile.kubectl(hostile.tenant, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                            f"vgpu.io/resize={request}")
    assert asked.returncode == 0, asked.stderr

    def answered():
        text = hostile.annotations("own-1").get("vgpu.io/resize-status")
        status = json.loads(text) if text else None
        return status if status and status["request"] == request else None
    status = wait_for("the extender's answer", answered, timeout=60, log=hostile.cc.logs)
    assert status["outcome"] == "refused", status
    assert "more than the pod asks for" in status["message"], status
    assert hostile.annotations("own-1")[DECISION] == before[DECISION]

    forged = json.dumps({**status, "outcome": "applied", "message": "resized to 100 % compute"})
    written = hostile.kubectl(hostile.tenant, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                              f"vgpu.io/resize-status={forged}")
    refused_by_policy(written, "vgpu.io/resize-status")
    assert hostile.annotations("own-1")[DECISION] == before[DECISION]


def test_a_tenant_cannot_create_a_pod_with_a_decision(hostile):
    forged = uncapped(hostile.annotations("own-1")[DECISION])
    created = hostile.kubectl(hostile.tenant, "create", "-f", "-", input=json.dumps(
        vgpu_pod("forged-create", annotations={DECISION: forged, ALLOCATED: "[]"})))
    try:
        refused_by_policy(created, DECISION, ALLOCATED)
    finally:
        hostile.cc.cluster.kubectl("delete", "pod", "forged-create", "-n", TENANT, "--ignore-not-found",
                                   "--wait=false")


def test_a_tenant_cannot_create_a_pod_on_a_node_with_a_forged_decision(hostile):
    # The whole of node-1's GPU, uncapped, for a pod no scheduler looks at.
    forged = uncapped(hostile.annotations("own-1")[DECISION])
    assert json.loads(forged)["node"] == "node-1"
    pod = vgpu_pod("forged-node", annotations={DECISION: forged})
    pod["spec"]["nodeName"] = "node-1"
    created = hostile.kubectl(hostile.tenant, "create", "-f", "-", input=json.dumps(pod))
    try:
        refused_by_policy(created, DECISION)
    finally:
        hostile.cc.cluster.kubectl("delete", "pod", "forged-node", "-n", TENANT, "--ignore-not-found",
                                   "--wait=false")


def test_a_pod_created_while_admission_was_not_in_force_gets_no_vgpus(hostile):
    """Admission refuses a privileged vGPU container and gives an
    unprofiled one RuntimeDefault, but only for pods created while it is
    in force: not before the install, nor in the second after it before
    the API server applies new policies. A tenant who creates such pods
    then, naming the vgpu scheduler itself, still gets no decision: the
    extender checks again at placement, and says why in the pod's events.
    Here the policies' bindings are deleted, as before the install."""
    cluster = hostile.cc.cluster
    bindings = {kind: [item for item in kubectl_json(cluster, "get", kind, "-l",
                                                      f"app.kubernetes.io/instance={RELEASE}")["items"]
                       if item["metadata"]["name"].endswith(("-vgpu-pods", "-vgpu-confinement"))]
                for kind in ("mutatingadmissionpolicybindings", "validatingadmissionpolicybindings")}
    assert all(bindings.values()), bindings
    privileged = vgpu_pod("privileged")
    privileged["spec"]["schedulerName"] = "vgpu-scheduler"
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True,
                                                              "seccompProfile": {"type": "RuntimeDefault"}}
    unprofiled = vgpu_pod("unprofiled")
    unprofiled["spec"]["schedulerName"] = "vgpu-scheduler"

    def admitted(pod: dict) -> bool:
        return hostile.kubectl(hostile.tenant, "create", "--dry-run=server", "-f", "-",
                               input=json.dumps(pod)).returncode == 0

    assert not admitted(privileged), "admission let a privileged vGPU container through"
    for kind, items in bindings.items():
        for item in items:
            cluster.kubectl("delete", kind, item["metadata"]["name"])
    try:
        wait_for("the admission policies out of force", lambda: admitted(privileged), timeout=60, log=hostile.cc.logs)
        for pod in (privileged, unprofiled):
            created = hostile.kubectl(hostile.tenant, "create", "-f", "-", input=json.dumps(pod))
            assert created.returncode == 0, created.stderr

        def refusal(name: str) -> str | None:
            events = kubectl_json(cluster, "get", "events", "-n", TENANT,
                                  "--field-selector", f"involvedObject.name={name},reason=FailedScheduling")
            return next((event["message"] for event in events["items"]
                         if "not admitted by vgpu" in event["message"]), None)
        why = wait_for("the privileged pod's refusal", lambda: refusal("privileged"), timeout=60, log=hostile.cc.logs)
        assert "container main asks for vGPUs and is privileged" in why, why
        why = wait_for("the unprofiled pod's refusal", lambda: refusal("unprofiled"), timeout=60, log=hostile.cc.logs)
        assert "names no seccomp profile" in why, why
        for name in ("privileged", "unprofiled"):
            pod = hostile.pod(name)
            assert not pod["spec"].get("nodeName"), pod["spec"]
            assert DECISION not in pod["metadata"].get("annotations", {}), pod["metadata"]
    finally:
        for name in ("privileged", "unprofiled"):
            cluster.kubectl("delete", "pod", name, "-n", TENANT, "--ignore-not-found", "--wait=false")
        for items in bindings.values():
            for item in items:
                for key in ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields"):
                    item["metadata"].pop(key, None)
                cluster.kubectl("create", "-f", "-", input=json.dumps(item))
        wait_for("the admission policies in force again", lambda: not admitted(privileged), timeout=60,
                 log=hostile.cc.logs)


def test_a_node_agent_cannot_write_a_pod_on_another_node(hostile):
    own_2 = hostile.pod("own-2")
    assert own_2["spec"]["nodeName"] == "node-2"
    record = own_2["metadata"]["annotations"][ALLOCATED]
    # node-1's agent, with its own pod's token, rewrites the record of a pod
    # on node-2 (a plugin then serves its containers again), or its labels
    # (what Services select).
    rewritten = hostile.kubectl(hostile.agent_1, "annotate", "--overwrite", "pod", "own-2", "-n", TENANT,
                                f"{ALLOCATED}=[]")
    refused_by_policy(rewritten, "node-1")
    relabelled = hostile.kubectl(hostile.agent_1, "label", "pod", "own-2", "-n", TENANT, "app=stolen")
    refused_by_policy(relabelled, "node-1")
    # The node agent's account with a token not bound to its pod (made by
    # anyone who may create tokens for it) names no node: it writes no pod,
    # not even on node-1.
    unbound = hostile.cc.cluster.token_kubeconfig(RELEASE_NAMESPACE, NODE_ACCOUNT,
                                                  hostile.workdir / "unbound-agent.kubeconfig")
    own_1_record = hostile.annotations("own-1")[ALLOCATED]
    anywhere = hostile.kubectl(unbound, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT, f"{ALLOCATED}=[]")
    refused_by_policy(anywhere, "names none")
    assert hostile.annotations("own-2")[ALLOCATED] == record
    assert hostile.annotations("own-1")[ALLOCATED] == own_1_record
    assert "app" not in hostile.pod("own-2")["metadata"].get("labels", {})


def test_a_node_agent_changes_nothing_but_the_allocation_record_of_its_own_nodes_pods(hostile):
    # node-1's agent on node-1's pod: its decision (the grant the plugin
    # serves and the monitor restores), its labels, another annotation.
    own_1 = hostile.pod("own-1")
    assert own_1["spec"]["nodeName"] == "node-1"
    forged = uncapped(own_1["metadata"]["annotations"][DECISION])
    decision = hostile.kubectl(hostile.agent_1, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                               f"{DECISION}={forged}")
    refused_by_policy(decision, "vgpu.io/allocated annotation")
    relabelled = hostile.kubectl(hostile.agent_1, "label", "pod", "own-1", "-n", TENANT, "app=stolen")
    refused_by_policy(relabelled, "vgpu.io/allocated annotation")
    # With its record, in one write: still refused.
    both = hostile.kubectl(hostile.agent_1, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                           f"{ALLOCATED}=[]", "team=stolen")
    refused_by_policy(both, "vgpu.io/allocated annotation")
    after = hostile.pod("own-1")
    assert after["metadata"]["annotations"][DECISION] == own_1["metadata"]["annotations"][DECISION]
    assert after["metadata"]["annotations"][ALLOCATED] == own_1["metadata"]["annotations"][ALLOCATED]
    assert after["metadata"]["annotations"].get("team") != "stolen"
    assert after["metadata"].get("labels", {}).get("app") != "stolen"


def test_a_node_agent_cannot_write_another_nodes_node_or_lease(hostile):
    cluster = hostile.cc.cluster
    inventory = kubectl_json(cluster, "get", "node", "node-2")["metadata"]["annotations"]["vgpu.io/node-gpus"]
    node = hostile.kubectl(hostile.agent_1, "annotate", "--overwrite", "node", "node-2",
                           'vgpu.io/node-gpus={"version":1,"gpus":[]}')
    refused_by_policy(node, "node-1")
    lease = hostile.kubectl(hostile.agent_1, "patch", "lease", "vgpu-node-2", "-n", "kube-node-lease",
                            "--type=merge", "-p", '{"spec":{"holderIdentity":"node-1"}}')
    refused_by_policy(lease, "node-1")
    assert kubectl_json(cluster, "get", "node", "node-2")["metadata"]["annotations"]["vgpu.io/node-gpus"] == inventory
    holder = kubectl_json(cluster, "get", "lease", "vgpu-node-2", "-n", "kube-node-lease")["spec"]["holderIdentity"]
    assert holder == "node-2"
    # Its own Lease, held in another node's name, would keep that node
    # alive in the extender's eyes (it goes by the holder).
    own = hostile.kubectl(hostile.agent_1, "patch", "lease", "vgpu-node-1", "-n", "kube-node-lease",
                          "--type=merge", "-p", '{"spec":{"holderIdentity":"node-2"}}')
    refused_by_policy(own, "node-1")
    holder = kubectl_json(cluster, "get", "lease", "vgpu-node-1", "-n", "kube-node-lease")["spec"]["holderIdentity"]
    assert holder == "node-1"


def test_a_tenant_cannot_switch_vgpu_admission_off_for_its_own_namespace(hostile):
    """A namespace owner whose Role grants `*` on `*` in its namespace (as
    self-service platforms give) may write that Namespace object itself:
    labelling it vgpu.io/webhook=ignore would turn off vgpu's webhook, the
    API server's policies on its vGPU pods and the extender's checks at
    placement. Only a cluster administrator sets or removes vgpu's labels."""
    cluster = hostile.cc.cluster
    root = hostile.root
    # The Role reaches the namespace's own object: other labels go through.
    done = hostile.kubectl(root, "label", "namespace", TENANT, "team=ml")
    assert done.returncode == 0, done.stderr
    for label in ("vgpu.io/webhook=ignore", "vgpu.io/anything=else"):
        refused_by_policy(hostile.kubectl(root, "label", "namespace", TENANT, label), "cluster administrator")
    labels = kubectl_json(cluster, "get", "namespace", TENANT)["metadata"]["labels"]
    assert labels["team"] == "ml" and not any(k.startswith("vgpu.io/") for k in labels), labels
    # A cluster administrator sets it and removes it; the tenant cannot
    # remove it either.
    cluster.kubectl("label", "namespace", TENANT, "vgpu.io/webhook=ignore")
    try:
        refused_by_policy(hostile.kubectl(root, "label", "namespace", TENANT, "vgpu.io/webhook-"),
                          "cluster administrator")
        assert kubectl_json(cluster, "get", "namespace", TENANT)["metadata"]["labels"]["vgpu.io/webhook"] == "ignore"
    finally:
        cluster.kubectl("label", "namespace", TENANT, "vgpu.io/webhook-")
    assert "vgpu.io/webhook" not in kubectl_json(cluster, "get", "namespace", TENANT)["metadata"]["labels"]


def test_a_tenant_cannot_end_its_running_vgpu_pod_by_its_own_word(hostile):
    """A pod that ended (Succeeded or Failed) no longer holds its GPUs in
    the extender's books. A tenant allowed to write pods/status (its Role
    grants `*`) marking its running pod Succeeded would have that room sold
    again while the pod runs on: only the pod's node (kubelet) and
    cluster-wide controllers end a vGPU pod."""
    for phase in ("Succeeded", "Failed"):
        forged = hostile.kubectl(hostile.root, "patch", "pod", "own-1", "-n", TENANT, "--subresource=status",
                                 "--type=merge", "-p", json.dumps({"status": {"phase": phase}}))
        refused_by_policy(forged, "on node node-1: only that node's kubelet")
    assert hostile.pod("own-1")["status"]["phase"] == "Running"
    # Its other status writes (a condition of its own) still go through.
    done = hostile.kubectl(hostile.root, "patch", "pod", "own-1", "-n", TENANT, "--subresource=status",
                           "--type=strategic", "-p", json.dumps({"status": {"conditions": [
                               {"type": "example.com/Warm", "status": "True"}]}}))
    assert done.returncode == 0, done.stderr
    assert hostile.pod("own-1")["status"]["phase"] == "Running"


def test_a_tenant_cannot_give_its_vgpu_pod_the_reach_to_undo_the_shim_or_touch_its_neighbours(hostile):
    """Beyond privileged and Unconfined (refused before), a vGPU pod asks
    for nothing that reaches past the shim or into other containers' vGPU
    state on its node: a capability beyond Pod Security's baseline
    (SYS_ADMIN unmounts the preload file even under RuntimeDefault),
    /proc unmasked, the node's PID or IPC namespace, a hostPath onto vgpu's
    folder (the regions and grants), a folder holding it, or the node's
    /proc. A sidecar without vGPUs keeps what it asks for."""
    def with_spec(name: str, container: dict | None = None, **spec) -> str:
        pod = vgpu_pod(name)
        pod["spec"]["containers"][0].update(container or {})
        pod["spec"].update(spec)
        return json.dumps(pod)
    attacks = {
        "sys-admin": (with_spec("sys-admin", {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}),
                      "adds the capability SYS_ADMIN"),
        "unmasked": (with_spec("unmasked", {"securityContext": {"procMount": "Unmasked"}}, hostUsers=False),
                     "mounts /proc Unmasked"),
        "host-pid": (with_spec("host-pid", hostPID=True), "sets hostPID"),
        "host-ipc": (with_spec("host-ipc", hostIPC=True), "sets hostIPC"),
        "regions": (with_spec("regions", volumes=[{"name": "r", "hostPath": {"path": "/usr/local/vgpu/containers"}}]),
                    "overlaps /usr/local/vgpu"),
        "usr": (with_spec("usr", volumes=[{"name": "r", "hostPath": {"path": "/usr"}}]), "overlaps /usr/local/vgpu"),
        "proc": (with_spec("proc", volumes=[{"name": "p", "hostPath": {"path": "/proc"}}]), "overlaps /proc"),
    }
    for name, (pod, words) in attacks.items():
        done = hostile.kubectl(hostile.root, "create", "-f", "-", input=pod)
        assert done.returncode != 0, f"{name}: the API server accepted it:\n{done.stdout}"
        assert "ValidatingAdmissionPolicy" in done.stderr and words in done.stderr, (name, done.stderr)
    # What a well-behaved vGPU pod asks for still goes: a baseline
    # capability, a sidecar's own, a hostPath elsewhere (a server-side dry
    # run: nothing is kept).
    fine = with_spec("fine", {"securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}},
                     volumes=[{"name": "data", "hostPath": {"path": "/data"}}])
    fine = json.loads(fine)
    fine["spec"]["containers"].append({"name": "mesh", "image": "cuda:test", "command": ["/usr/bin/sleep", "3600"],
                                       "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}})
    done = hostile.kubectl(hostile.root, "create", "--dry-run=server", "-f", "-", input=json.dumps(fine))
    assert done.returncode == 0, done.stderr


def test_a_tenant_asking_for_the_top_priority_runs_at_the_default_unless_its_class_allows(hostile):
    """nvidia.com/priority: 0 makes the node monitor pause every
    default-priority container of other pods on the GPU while it runs. A
    pod's own word is not enough: the pod runs at the default priority
    (its decision grants none), warned at creation and by a Warning Event;
    a pod of a PriorityClass the chart names keeps it."""
    cluster = hostile.cc.cluster
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": HIGH_CLASS}, "value": 1000}))

    def top_priority_pod(name: str, **spec) -> str:
        pod = vgpu_pod(name)
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/priority"] = "0"
        pod["spec"].update(spec)
        return json.dumps(pod)

    def decided(name: str) -> dict:
        return wait_for(f"{name} decided", lambda: json.loads(hostile.annotations(name).get(DECISION, "null")),
                        timeout=60, log=hostile.cc.logs)

    try:
        loud = hostile.kubectl(hostile.root, "create", "-f", "-", input=top_priority_pod("loud"))
        assert loud.returncode == 0, loud.stderr
        assert decided("loud")["containers"][0].get("priority") is None
        assert "Warning:" in loud.stderr and "its containers main (0) run at the default priority" in loud.stderr, \
            loud.stderr
        events = wait_for("the GPUPriorityLowered Event", lambda: [
            e for e in kubectl_json(cluster, "get", "events", "-n", TENANT)["items"]
            if e["involvedObject"]["name"] == "loud" and e["reason"] == "GPUPriorityLowered"], log=hostile.cc.logs)
        assert events[0]["type"] == "Warning" and "PriorityClasses in scheduler.highPriorityClasses" in \
            events[0]["message"], events[0]
        allowed = hostile.kubectl(hostile.root, "create", "-f", "-",
                                  input=top_priority_pod("allowed", priorityClassName=HIGH_CLASS))
        assert allowed.returncode == 0, allowed.stderr
        assert "default priority" not in allowed.stderr, allowed.stderr
        assert decided("allowed")["containers"][0]["priority"] == 0
    finally:
        hostile.kubectl(hostile.root, "delete", "pod", "loud", "allowed", "-n", TENANT, "--ignore-not-found",
                        "--wait=false")


def test_a_tenant_cannot_name_gpus_itself_in_a_pods_spec(hostile):
    """Under NVIDIA's container runtime (its default accepts the variable in
    unprivileged containers), NVIDIA_VISIBLE_DEVICES=all in a container's
    environment gives it every GPU of its node without the shim: a pod that
    asks for no vGPU meets no other admission of vgpu's. No pod's spec
    names GPUs itself: not a plain pod, not a vGPU container, not through a
    ConfigMap reference, not an ephemeral container added to a running
    pod. (A variable set in an image or through envFrom is the node's to
    refuse: the toolkit's setting, deploy/README.md.)"""
    def plain(name: str, env: list[dict], gpu: bool = False) -> str:
        pod = vgpu_pod(name)
        container = pod["spec"]["containers"][0]
        if not gpu:
            del container["resources"]
        container["env"] = env
        return json.dumps(pod)
    attacks = {
        "no vGPU, every GPU": plain("all-gpus", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
        "a vGPU container naming more": plain("more-gpus", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}],
                                              gpu=True),
        "from a ConfigMap": plain("from-map", [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {
            "configMapKeyRef": {"name": "gpus", "key": "visible"}}}]),
    }
    for what, pod in attacks.items():
        done = hostile.kubectl(hostile.root, "create", "-f", "-", input=pod)
        assert done.returncode != 0, f"{what}: the API server accepted it:\n{done.stdout}"
        assert "ValidatingAdmissionPolicy" in done.stderr and "sets NVIDIA_VISIBLE_DEVICES" in done.stderr, \
            (what, done.stderr)
    debug = hostile.kubectl(hostile.root, "debug", "own-1", "-n", TENANT, "--image=cuda:test", "--container=dbg",
                            "--env=NVIDIA_VISIBLE_DEVICES=all", "--", "/usr/bin/true")
    assert debug.returncode != 0, f"the ephemeral container was added:\n{debug.stdout}"
    assert "sets NVIDIA_VISIBLE_DEVICES" in debug.stderr, debug.stderr
    assert not hostile.pod("own-1")["spec"].get("ephemeralContainers")
    # Asking for no GPU in those words is no one's business.
    done = hostile.kubectl(hostile.root, "create", "--dry-run=server", "-f", "-",
                           input=plain("none", [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]))
    assert done.returncode == 0, done.stderr


def test_a_node_agent_changes_only_vgpus_annotations_and_share_capacities_of_its_own_node(hostile):
    """A node agent's role may patch any Node and its status (RBAC cannot
    name a node): of its own Node it changes vgpu's annotations and the
    share resources' capacities, nothing else: not a label (those under
    node-restriction.kubernetes.io/ place pods that trust them), a taint,
    another annotation, the addresses or the GPU count kubelet reports."""
    cluster = hostile.cc.cluster
    before = kubectl_json(cluster, "get", "node", "node-1")
    agent = hostile.agent_1
    attacks = {
        "a label": ["label", "node", "node-1", "node-restriction.kubernetes.io/trusted=yes"],
        "a taint": ["taint", "node", "node-1", "dedicated=tenant:NoSchedule"],
        "another annotation": ["annotate", "node", "node-1", "team=stolen"],
    }
    for what, args in attacks.items():
        done = hostile.kubectl(agent, *args)
        assert done.returncode != 0, f"{what}: the API server accepted it:\n{done.stdout}"
        assert "ValidatingAdmissionPolicy" in done.stderr and "node-1 changes only the vgpu.io/ annotations" in \
            done.stderr, (what, done.stderr)
    status_attacks = {
        "the addresses": {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}},
        "the GPU count": {"status": {"capacity": {"nvidia.com/gpu": "64"}, "allocatable": {"nvidia.com/gpu": "64"}}},
        "a condition": {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Stolen"}]}},
        "a label through the status": {"metadata": {"labels": {"stolen": "yes"}}},
    }
    for what, patch in status_attacks.items():
        done = patch_status(hostile, agent, "node-1", patch)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "403", f"{what}: the API server answered {done.stdout}"
        assert "ValidatingAdmissionPolicy" in done.stderr and "node-1 changes only the capacity and allocatable" in \
            done.stderr, (what, done.stderr)
    after = kubectl_json(cluster, "get", "node", "node-1")
    for field in ("labels", "annotations"):
        assert after["metadata"].get(field) == before["metadata"].get(field), field
    assert after["spec"] == before["spec"]
    assert after["status"]["addresses"] == before["status"]["addresses"]
    assert after["status"]["capacity"].get("nvidia.com/gpu") == before["status"]["capacity"].get("nvidia.com/gpu")
    def ready(node):
        return [(c["status"], c.get("reason")) for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready(after) == ready(before)
    # What the device plugin writes still goes through: vgpu's annotations
    # and the share resources' capacities (each changed, then put back).
    for value in ("vgpu.io/written-by-the-agent=yes", "vgpu.io/written-by-the-agent-"):
        done = hostile.kubectl(agent, "annotate", "--overwrite", "node", "node-1", value)
        assert done.returncode == 0, done.stderr
    assert "vgpu.io/written-by-the-agent" not in kubectl_json(cluster, "get", "node", "node-1")["metadata"][
        "annotations"]
    cores = before["status"]["capacity"]["nvidia.com/gpucores"]
    for value in (str(int(cores) - 1), cores):
        shares = {"nvidia.com/gpucores": value}
        done = patch_status(hostile, agent, "node-1", {"status": {"capacity": shares, "allocatable": shares}})
        assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr
        assert kubectl_json(cluster, "get", "node", "node-1")["status"]["capacity"]["nvidia.com/gpucores"] == value


def test_what_vgpu_and_the_tenant_do_still_works(hostile):
    cluster = hostile.cc.cluster
    # The extender placed both pods and recorded each decision for the
    # node it bound the pod to; each node's plugin served the container
    # (its region on the node is the plugin's record).
    for index in (1, 2):
        pod = hostile.pod(f"own-{index}")
        decision = json.loads(pod["metadata"]["annotations"][DECISION])
        assert decision["node"] == pod["spec"]["nodeName"] == f"node-{index}"
        assert json.loads(pod["metadata"]["annotations"][ALLOCATED]) == ["main"]
        region = (hostile.cc.node(f"node-{index}").host_root / "usr/local/vgpu/containers"
                  / f"{pod['metadata']['uid']}_main" / "region.cache")
        assert region.is_file(), region
        assert pod["metadata"]["annotations"]["vgpu.io/gpu-scheduler-policy"] == "binpack"
    # node-1's agent rewrites the record of its own node's pod (the same
    # list, spelt differently, so the running pod is not disturbed), and
    # puts it back.
    record = hostile.annotations("own-1")[ALLOCATED]
    for value in ('[ "main" ]', record):
        done = hostile.kubectl(hostile.agent_1, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                               f"{ALLOCATED}={value}")
        assert done.returncode == 0, done.stderr
        assert hostile.annotations("own-1")[ALLOCATED] == value
    # The tenant annotates and labels its own pod as it likes, user inputs
    # under vgpu.io/ included.
    done = hostile.kubectl(hostile.tenant, "annotate", "--overwrite", "pod", "own-1", "-n", TENANT,
                           "team=ml", "vgpu.io/gpu-scheduler-policy=spread")
    assert done.returncode == 0, done.stderr
    done = hostile.kubectl(hostile.tenant, "label", "pod", "own-1", "-n", TENANT, "app=trainer")
    assert done.returncode == 0, done.stderr
    # The API server found every expression well typed against the kinds
    # each policy matches (kube-controller-manager's check, in the status).
    policies = {p["metadata"]["name"]: p for p in kubectl_json(
        cluster, "get", "validatingadmissionpolicies", "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]}
    # (vgpu-confinement: the webhook's refusals, the API server's own on 1.36.)
    assert set(policies) == {f"{RELEASE}-pod-records", f"{RELEASE}-binding-records", f"{RELEASE}-node-agents",
                             f"{RELEASE}-namespace-labels", f"{RELEASE}-pod-phase", f"{RELEASE}-gpu-variable",
                             f"{RELEASE}-vgpu-confinement",
                             f"{RELEASE}-vgpu-priority"}

    def checked():
        current = kubectl_json(cluster, "get", "validatingadmissionpolicies",
                               "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
        done = all(p.get("status", {}).get("observedGeneration") == p["metadata"]["generation"] for p in current)
        return current if done else None
    warnings = {policy["metadata"]["name"]: policy["status"].get("typeChecking", {}).get("expressionWarnings", [])
                for policy in wait_for("the policies type-checked", checked, timeout=60, log=hostile.cc.logs)}
    assert warnings == {name: [] for name in policies}, warnings



def test_another_pod_reaches_no_verb_nor_debug_view_of_the_extender(hostile):
    """From the cluster network (where any pod is), the extender's pod
    address answers only its probes and metrics: /bind of a pending pod,
    /filter, /debug/state and the views are not served there (kube-scheduler
    calls them on loopback inside the pod), nor on the webhook port."""
    address = chartcluster.extender_address(hostile.cc)
    victim = vgpu_pod("victim")
    created = hostile.kubectl(hostile.tenant, "create", "-f", "-", input=json.dumps(
        {**victim, "spec": {**victim["spec"], "schedulerName": "nobody"}}))
    assert created.returncode == 0, created.stderr
    uid = hostile.pod("victim")["metadata"]["uid"]
    bind = json.dumps({"PodName": "victim", "PodNamespace": TENANT, "PodUID": uid, "Node": "node-1"})
    plain = f"http://{address}:{chartcluster.EXTENDER_PORT}"
    secure = f"https://{address}:{chartcluster.EXTENDER_SECURE_PORT}"
    calls = [(f"{base}{path}", body) for base in (plain, secure) for path, body in (
        ("/bind", bind), ("/scheduler/bind", bind), ("/filter", "{}"), ("/debug/state", None),
        ("/apis/nvidia-gpu-scheduler/v1/gpupods", None))] + [(f"{plain}/metrics", None)]
    # Run inside the test network, where the pods' addresses are.
    script = """
import json, ssl, sys, urllib.error, urllib.request
context = ssl._create_unverified_context()  # the webhook port's own certificate
out = []
for url, body in json.loads(sys.argv[1]):
    request = urllib.request.Request(url, data=body.encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            out.append(answer.status)
    except urllib.error.HTTPError as error:
        out.append(error.code)
print(json.dumps(out))
"""
    ran = subprocess.run(hostile.cc.cluster.command([sys.executable, "-c", script, json.dumps(calls)]),
                         check=False, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    statuses = dict(zip((url for url, _ in calls), json.loads(ran.stdout), strict=True))
    assert statuses.pop(f"{plain}/metrics") == 200, "Prometheus still scrapes it"
    assert set(statuses.values()) == {404}, statuses
    assert "nodeName" not in hostile.pod("victim")["spec"], "the pod stays unbound"


def node_lease_name(node: str) -> str:
    """The node agent's Lease name for `node`, as cluster/src/node_lease.rs
    makes it: vgpu-<node>, or vgpu-<FNV-1a 64 of the name> when too long."""
    if len("vgpu-") + len(node) <= 253:
        return f"vgpu-{node}"
    hashed = 0xCBF29CE484222325
    for byte in node.encode():
        hashed = ((hashed ^ byte) * 0x100000001B3) % (1 << 64)
    return f"vgpu-{hashed:016x}"


def long_named_agent(hostile, node: str) -> Path:
    """A kubeconfig with the node agent account's token bound to a pod on
    `node` (a Node of that name is made first): what the agent's pod on
    such a node would have."""
    cluster = hostile.cc.cluster
    cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node",
                                                           "metadata": {"name": node}}))
    name = f"long-named-agent-{node[0]}"
    created = json.loads(cluster.kubectl("create", "-n", RELEASE_NAMESPACE, "-o", "json", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"serviceAccountName": NODE_ACCOUNT, "nodeName": node,
                 "containers": [{"name": "agent", "image": "none"}]}})).stdout)
    token = cluster.kubectl("create", "token", NODE_ACCOUNT, "-n", RELEASE_NAMESPACE, "--bound-object-kind=Pod",
                            f"--bound-object-name={name}", f"--bound-object-uid={created['metadata']['uid']}"
                            ).stdout.strip()
    path = hostile.workdir / f"{name}.kubeconfig"
    path.write_text(kubeconfig(cluster.server, cluster.pki, {"token": token}))
    return path


def test_a_node_agent_on_a_long_named_node_holds_only_its_own_hashed_lease(hostile):
    """Node names over 248 characters give the agent's Lease a hashed name
    (vgpu-<16 hex digits>). The agent of such a node writes a Lease of that
    form held by its own node; it cannot take one another node holds, nor
    hold one in another node's name; an agent of a short-named node writes
    none of that form."""
    first = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    second = ".".join(["e" * 63, "f" * 63, "g" * 63, "h" * 61])
    assert len(first) == len(second) == 253
    own = node_lease_name(first)
    assert own != f"vgpu-{first}" and len(own) == len("vgpu-") + 16
    agent_1, agent_2 = long_named_agent(hostile, first), long_named_agent(hostile, second)

    def lease(name: str, holder: str) -> str:
        return json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": name, "namespace": "kube-node-lease"},
                           "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}})
    made = hostile.kubectl(agent_1, "create", "-f", "-", input=lease(own, first))
    assert made.returncode == 0, made.stderr
    renewed = hostile.kubectl(agent_1, "patch", "lease", own, "-n", "kube-node-lease", "--type=merge",
                              "-p", '{"spec":{"leaseDurationSeconds":20}}')
    assert renewed.returncode == 0, renewed.stderr
    # Held in another node's name, by its own agent or the other's.
    refused_by_policy(hostile.kubectl(agent_1, "patch", "lease", own, "-n", "kube-node-lease", "--type=merge",
                                      "-p", json.dumps({"spec": {"holderIdentity": second}})), first[:20])
    refused_by_policy(hostile.kubectl(agent_2, "patch", "lease", own, "-n", "kube-node-lease", "--type=merge",
                                      "-p", json.dumps({"spec": {"holderIdentity": second}})), second[:20])
    # Nor deleted (the agents' role grants no delete; the policy would
    # refuse it too).
    deleted = hostile.kubectl(agent_2, "delete", "lease", own, "-n", "kube-node-lease")
    assert deleted.returncode != 0 and "Forbidden" in deleted.stderr, deleted.stderr
    holder = kubectl_json(hostile.cc.cluster, "get", "lease", own, "-n", "kube-node-lease")["spec"]["holderIdentity"]
    assert holder == first
    # A name of another form, or a hashed one from a short-named node.
    refused_by_policy(hostile.kubectl(agent_1, "create", "-f", "-", input=lease("vgpu-other", first)), first[:20])
    refused_by_policy(hostile.kubectl(hostile.agent_1, "create", "-f", "-",
                                      input=lease("vgpu-0123456789abcdef", "node-1")), "node-1")
