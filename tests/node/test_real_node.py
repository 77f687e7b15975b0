"""vgpu as it is deployed: the image built from deploy/images/Dockerfile,
imported into a real containerd, the chart installed with the real helm,
its pods run by a real kubelet through containerd and runc on a node joined
to the real control plane with a node identity (Node authorizer and
NodeRestriction on). The node's containers get the simulated GPU's driver
the way NVIDIA's runtime mounts the real one; nothing of vgpu knows.

A pod written for HAMi then runs in a real container: its own mount
namespace, the plugin's mounts and environment applied by containerd and
runc, the shim preloaded through the mounted /etc/ld.so.preload."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests/cluster"))
sys.path.insert(0, str(REPO / "tests/common"))
import images  # noqa: E402
from realnode import PAUSE_IMAGE, RealNode, missing_tools  # noqa: E402
from shares import UncappedRun, assert_share  # noqa: E402

from chartcluster import RELEASE_NAMESPACE, compile_workload, extender_endpoint_ready, kubectl_json  # noqa: E402
from controlplane import ControlPlane, ControlPlaneError, wait_for  # noqa: E402
from nodenet import TestNetwork  # noqa: E402
from placement import count  # noqa: E402

CHART = REPO / "deploy/helm/vgpu"
# The PriorityClass whose pods may run vGPUs above the default priority.
IMPORTANT_CLASS = "vgpu-test-important"
TARGET = images.TARGET
WORKLOADS_IMAGE = "localhost/vgpu-workloads:test"
CUDA_ENV_IMAGE = "localhost/vgpu-workloads-cuda-env:test"
MIB = 1 << 20


def unavailable(reason: str):
    # CI runs as root with everything scripts/test installs: a skip there
    # would hide a test that never ran.
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(reason)


def chart_image() -> str:
    """What the chart's default image (repository `vgpu`, the chart's
    appVersion) names, as containerd normalizes it."""
    version = re.search(r'^appVersion:\s*"?([^"\s]+)"?', (CHART / "Chart.yaml").read_text(), re.M)
    assert version, "Chart.yaml has no appVersion"
    return f"docker.io/library/vgpu:{version.group(1)}"


def compile_program(name: str, source: Path, folder: Path, *flags: str) -> Path:
    program = folder / name
    done = subprocess.run([os.environ.get("CC", "cc"), "-O2", "-Wall", "-Werror", "-Wno-deprecated-declarations",
                           "-I", str(REPO / "testkit/programs"), "-o", str(program), str(source), *flags],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"building {name}: {done.stderr}")
    return program


def build_images(folder: Path, kube_scheduler: Path, kube_version: str) -> list[Path]:
    """Every image the node runs, as docker-archives: vgpu's (the
    Dockerfile), kube-scheduler's (the control plane's binary on the same
    Debian base), the pause image, and the test workloads."""
    buildah = images.Buildah(folder / "buildah")
    base = buildah.debian_base()
    buildah.vgpu(chart_image())
    buildah.assemble(f"registry.k8s.io/kube-scheduler:{kube_version}", base,
                     {"/usr/local/bin/kube-scheduler": kube_scheduler})
    programs = folder / "programs"
    programs.mkdir()
    pause = compile_program("pause", HERE / "pause.c", programs, "-static")
    buildah.assemble(PAUSE_IMAGE, "scratch", {"/pause": pause}, entrypoint=["/pause"])
    probe = compile_program("probe", REPO / "testkit/programs/probe.c", programs, "-ldl")
    workload = compile_program("workload", REPO / "testkit/programs/workload.c", programs, "-ldl", "-lpthread")
    # What root in a container can write into its own region (a test tool
    # of ours, built with the release binaries).
    forge = TARGET / "vgpu-region-forge"
    buildah.assemble(WORKLOADS_IMAGE, base, {"/usr/local/bin/probe": probe, "/usr/local/bin/workload": workload,
                                             "/usr/local/bin/vgpu-region-forge": forge})
    # The same, with the variable CUDA's base images set in their own
    # environment.
    buildah.assemble(CUDA_ENV_IMAGE, WORKLOADS_IMAGE, {}, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    names = [chart_image(), f"registry.k8s.io/kube-scheduler:{kube_version}", PAUSE_IMAGE, WORKLOADS_IMAGE,
             CUDA_ENV_IMAGE]
    archives = [buildah.export(name, folder / f"image-{index}.tar") for index, name in enumerate(names)]
    # buildah's vfs storage keeps a whole copy of every layer (2.6 GB):
    # only the archives are needed from here.
    buildah.remove_storage()
    return archives


def workload_pod(name: str, namespace: str, command: list[str], limits: dict[str, str]) -> dict:
    """A pod of one container `main` running `command` from the workloads
    image with `limits`."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "main", "image": WORKLOADS_IMAGE, "imagePullPolicy": "Never",
                "command": command, "resources": {"limits": limits}}]}}


class RealCluster:
    """The control plane, its real nodes (node-1 first) and the chart."""

    def __init__(self, cluster: ControlPlane, nodes: list[RealNode]):
        self.cluster = cluster
        self.nodes = nodes
        self.node = nodes[0]

    def logs(self) -> str:
        parts = []
        for node in self.nodes:
            parts += [f"--- {node.name} kubelet\n{node.log('kubelet')[-3000:]}",
                      f"--- {node.name} containerd\n{node.log('containerd')[-2000:]}"]
            for log in sorted((node.host / "var/log/pods").glob("*/*/*.log")):
                parts.append(f"--- {node.name} {log.relative_to(node.host)}\n"
                             f"{log.read_text(errors='replace')[-1500:]}")
        parts.append(self.cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout)
        parts.append(self.cluster.kubectl("get", "events", "-A", check=False).stdout[-4000:])
        return "\n".join(parts)

    def run_pod(self, pod: dict, timeout: float = 120) -> dict:
        """Creates `pod` and waits until it runs (or ends)."""
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.cluster.kubectl("create", "namespace", namespace, check=False)
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))

        def started():
            found = kubectl_json(self.cluster, "get", "pod", name, "-n", namespace)
            return found if found["status"].get("phase") in ("Running", "Succeeded", "Failed") else None
        return wait_for(f"pod {namespace}/{name} running", started, timeout=timeout, log=self.logs)

    def wait_until_serving(self) -> None:
        """The node agents ready on both nodes and the extender's pod ready
        behind its Service."""
        def agents_ready():
            pods = kubectl_json(self.cluster, "get", "pods", "-n", RELEASE_NAMESPACE,
                                "-l", "vgpu.io/monitor=true")["items"]
            ready = {pod["spec"].get("nodeName") for pod in pods
                     if any(c["type"] == "Ready" and c["status"] == "True"
                            for c in pod["status"].get("conditions", []))}
            return ready >= {node.name for node in self.nodes}
        wait_for("the node agents ready on every node", agents_ready, timeout=180, log=self.logs)

        wait_for("the extender's pod ready behind its Service", lambda: extender_endpoint_ready(self.cluster),
                 timeout=180, log=self.logs)

    def metrics(self, node: RealNode | None = None) -> str:
        """The /metrics of `node`'s monitor (node-1's by default), read
        from inside the node's network."""
        node = node or self.node
        pods = kubectl_json(self.cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "vgpu.io/monitor=true",
                            "--field-selector", f"spec.nodeName={node.name}")["items"]
        addresses = [pod["status"].get("podIP") for pod in pods if pod["status"].get("phase") == "Running"]
        if not addresses or not addresses[0]:
            return ""
        try:
            return node.get(f"http://{addresses[0]}:31992/metrics")
        except OSError:
            return ""


# The node label (the chart's dra.nodeLabel) that moves a node to DRA.
DRA_NODE_LABEL = "vgpu.io/allocation"


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    """Two real nodes: node-1 offers its GPUs through the device plugin,
    node-2 through the DRA driver."""
    if os.geteuid() != 0:
        unavailable("a real node needs root (namespaces, cgroups, mounts)")
    missing = images.missing_tools() + missing_tools()
    if missing:
        unavailable(f"not installed: {', '.join(missing)}")
    simulated_gpu = TARGET / "libsimgpu.so"
    if not simulated_gpu.is_file():
        pytest.fail(f"{simulated_gpu} is missing: build the release binaries first (scripts/test does)")
    folder = tmp_path_factory.mktemp("real-node")
    with contextlib.ExitStack() as stack:
        hub = stack.enter_context(TestNetwork())
        cluster = stack.enter_context(ControlPlane(folder / "control-plane", network=hub))
        version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
        archives = build_images(folder / "images", cluster.bin / "kube-scheduler", version)
        nodes = [stack.enter_context(RealNode(cluster, hub, index, folder / f"node-{index}",
                                              simulated_gpu=simulated_gpu, labels=labels))
                 for index, labels in ((1, {"gpu": "on"}), (2, {"gpu": "on", DRA_NODE_LABEL: "dra"}))]
        for node in nodes:
            for archive in archives:
                node.import_image(archive)
        for archive in archives:
            archive.unlink()
        running = RealCluster(cluster, nodes)
        # What the NVIDIA container toolkit sets up on a GPU cluster.
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
            "handler": "nvidia"}))
        cluster.helm("install", "vgpu", str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
                     "--set", "image.pullPolicy=Never", "--set", "dra.enabled=true",
                     "--set", f"scheduler.highPriorityClasses={{{IMPORTANT_CLASS}}}")

        def registered():
            plugin = kubectl_json(cluster, "get", "node", nodes[0].name)
            slices = kubectl_json(cluster, "get", "resourceslices")["items"]
            return (int(plugin["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) > 0
                    and any(item["spec"].get("nodeName") == nodes[1].name for item in slices))
        wait_for("the plugin registered with node-1's kubelet, node-2's driver published its slice", registered,
                 timeout=180, log=running.logs)
        running.wait_until_serving()
        yield running


def test_the_chart_runs_on_a_real_node(real_cluster):
    """helm install alone: the node agent's init container put the shim on
    the node's disk, the plugin registered with kubelet and advertises
    split GPUs, the monitor serves in its container; containerd runs them
    from the image built from the Dockerfile."""
    cluster, node = real_cluster.cluster, real_cluster.node
    shipped = images.shipped_shim().read_bytes()
    installed = (node.host / "usr/local/vgpu/libvgpu.so").read_bytes()
    assert installed == shipped, "the shim on the node is not the one shipped"
    found = kubectl_json(cluster, "get", "node", node.name)
    assert found["status"]["capacity"]["nvidia.com/gpu"] == str(node.gpus * 10)
    runtime = found["status"]["nodeInfo"]["containerRuntimeVersion"]
    assert runtime.startswith("containerd://2."), runtime
    inventory = json.loads(found["metadata"]["annotations"]["vgpu.io/node-gpus"])
    assert len(inventory["gpus"]) == node.gpus
    # The plugin offers the share resources in the node's status (the
    # chart's RBAC lets it; NodeRestriction is about kubelet, not it), so
    # kube-scheduler's retry hint sees a node that can hold a vGPU pod.
    gpu_mib = sum(gpu.get("offeredMemoryBytes", gpu["memoryBytes"]) >> 20 for gpu in inventory["gpus"])
    shares = wait_for("the share resources in the node's status", lambda: {
        name: quantity for name, quantity in kubectl_json(cluster, "get", "node", node.name)
        ["status"].get("allocatable", {}).items() if name in (
            "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage")} or None,
        log=real_cluster.logs)
    assert count(shares["nvidia.com/gpumem"]) == gpu_mib, shares
    assert count(shares["nvidia.com/gpucores"]) == 100 * node.gpus, shares
    assert count(shares["nvidia.com/gpumem-percentage"]) == 100 * node.gpus, shares
    containers = node.ctr("containers", "list").stdout
    assert chart_image() in containers, containers
    text = wait_for("the monitor serving", real_cluster.metrics, timeout=60, log=real_cluster.logs)
    totals = [line for line in text.splitlines() if line.startswith("vgpu_gpu_memory_total_bytes{")]
    for gpu in inventory["gpus"]:
        assert any(gpu["uuid"] in line for line in totals), (gpu["uuid"], totals)


def report(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and " " not in line.split("=")[0])


# A container's script: one process holds 1 GiB while NVML is asked what
# the container sees, then another fills the device until refused.
CAP_SCRIPT = """
set -e
mkfifo /tmp/hold
probe dlsym hold 1073741824 < /tmp/hold > /tmp/hold.out &
exec 3> /tmp/hold
until grep -q ready /tmp/hold.out 2>/dev/null; do sleep 0.1; done
probe dlsym nvml
exec 3>&-
wait
probe dlsym fill 268435456
echo done=1
sleep infinity
"""


def test_a_hami_pod_runs_in_a_real_container_at_its_cap(real_cluster):
    cluster, node = real_cluster.cluster, real_cluster.node
    pod = workload_pod("hami", "team-a", ["/bin/sh", "-c", CAP_SCRIPT],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"})
    found = real_cluster.run_pod(pod)
    assert found["spec"]["schedulerName"] == "vgpu-scheduler", "the webhook gave the pod our scheduler"
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    text = wait_for("the workload's report", lambda: "done=1" in node.container_log("team-a", "hami", "main")
                    and node.container_log("team-a", "hami", "main"), timeout=60, log=real_cluster.logs)
    seen = report(text)
    print(f"\nin the container: NVML total {int(seen['nvml_total']) // MIB} MiB, {seen['processes']} process(es) "
          f"holding {int(seen['processes_memory']) // MIB} MiB; fill refused ({seen['refusal']}) after "
          f"{int(seen['allocated']) // MIB} MiB, total {int(seen['mem_total']) // MIB} MiB")
    # NVML in the container: a 4096 MiB device, and the holding process
    # with its memory.
    assert int(seen["nvml_total"]) == 4096 * MIB, seen
    assert int(seen["processes"]) >= 1 and int(seen["processes_memory"]) >= 1024 * MIB, seen
    # The CUDA program is refused (CUDA_ERROR_OUT_OF_MEMORY) before the cap
    # and sees the cap as the device's total.
    assert seen["refusal"] == "2", seen
    assert 2048 * MIB <= int(seen["allocated"]) <= 4096 * MIB, seen
    assert int(seen["mem_total"]) == 4096 * MIB, seen

    def named():
        return [line for line in real_cluster.metrics().splitlines()
                if 'namespace="team-a"' in line and 'pod="hami"' in line and 'container="main"' in line]
    assert wait_for("the monitor naming the pod's container", named, timeout=30, log=real_cluster.logs)
    cluster.kubectl("delete", "pod", "hami", "-n", "team-a", "--wait=true", "--timeout=60s")


def measured_share(real_cluster: RealCluster, node: RealNode, namespace: str, pod: str,
                   configured: float) -> tuple[float, float]:
    """The median device time the node's monitor reads for the pod's
    container over five of its one-second windows (after two seconds of
    warm-up), once the monitor shows the configured share; and the device
    time the same program (1 ms kernels back to back) reaches over those
    seconds with no cap, on a simulated GPU of its own on the host: what
    this machine gives it now (shares.UncappedRun)."""
    def figure(name: str):
        for line in real_cluster.metrics(node).splitlines():
            if line.startswith(name + "{") and f'namespace="{namespace}"' in line and f'pod="{pod}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return None
    assert wait_for("the configured share", lambda: figure("vgpu_container_compute_share_ratio"),
                    timeout=60, log=real_cluster.logs) == pytest.approx(configured)
    assert wait_for("a utilization reading", lambda: figure("vgpu_container_utilization_ratio") is not None,
                    timeout=60, log=real_cluster.logs)
    workdir = real_cluster.cluster.workdir
    program = compile_workload("workload", workdir, source=REPO / "testkit/programs/workload.c")
    uncapped = UncappedRun(program, ["sync", "k1ms", "7"], TARGET / "libsimgpu.so", workdir)
    started = time.monotonic()
    readings = []
    while time.monotonic() - started < 7:
        value = figure("vgpu_container_utilization_ratio")
        if time.monotonic() - started >= 2 and value is not None:
            readings.append(value)
        time.sleep(0.5)  # a sampling interval, not a wait for anything
    assert readings, "no utilization readings"
    return statistics.median(readings), uncapped.launches() / 7000


def test_a_hami_pod_is_held_at_its_compute_share(real_cluster):
    """`gpucores: 30` in a real container: 1 ms kernels back to back; the
    device time it gets, as the node's monitor reads it through NVML (not
    from the shim), is held near 30 % of the device."""
    cluster, node = real_cluster.cluster, real_cluster.node
    pod = workload_pod("share", "team-b", ["workload", "sync", "k1ms", "60"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"})
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    wait_for("the workload ready", lambda: "ready" in node.container_log("team-b", "share", "main"),
             timeout=30, log=real_cluster.logs)

    achieved, uncapped = measured_share(real_cluster, node, "team-b", "share", 0.30)
    print(f"\ngpucores 30 in a real container: {achieved:.3f} of the device (median of the monitor's readings; "
          f"uncapped beside it: {uncapped:.3f})")
    assert_share("gpucores 30 in a real container", 100 * achieved, 30, 100 * uncapped, tolerance=8)
    cluster.kubectl("delete", "pod", "share", "-n", "team-b", "--wait=true", "--timeout=60s")


FILL_SCRIPT = "probe dlsym fill 268435456; echo done=1; sleep infinity"


def test_a_non_root_pod_with_a_read_only_root_and_two_containers_is_held(real_cluster):
    """Each container of a pod running as user 1000 on a read-only root
    filesystem gets its own cap, through the preload file the plugin
    mounts and the region it writes."""
    cluster, node = real_cluster.cluster, real_cluster.node
    containers = [{
        "name": name, "image": WORKLOADS_IMAGE, "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", FILL_SCRIPT],
        "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
        "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mib)}}}
        for name, mib in (("first", 2048), ("second", 1024))]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "locked", "namespace": "team-c"},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": containers}}
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    for name, mib in (("first", 2048), ("second", 1024)):
        text = wait_for(f"{name}'s report", lambda name=name: "done=1" in node.container_log("team-c", "locked", name)
                        and node.container_log("team-c", "locked", name), timeout=60, log=real_cluster.logs)
        seen = report(text)
        assert "refusal" in seen, f"{name}: {text}"
        print(f"\nuser 1000, read-only root, container {name}: refused ({seen['refusal']}) after "
              f"{int(seen['allocated']) // MIB} MiB of a {mib} MiB cap, total {int(seen['mem_total']) // MIB} MiB")
        assert seen["refusal"] == "2", seen
        assert int(seen["mem_total"]) == mib * MIB, seen
        assert mib * MIB // 2 <= int(seen["allocated"]) <= mib * MIB, seen
    cluster.kubectl("delete", "pod", "locked", "-n", "team-c", "--wait=true", "--timeout=60s")


def regions(node: RealNode) -> dict[str, list[dict]]:
    """Every region on the node, with its limits as `vgpu inspect` reads
    them."""
    found = {}
    for path in sorted((node.host / "usr/local/vgpu/containers").glob("*/region.cache")):
        shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"],
                               capture_output=True, text=True, check=True)
        found[path.parent.name] = [device["limits"] for device in json.loads(shown.stdout)["devices"]]
    return found


def test_caps_and_shares_hold_through_restarts_of_kubelet_containerd_and_the_agent(real_cluster):
    """A pod at 30 % with a 1 GiB cap keeps running through a restart of
    kubelet, of containerd, and the deletion of the node agent's pod (its
    DaemonSet brings it back): its region is never lost, its share holds
    after each, and a pod created afterwards is admitted and capped."""
    cluster, node = real_cluster.cluster, real_cluster.node
    pod = workload_pod("steady", "team-d", ["workload", "sync", "k1ms", "3600"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"})
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    wait_for("the workload ready", lambda: "ready" in node.container_log("team-d", "steady", "main"),
             timeout=30, log=real_cluster.logs)
    before = regions(node)
    assert before, "no region on the node"
    shares = {"before": measured_share(real_cluster, node, "team-d", "steady", 0.30)}

    def node_ready():
        conditions = kubectl_json(cluster, "get", "node", node.name)["status"]["conditions"]
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    for component in ("kubelet", "containerd"):
        node.restart(component)
        wait_for(f"{node.name} ready after {component} restarted", node_ready, timeout=120, log=real_cluster.logs)
        real_cluster.wait_until_serving()
        assert regions(node) == before, f"regions changed over a {component} restart"
        shares[component] = measured_share(real_cluster, node, "team-d", "steady", 0.30)

    agent = kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node",
                         "--field-selector", f"spec.nodeName={node.name}")["items"][0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", agent, "-n", RELEASE_NAMESPACE, "--wait=true", "--timeout=60s")
    real_cluster.wait_until_serving()
    assert regions(node) == before, "regions changed when the node agent's pod was replaced"
    shares["agent replaced"] = measured_share(real_cluster, node, "team-d", "steady", 0.30)
    steady = kubectl_json(cluster, "get", "pod", "steady", "-n", "team-d")
    assert steady["status"]["containerStatuses"][0]["restartCount"] == 0, steady["status"]
    print("\n30 % share through restarts: " + ", ".join(
        f"{k} {achieved:.3f} (uncapped beside it {uncapped:.3f})" for k, (achieved, uncapped) in shares.items()))
    for moment, (achieved, uncapped) in shares.items():
        assert_share(f"30 % share {moment}", 100 * achieved, 30, 100 * uncapped, tolerance=8)

    after = workload_pod("after", "team-d", ["/bin/sh", "-c", FILL_SCRIPT],
                         {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2048"})
    assert real_cluster.run_pod(after)["status"]["phase"] == "Running"
    text = wait_for("the new pod's report", lambda: "done=1" in node.container_log("team-d", "after", "main")
                    and node.container_log("team-d", "after", "main"), timeout=60, log=real_cluster.logs)
    seen = report(text)
    assert seen.get("refusal") == "2" and int(seen["mem_total"]) == 2048 * MIB, text
    cluster.kubectl("delete", "pods", "--all", "-n", "team-d", "--wait=true", "--timeout=60s")


def test_a_dra_pod_from_the_readme_template_runs_at_its_cap_and_share(real_cluster):
    """The README's gpu-4gib-30pct claim template on the DRA node: the
    driver's CDI spec, applied by containerd, preloads the shim into the
    container, which is refused at 4 GiB and held at 30 %."""
    cluster, node = real_cluster.cluster, real_cluster.nodes[1]
    cluster.kubectl("create", "namespace", "team-e")
    cluster.kubectl("apply", "-n", "team-e", "-f", str(REPO / "deploy/examples/dra/gpu-4gib-30pct.yaml"))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "claimed", "namespace": "team-e"},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-4gib-30pct"}],
                    "containers": [{
                        "name": "main", "image": WORKLOADS_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/bin/sh", "-c", "probe dlsym fill 268435456; echo done=1; "
                                    "exec workload sync k1ms 3600"],
                        "resources": {"claims": [{"name": "gpu"}]}}]}}
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    assert found["spec"]["nodeName"] == node.name
    text = wait_for("the claimed pod's report", lambda: "done=1" in node.container_log("team-e", "claimed", "main")
                    and node.container_log("team-e", "claimed", "main"), timeout=60, log=real_cluster.logs)
    seen = report(text)
    assert seen.get("refusal") == "2", text
    assert int(seen["mem_total"]) == 4096 * MIB, seen
    assert 2048 * MIB <= int(seen["allocated"]) <= 4096 * MIB, seen
    # containerd applied the driver's CDI spec: the container's spec
    # carries what the spec names.
    specs = list((node.host / "var/run/cdi").glob("*.json")) + list((node.host / "var/run/cdi").glob("*.yaml"))
    assert specs, "the DRA driver wrote no CDI spec on the node"
    achieved, uncapped = measured_share(real_cluster, node, "team-e", "claimed", 0.30)
    print(f"\nDRA claim from the README's template on a real node: refused after "
          f"{int(seen['allocated']) // MIB} MiB of 4096, {achieved:.3f} of the device at 30 % "
          f"(uncapped beside it: {uncapped:.3f})")
    assert_share("the README's DRA claim at 30 %", 100 * achieved, 30, 100 * uncapped, tolerance=8)
    cluster.kubectl("delete", "pod", "claimed", "-n", "team-e", "--wait=true", "--timeout=60s")


def test_a_whole_gpu_by_extended_resource_with_no_claim_of_the_pods_own(real_cluster):
    """`limits: {vgpu.io/gpu: 1}` on the DRA node (the chart's
    dra.extendedResourceName on the vgpu.io-exclusive class, Kubernetes
    1.36's DRAExtendedResource): kube-scheduler makes the claim, the real
    kubelet has our driver prepare it, and the container gets one whole GPU
    (all the memory the slice offers, the whole compute) in the claim's
    region."""
    cluster, node = real_cluster.cluster, real_cluster.nodes[1]
    exclusive = kubectl_json(cluster, "get", "deviceclass", "vgpu.io-exclusive")
    assert exclusive["spec"].get("extendedResourceName") == "vgpu.io/gpu", exclusive["spec"]
    cluster.kubectl("create", "namespace", "team-x")
    pod = workload_pod("whole", "team-x", ["/bin/sh", "-c", "probe dlsym fill 268435456; echo done=1; "
                                           "sleep infinity"], {"vgpu.io/gpu": "1"})
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    assert found["spec"]["nodeName"] == node.name
    claim_name = (found["status"].get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    assert claim_name, found["status"]
    claim = kubectl_json(cluster, "get", "resourceclaim", claim_name, "-n", "team-x")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == "vgpu.io", result
    # The whole GPU: all the memory its slice offers, the whole compute.
    offered = next(device["capacity"]["memory"]["value"]
                   for item in kubectl_json(cluster, "get", "resourceslices")["items"]
                   if item["spec"]["driver"] == "vgpu.io" and item["spec"].get("nodeName") == node.name
                   for device in item["spec"]["devices"] if device["name"] == result["device"])
    limits = regions(node).get(f"claim-{claim['metadata']['uid']}")
    assert limits == [{"memory": count(offered), "cores": None, "burst": None, "swap": None}], limits
    text = wait_for("the pod's report", lambda: "done=1" in node.container_log("team-x", "whole", "main")
                    and node.container_log("team-x", "whole", "main"), timeout=60, log=real_cluster.logs)
    seen = report(text)
    print(f"\na whole GPU by extended resource on a real node: claim {claim_name} on {result['device']}, "
          f"region {limits[0]}, the program saw {int(seen['mem_total']) // MIB} MiB")
    assert int(seen["mem_total"]) > 1024 * MIB, seen
    cluster.kubectl("delete", "namespace", "team-x", "--wait=true", "--timeout=120s")


# Root in its container, with the rights a container gets by default (no
# CAP_SYS_ADMIN), tries to take the shim away: the read-only mounts the
# plugin gives, and a user namespace in which to mount over the preload
# file (kubelet runs containers without seccomp unless told: this took
# 16 GiB under a 1 GiB cap before the webhook gave vGPU containers the
# runtime's default profile).
ATTACK_SCRIPT = """
attempt() { name=$1; shift; if ( "$@" ) 2>/dev/null; then echo "$name=allowed"; else echo "$name=refused"; fi; }
attempt preload_write sh -c 'printf "" > /etc/ld.so.preload'
attempt preload_umount umount /etc/ld.so.preload
attempt preload_remount mount -o remount,rw,bind /etc/ld.so.preload
attempt library_write cp /bin/true /usr/local/vgpu/libvgpu.so
attempt library_umount umount /usr/local/vgpu/libvgpu.so
attempt user_namespace unshare -Urm sh -c 'mount --bind /dev/null /etc/ld.so.preload'
env -u LD_PRELOAD probe dlsym fill 268435456
echo done=1
sleep infinity
"""


def test_root_in_a_container_cannot_take_the_shim_away(real_cluster):
    """What only a real runtime can show: the plugin's mounts are read-only
    and stay in place against root in the container, and no user namespace
    can be made to mount over them (the webhook gave the container the
    runtime's seccomp profile), so the shim holds a program whatever its
    environment. A vGPU pod asking to run seccomp Unconfined is refused."""
    cluster, node = real_cluster.cluster, real_cluster.node
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}
    pod = workload_pod("attacker", "tenant", ["/bin/sh", "-c", ATTACK_SCRIPT], limits)
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    profile = found["spec"]["containers"][0].get("securityContext", {}).get("seccompProfile")
    assert profile == {"type": "RuntimeDefault"}, found["spec"]["containers"][0]

    def log():
        return node.container_log("tenant", "attacker", "main")
    text = wait_for("the attacker's report", lambda: "done=1" in log() and log(), timeout=60, log=real_cluster.logs)
    seen = report(text)
    for attack in ("preload_write", "preload_umount", "preload_remount", "library_write", "library_umount",
                   "user_namespace"):
        assert seen.get(attack) == "refused", (attack, text)
    assert seen.get("refusal") == "2" and int(seen["mem_total"]) == 1024 * MIB, text
    print(f"\nroot in a container: every attack on the shim refused; the next program was refused after "
          f"{int(seen['allocated']) // MIB} MiB of its 1024 MiB cap")
    cluster.kubectl("delete", "pod", "attacker", "-n", "tenant", "--wait=true", "--timeout=60s")

    unconfined = json.loads(json.dumps(pod))
    unconfined["metadata"]["name"] = "unconfined"
    unconfined["spec"]["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
    refused = cluster.kubectl("create", "-f", "-", input=json.dumps(unconfined), check=False)
    assert refused.returncode != 0, refused.stdout
    assert "Unconfined" in refused.stderr and "container main" in refused.stderr, refused.stderr


# Holds 3 GiB through the driver's entry points from its symbol table (the
# shim never sees it), reports how long it held and how it ended.
ELF_HOLD_SCRIPT = """
mkfifo /tmp/hold
probe elf hold 3221225472 < /tmp/hold > /tmp/elf.out 2>/tmp/elf.err &
held=$!
exec 3> /tmp/hold
until grep -q ready /tmp/elf.out 2>/dev/null; do
    kill -0 $held 2>/dev/null || break
    sleep 0.02
done
start=$(date +%s%N)
status=0
wait $held || status=$?
echo elf_held_ms=$(( ($(date +%s%N) - start) / 1000000 ))
echo elf_status=$status
echo done=1
sleep infinity
"""

# Root in a vGPU container (1 GiB granted) tries every way out of its cap
# the shim's inputs gave it: each fill reports what it got. Then a program
# that finds the driver's entry points itself holds 3 GiB; it must be
# killed by the node's monitor (its exit status and how long it held).
WAYS_OUT_SCRIPT = """
fill() { name=$1; shift; "$@" probe dlsym fill 268435456 > /tmp/$name.out 2>/tmp/$name.err || true;
         echo "${name}_allocated=$(sed -n 's/^allocated=//p' /tmp/$name.out)";
         echo "${name}_refusal=$(sed -n 's/^refusal=//p' /tmp/$name.out)"; }
fill unset env -i PATH=$PATH
fill own_region env CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/mine CUDA_DEVICE_MEMORY_LIMIT=6g CUDA_DEVICE_MEMORY_LIMIT_0=6g
echo own_region_file=$(test -e /tmp/mine && echo made || echo none)
fill reserve env VGPU_CONTEXT_RESERVE=0 GPU_CORE_UTILIZATION_POLICY=disable
vgpu-region-forge --lift > /tmp/forge.out 2>&1 && echo lifted=$(sed -n 's/^lifted=//p' /tmp/forge.out)
fill rewritten env
""" + ELF_HOLD_SCRIPT


def test_root_in_a_container_gets_no_more_than_its_grant_whatever_its_processes_do(real_cluster):
    """The node, not the process, holds the limits: with the shim's
    variables unset (`env -i`), a region and limits of its own, a context
    reserve of 0 and the `disable` policy, its region's limits lifted from
    inside, each program in a real container granted 1 GiB is refused at
    its cap; one that finds the driver's entry points in its symbol table
    (the shim never sees its allocations) and holds 3 GiB is killed by the
    chart's monitor within a second, with a Warning Event on its pod."""
    cluster = real_cluster.cluster
    namespace = "tenant-ways"
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"}
    pod = workload_pod("escaper", namespace, ["/bin/sh", "-c", WAYS_OUT_SCRIPT], limits)
    try:
        escaped(real_cluster, pod)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False)


# Root in a vGPU container grows its region, the one host file it may
# write: 256 MiB written past its end, 256 MiB preallocated beyond it with
# its size left alone. Then the 3 GiB past the shim.
GROW_SCRIPT = """
region=/usr/local/vgpu/container/region.cache
dd if=/dev/zero of=$region bs=1M seek=1 count=256 conv=notrunc,fsync 2>/tmp/dd.err; echo grew=$?
fallocate --keep-size --offset 0 --length 256MiB $region 2>/tmp/fallocate.err; echo swollen=$?
""" + ELF_HOLD_SCRIPT


def test_root_in_a_container_growing_its_region_fills_no_disk_and_keeps_its_grant(real_cluster):
    """Root in a real container granted 1 GiB grows its region file (which
    lies on the node's disk) by 256 MiB past its end and 256 MiB of blocks
    beyond it, then holds 3 GiB past the shim. The chart's monitor repairs
    the file to a region's size and disk within passes, says so in a
    Warning Event, and still holds the container to its grant: the 3 GiB
    process is killed."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-grow"
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"}
    pod = workload_pod("escaper", namespace, ["/bin/sh", "-c", GROW_SCRIPT], limits)
    try:
        found = real_cluster.run_pod(pod)
        assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)

        def log():
            return node.container_log(namespace, "escaper", "main")
        text = wait_for("the grower's report", lambda: "done=1" in log() and log(), timeout=120,
                        log=real_cluster.logs)
        seen = report(text)
        uid = found["metadata"]["uid"]
        path = node.host / "usr/local/vgpu/containers" / f"{uid}_main" / "region.cache"
        stat = path.stat()
        repaired = monitor_figure(real_cluster.metrics(node), "vgpu_monitor_regions_repaired_total")
        print(f"\na region grown from a real container (dd {seen.get('grew')}, fallocate {seen.get('swollen')}): "
              f"now {stat.st_size} bytes, {stat.st_blocks * 512} on disk; {repaired} repair(s); the 3 GiB "
              f"process: exit {seen.get('elf_status')} after {seen.get('elf_held_ms')} ms")
        assert seen.get("grew") == "0" and seen.get("swollen") == "0", text
        assert stat.st_size < MIB and stat.st_blocks * 512 <= 2 * MIB, (stat.st_size, stat.st_blocks)
        assert repaired is not None and repaired >= 2, repaired
        assert seen.get("elf_status") == "137", text
        events = kubectl_json(cluster, "get", "events", "-n", namespace,
                              "--field-selector", "involvedObject.name=escaper")["items"]
        reasons = {e["reason"] for e in events if e["type"] == "Warning"}
        assert {"GPURegionRepaired", "GPUMemoryOverCapKilled"} <= reasons, events
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False)


def escaped(real_cluster: RealCluster, pod: dict) -> None:
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = pod["metadata"]["namespace"]
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)

    def log():
        return node.container_log(namespace, "escaper", "main")
    text = wait_for("the escaper's report", lambda: "done=1" in log() and log(), timeout=120, log=real_cluster.logs)
    seen = report(text)
    print("\nways out of a 1 GiB grant in a real container: " + ", ".join(
        f"{name} {int(seen.get(name + '_allocated') or 0) // MIB} MiB"
        for name in ("unset", "own_region", "reserve", "rewritten"))
        + f"; the program with its own entry points: exit {seen.get('elf_status')} after "
          f"{seen.get('elf_held_ms')} ms holding 3 GiB")
    for name in ("unset", "own_region", "reserve", "rewritten"):
        assert seen.get(f"{name}_refusal") == "2", (name, text)
        assert 0 < int(seen[f"{name}_allocated"]) <= 1024 * MIB, (name, text)
    assert seen.get("own_region_file") == "none", text
    assert seen.get("lifted") == "1", text
    # Killed (SIGKILL: the shell says 137) by the monitor, not refused.
    assert seen.get("elf_status") == "137", text
    assert int(seen["elf_held_ms"]) < 1500, text
    events = kubectl_json(cluster, "get", "events", "-n", namespace,
                          "--field-selector", "involvedObject.name=escaper")["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "GPUMemoryOverCapKilled" for e in events), events
    kills = container_figure(real_cluster.metrics(), "vgpu_container_over_cap_kills_total", namespace, "escaper")
    assert kills == 1, kills


def test_a_container_launching_with_cuda_launch_blocking_is_held_at_its_share(real_cluster):
    """`CUDA_LAUNCH_BLOCKING=1` makes every launch return once its kernel
    has finished; a loop of 1 ms kernels at `gpucores: 30` is still held
    near 30 % of the device, as the node's monitor reads it through NVML."""
    cluster, node = real_cluster.cluster, real_cluster.node
    pod = workload_pod("blocking", "team-blocking", ["workload", "burst", "k1ms", "60"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"})
    pod["spec"]["containers"][0]["env"] = [{"name": "CUDA_LAUNCH_BLOCKING", "value": "1"}]
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    wait_for("the workload ready", lambda: "ready" in node.container_log("team-blocking", "blocking", "main"),
             timeout=30, log=real_cluster.logs)
    achieved, uncapped = measured_share(real_cluster, node, "team-blocking", "blocking", 0.30)
    print(f"\ngpucores 30 with CUDA_LAUNCH_BLOCKING=1 in a real container: {achieved:.3f} of the device "
          f"(uncapped beside it: {uncapped:.3f})")
    assert_share("gpucores 30, CUDA_LAUNCH_BLOCKING=1", 100 * achieved, 30, 100 * uncapped, tolerance=8)
    cluster.kubectl("delete", "pod", "blocking", "-n", "team-blocking", "--wait=true", "--timeout=60s")


def test_a_program_past_the_shim_is_held_to_its_share_beside_a_neighbour(real_cluster):
    """A program in a `gpucores: 30` pod that reads every driver entry point
    from the driver's own symbol table (the shim, preloaded, sees none of
    its launches) runs bursts of short kernels beside a `gpucores: 50` pod
    under the shim, on the same GPU. The chart's monitor pauses it until
    it has paid its time back, with a Warning Event on its pod; each pod's
    device time, as the monitor reads it through NVML (not from the shim),
    over 8 s."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-hog"
    cluster.kubectl("create", "namespace", namespace)
    uuid = node_inventory(cluster, node)["gpus"][0]["uuid"]
    hog = workload_pod("hog", namespace, ["/bin/sh", "-c", "WORKLOAD_DRIVER=elf exec workload burst k20us 3600"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"})
    neighbour = workload_pod("neighbour", namespace, ["workload", "sync", "k1ms", "3600"],
                             {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "50"})
    try:
        for pod in (neighbour, hog):
            pod["metadata"]["annotations"] = {"nvidia.com/use-gpuuuid": uuid}
            found = real_cluster.run_pod(pod)
            assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
        for name in ("neighbour", "hog"):
            wait_for(f"the {name} ready", lambda name=name: "ready" in node.container_log(namespace, name, "main"),
                     timeout=30, log=real_cluster.logs)

        def paused():
            events = kubectl_json(cluster, "get", "events", "-n", namespace,
                                  "--field-selector", "involvedObject.name=hog")["items"]
            return [e for e in events if e["type"] == "Warning" and e["reason"] == "GPUComputeOverShare"]
        events = wait_for("the hog paused by the monitor", paused, timeout=30, log=real_cluster.logs)
        assert "paused until it has paid the time back" in events[0]["message"], events
        time.sleep(2)  # the backstop's first pauses, out of the window measured
        readings: dict[str, list[float]] = {"hog": [], "neighbour": []}
        started = time.monotonic()
        while time.monotonic() - started < 8:
            text = real_cluster.metrics(node)
            for name, values in readings.items():
                value = container_figure(text, "vgpu_container_gpu_time_ratio", namespace, name)
                if value is not None:
                    values.append(value)
            time.sleep(0.5)  # a sampling interval, not a wait for anything
        assert readings["hog"] and readings["neighbour"], readings
        hog_part, neighbour_part = (statistics.median(readings[name]) for name in ("hog", "neighbour"))
        print(f"\na program past the shim at gpucores 30 beside a 50 % pod in real containers: the hog "
              f"{hog_part:.3f}, the neighbour {neighbour_part:.3f} of the device (medians of the monitor's "
              f"NVML readings over 8 s)")
        assert hog_part <= 0.40, readings
        assert neighbour_part >= 0.40, readings
        assert container_figure(real_cluster.metrics(node), "vgpu_container_over_share_total",
                                namespace, "hog") >= 1
        assert container_figure(real_cluster.metrics(node), "vgpu_container_over_share_total",
                                namespace, "neighbour") == 0
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False)


def node_inventory(cluster: ControlPlane, node: RealNode) -> dict:
    """The GPU inventory the device plugin published on `node`."""
    return json.loads(kubectl_json(cluster, "get", "node", node.name)["metadata"]["annotations"]["vgpu.io/node-gpus"])


def container_figure(text: str, name: str, namespace: str, pod: str) -> float | None:
    """A container's series `name` in the monitor's exposition `text`."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'namespace="{namespace}"' in line and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_root_in_a_container_forging_its_region_takes_no_share_and_gets_its_limits_back(real_cluster):
    """Root in a real container writes into the region that limits it (the
    shim needs it writable, so it is): for 40 s, ten times a second, the
    most important priority, the force policy and launches, beside a
    neighbour with the same 50 % of the same GPU; then its own limits
    lifted. The chart's monitor, in its own container, takes priority from
    the decision (the neighbour keeps its share), puts the decision's
    limits back and says so in a Warning Event."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-forge"
    cluster.kubectl("create", "namespace", namespace)
    uuid = node_inventory(cluster, node)["gpus"][0]["uuid"]
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "50"}
    forger = workload_pod("forger", namespace, ["/bin/sh", "-c",
                                                "workload sync k1ms 3600 & "
                                                "vgpu-region-forge --arbitration-for-s 40 --every-ms 100 --lift; "
                                                "wait"], limits)
    neighbour = workload_pod("neighbour", namespace, ["workload", "sync", "k1ms", "3600"], limits)
    for pod in (forger, neighbour):
        pod["metadata"]["annotations"] = {"nvidia.com/use-gpuuuid": uuid}
    for pod in (neighbour, forger):
        found = real_cluster.run_pod(pod)
        assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)

    def log() -> str:
        return node.container_log(namespace, "forger", "main")
    wait_for("the forger writing its region", lambda: "forged=" in log(), timeout=60, log=real_cluster.logs)
    achieved, uncapped = measured_share(real_cluster, node, namespace, "neighbour", 0.50)
    text = real_cluster.metrics(node)
    priority = container_figure(text, "vgpu_container_priority", namespace, "forger")
    print(f"\na region forged from a real container: the neighbour got {achieved:.3f} of the device at 50 % "
          f"(uncapped beside it: {uncapped:.3f}); the forger's priority in force {priority}")
    assert "lifted=1" not in log(), "the forgery went on over the whole measurement"
    assert priority == 1, "the decision's priority (the default), not the region's"
    assert_share("the neighbour of a region forger at 50 %", 100 * achieved, 50, 100 * uncapped, tolerance=8)

    wait_for("the forger lifting its limits", lambda: "lifted=1" in log(), timeout=60, log=real_cluster.logs)
    uid = kubectl_json(cluster, "get", "pod", "forger", "-n", namespace)["metadata"]["uid"]

    def restored():
        found = regions(node).get(f"{uid}_main")
        return found if found and found[0]["memory"] == 1024 * MIB and found[0]["cores"] == 50 else None
    wait_for("the forger's limits put back", restored, timeout=30, log=real_cluster.logs)
    assert container_figure(real_cluster.metrics(node), "vgpu_container_limits_restored_total",
                            namespace, "forger") >= 1
    events = kubectl_json(cluster, "get", "events", "-n", namespace,
                          "--field-selector", "involvedObject.name=forger")["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "RegionLimitsChanged" for e in events), events
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")


def monitor_figure(text: str, name: str) -> float | None:
    """The monitor's own series `name` (no labels) in `text`."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def the_monitor(node: RealNode) -> int:
    """The host PID of the node's one monitor process."""
    pids = wait_for(f"the monitor's process on {node.name}", lambda: node.pids_named("vgpu-monitor"), timeout=60)
    assert len(pids) == 1, f"monitor processes on {node.name}: {pids}"
    return pids[0]


def janitor_threads(pid: int) -> int:
    """Threads of process `pid` named as the monitor names its janitor."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread gone while read
            count += (task / "comm").read_text().strip() == "vgpu-janitor"
    return count


def test_root_in_a_container_holding_its_region_mutex_and_replacing_the_file_costs_the_monitor_no_thread(
        real_cluster):
    """Root in a real container leaves a dead process's memory in its region
    (the monitor's janitor returns such memory under the region's mutex),
    marks the mutex held for ever and tries to replace the region file 100
    times, each a fresh file with the mutex still held: the container has
    the region file alone, a mount, which cannot be replaced. The chart's
    monitor, in its own container on the host's PID namespace, waits once,
    leaves the region alone, and keeps one janitor thread; no pass stalls."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-mutex"
    cluster.kubectl("create", "namespace", namespace)
    monitor = the_monitor(node)
    assert janitor_threads(monitor) == 1
    held_before = monitor_figure(real_cluster.metrics(node), "vgpu_monitor_reclaims_held_total")
    assert held_before is not None
    pod = workload_pod("holder", namespace, ["/bin/sh", "-c",
                                             "probe dlsym fill 268435456 > /dev/null; "
                                             "vgpu-region-forge --hold-mutex --replace 100 --every-ms 100 "
                                             "|| echo replacing=refused; sleep infinity"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"})
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)

    def log() -> str:
        return node.container_log(namespace, "holder", "main")
    wait_for("the mutex held", lambda: "held=1" in log(), timeout=60, log=real_cluster.logs)
    slowest, passes = 0.0, 0
    deadline = time.monotonic() + 90
    while passes < 30:
        assert time.monotonic() < deadline, log()
        text = real_cluster.metrics(node)
        duration = monitor_figure(text, "vgpu_monitor_loop_duration_seconds")
        if duration is not None:
            slowest, passes = max(slowest, duration), passes + 1
        time.sleep(0.2)  # a sampling interval, not a wait for anything
    # The region is a file mounted alone: a rename over it is refused.
    assert "replacing=refused" in log() and "Device or resource busy" in log(), log()
    text = real_cluster.metrics(node)
    held = monitor_figure(text, "vgpu_monitor_reclaims_held_total") - held_before
    threads = janitor_threads(monitor)
    used = container_figure(text, "vgpu_container_memory_used_bytes", namespace, "holder")
    print(f"\na region whose mutex a real container holds (its replacement refused): {int(held)} wait(s) on it, "
          f"{threads} janitor thread(s), the slowest of {passes} passes sampled {1000 * slowest:.1f} ms, "
          f"{used and int(used) // MIB} MiB left charged")
    assert the_monitor(node) == monitor, "the monitor was not restarted"
    assert threads == 1, "no janitor thread added (or left blocked)"
    assert held == 1, "the held mutex cost one wait"
    assert passes >= 10 and slowest < 1, (passes, slowest)
    assert used is not None and used >= 7 * MIB, "the dead process's memory is left alone, still counted"
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")


def effective_cores(node: RealNode, uid: str) -> int | None:
    """The compute share granted now in the region of pod `uid`'s container
    `main`, in percent."""
    path = node.host / f"usr/local/vgpu/containers/{uid}_main/region.cache"
    shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"],
                           capture_output=True, text=True, check=True)
    return json.loads(shown.stdout)["devices"][0]["effective_cores"]


def test_a_monitor_killed_while_it_paused_a_container_gives_its_share_back(real_cluster):
    """A container at 30 % is paused by the monitor while a more important
    one (`nvidia.com/priority: 0`) on its GPU is busy. The monitor is
    SIGKILLed, and the important pod deleted while no monitor runs: the
    paused container stays paused (nobody else undoes it) until kubelet
    restarts the monitor, whose first passes give it its 30 % back."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-priority"
    cluster.kubectl("create", "namespace", namespace)
    uuid = node_inventory(cluster, node)["gpus"][0]["uuid"]
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "30"}
    background = workload_pod("background", namespace, ["workload", "sync", "k1ms", "3600"], limits)
    # Above the default only as a pod of a PriorityClass the chart names.
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": IMPORTANT_CLASS},
        "value": 1000}))
    important = workload_pod("important", namespace, ["workload", "sync", "k1ms", "3600"],
                             dict(limits, **{"nvidia.com/priority": "0"}))
    important["spec"]["priorityClassName"] = IMPORTANT_CLASS
    for pod in (background, important):
        pod["metadata"]["annotations"] = {"nvidia.com/use-gpuuuid": uuid}
        found = real_cluster.run_pod(pod)
        assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    uid = kubectl_json(cluster, "get", "pod", "background", "-n", namespace)["metadata"]["uid"]

    def paused():
        text = real_cluster.metrics(node)
        return container_figure(text, "vgpu_container_compute_effective_ratio", namespace, "background") == 0
    wait_for("the background container paused", paused, timeout=60, log=real_cluster.logs)
    monitor = the_monitor(node)
    os.kill(monitor, signal.SIGKILL)
    killed = time.monotonic()
    assert effective_cores(node, uid) == 0, "paused when the monitor died"
    cluster.kubectl("delete", "pod", "important", "-n", namespace, "--wait=true", "--timeout=60s")
    # No monitor, or one that has not yet passed: still paused.
    still = effective_cores(node, uid)

    def restarted():
        pids = node.pids_named("vgpu-monitor")
        return pids if pids and monitor not in pids else None
    wait_for("kubelet restarting the monitor", restarted, timeout=120, log=real_cluster.logs)

    def given_back():
        return effective_cores(node, uid) == 30
    wait_for("the background container's 30 % back", given_back, timeout=30, log=real_cluster.logs)
    back = time.monotonic() - killed
    restarts = kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "vgpu.io/monitor=true",
                            "--field-selector", f"spec.nodeName={node.name}")["items"][0]["status"]
    monitor_restarts = next(status["restartCount"] for status in restarts["containerStatuses"]
                            if status["name"] == "monitor")
    print(f"\na monitor SIGKILLed while it paused a container: the share was {still} % right after the important "
          f"pod went, back to 30 % {back:.1f} s after the kill (the monitor restarted {monitor_restarts} time(s))")
    assert monitor_restarts >= 1
    achieved, uncapped = measured_share(real_cluster, node, namespace, "background", 0.30)
    assert_share("the formerly paused container at 30 %", 100 * achieved, 30, 100 * uncapped, tolerance=8)
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")


# Root in a DRA claim's container plants, where older drivers kept the
# claim's owner record (its own claim directory), a FIFO, a link to
# /dev/zero and a link to the service-account token the monitor's own
# container has at that path; and looks for the driver's records.
CLAIM_OWNER_SCRIPT = """
probe dlsym fill 268435456 > /dev/null
dir=$(dirname "$CUDA_DEVICE_MEMORY_SHARED_CACHE")
if ls "$dir/../.claims" > /dev/null 2>&1; then echo records=reachable; else echo records=unreachable; fi
rm -f "$dir/claim.owner"; mkfifo "$dir/claim.owner" && echo fifo=1
sleep 3; rm -f "$dir/claim.owner"; ln -s /dev/zero "$dir/claim.owner" && echo zero=1
sleep 3; rm -f "$dir/claim.owner"
ln -s /var/run/secrets/kubernetes.io/serviceaccount/token "$dir/claim.owner" && echo token=1
echo planted=1
exec workload sync k1ms 3600
"""


def test_root_in_a_claims_container_planting_its_owner_file_neither_hangs_nor_leaks_the_monitor(real_cluster):
    """The DRA node's monitor names a claim's region by the driver's record,
    kept where the claim's containers cannot reach; a FIFO, a link to
    /dev/zero and a link to the monitor's own token planted in the claim's
    directory neither stall its passes nor reach its log, and the claim is
    still named by its record and restored from it."""
    cluster, node = real_cluster.cluster, real_cluster.nodes[1]
    namespace = "tenant-claim"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "deploy/examples/dra/gpu-4gib-30pct.yaml"))
    monitor = the_monitor(node)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "planter", "namespace": namespace},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-4gib-30pct"}],
                    "containers": [{
                        "name": "main", "image": WORKLOADS_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/bin/sh", "-c", CLAIM_OWNER_SCRIPT],
                        "resources": {"claims": [{"name": "gpu"}]}}]}}
    found = real_cluster.run_pod(pod)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)

    def log() -> str:
        return node.container_log(namespace, "planter", "main")
    slowest, passes = 0.0, 0
    deadline = time.monotonic() + 90
    while "planted=1" not in log():
        assert time.monotonic() < deadline, log()
        duration = monitor_figure(real_cluster.metrics(node), "vgpu_monitor_loop_duration_seconds")
        if duration is not None:
            slowest, passes = max(slowest, duration), passes + 1
        time.sleep(0.2)  # a sampling interval, not a wait for anything
    seen = report(log())
    assert seen.get("records") == "unreachable" and seen.get("fifo") == seen.get("zero") == seen.get("token") == "1", \
        log()

    def named():
        text = real_cluster.metrics(node)
        return container_figure(text, "vgpu_container_compute_share_ratio", namespace, "planter")
    assert wait_for("the claim named by its record", named, timeout=30, log=real_cluster.logs) == pytest.approx(0.30)
    assert the_monitor(node) == monitor, "the monitor was not restarted"
    monitor_pod = kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "vgpu.io/monitor=true",
                               "--field-selector", f"spec.nodeName={node.name}")["items"][0]["metadata"]
    # The token's volume is a tmpfs kubelet mounted in the node's mount
    # namespace: read it there.
    shown = subprocess.run(node.command(["sh", "-c", f"cat /var/lib/kubelet/pods/{monitor_pod['uid']}/volumes/"
                                         "kubernetes.io~projected/*/token"]),
                           capture_output=True, text=True, check=False)
    secret = shown.stdout.strip()
    assert len(secret) > 100, f"the monitor's token on the node: {shown.stderr}"
    logs = "".join(path.read_text(errors="replace") for path in
                   (node.host / "var/log/pods").glob(f"{RELEASE_NAMESPACE}_{monitor_pod['name']}_*/monitor/*.log"))
    assert logs, "the monitor's log"
    print(f"\na claim's owner file planted as FIFO, /dev/zero and the monitor's token from a real container: the "
          f"driver's records unreachable from it, the slowest of {passes} passes sampled {1000 * slowest:.1f} ms, "
          f"the claim named by its record, the token not in the monitor's log")
    assert secret not in logs and secret[-40:] not in logs
    # Each sample a process in the node's network: a few a second at best.
    assert passes >= 4 and slowest < 1, (passes, slowest)
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")


def test_a_decision_granting_more_than_the_pod_asks_for_is_refused_by_the_node(real_cluster):
    """Behind the admission policy (which lets only vgpu's own accounts
    write a decision), the node checks every decision against what its pod
    asks for. Here the extender's own identity (as if it were taken, or the
    policy switched off) writes an uncapped whole-GPU decision for a pod
    asking for 1 GiB and 10 %, and binds it: the device plugin refuses it at
    Allocate, kubelet fails the pod with that reason and says so in an
    Event, and no container of it ever starts."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace, name = "tenant", "overgranted"
    cluster.kubectl("create", "namespace", namespace, check=False)
    pod = workload_pod(name, namespace, ["/bin/sleep", "3600"],
                       {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024", "nvidia.com/gpucores": "10"})
    pod["spec"]["schedulerName"] = "nobody"  # left for the "extender" below
    cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    inventory = node_inventory(cluster, node)
    gpu = inventory["gpus"][0]
    forged = {"version": 1, "node": node.name, "decidedUnixMs": int(time.time() * 1000), "containers": [
        {"name": "main", "init": False, "priority": None,
         "devices": [{"uuid": gpu["uuid"], "memoryBytes": 0, "coresPercent": 100}]}]}
    extender = f"--as=system:serviceaccount:{RELEASE_NAMESPACE}:vgpu-scheduler"
    cluster.kubectl("annotate", "pod", name, "-n", namespace, extender,
                    f"vgpu.io/decision={json.dumps(forged)}")
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node.name}}
    cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{name}/binding", "-f", "-",
                    extender, input=json.dumps(binding))

    def failed():
        found = kubectl_json(cluster, "get", "pod", name, "-n", namespace)
        return found if found["status"].get("phase") == "Failed" else None
    status = wait_for("kubelet failing the pod", failed, timeout=60, log=real_cluster.logs)["status"]
    print(f"\nthe node refused the decision: {status.get('reason')}: {status.get('message')}")
    assert status.get("reason") == "UnexpectedAdmissionError", status
    assert "does not ask for" in status.get("message", "") and "memory 0 bytes" in status["message"], status
    assert not status.get("containerStatuses"), "no container of it started"
    events = kubectl_json(cluster, "get", "events", "-n", namespace,
                          "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["type"] == "Warning" and "does not ask for" in e.get("message", "") for e in events), events
    uid = kubectl_json(cluster, "get", "pod", name, "-n", namespace)["metadata"]["uid"]
    assert not any(folder.startswith(uid) for folder in regions(node)), "no region was made for it"
    assert "vgpu.io/allocated" not in kubectl_json(cluster, "get", "pod", name, "-n", namespace)["metadata"].get(
        "annotations", {})
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")


def test_five_vgpu_pods_created_at_once_each_get_their_own_limits_from_the_real_kubelet(real_cluster):
    """The extender binds a burst to one node without waiting for each
    pod's admission: the plugin asks the real kubelet's PodResources API
    which of the pending pods it is admitting. Five pods created in one
    request, all on node-1's first GPU, each with its own cap and share:
    every one runs with exactly its own in its region."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "burst"
    cluster.kubectl("create", "namespace", namespace)
    inventory = node_inventory(cluster, node)
    assert inventory.get("severalPending") is True, inventory
    uuid = inventory["gpus"][0]["uuid"]
    asked = {f"p{i}": (1024 + 128 * i, 10 + i) for i in range(5)}
    pods = []
    for name, (mib, cores) in asked.items():
        pod = workload_pod(name, namespace, ["/bin/sleep", "3600"],
                           {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mib), "nvidia.com/gpucores": str(cores)})
        pod["metadata"]["annotations"] = {"nvidia.com/use-gpuuuid": uuid}
        pods.append(pod)
    cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))

    def all_running():
        found = kubectl_json(cluster, "get", "pods", "-n", namespace)["items"]
        phases = {p["metadata"]["name"]: p["status"].get("phase") for p in found}
        assert "Failed" not in phases.values(), json.dumps([p["status"] for p in found], indent=1)
        return found if len(found) == len(asked) and set(phases.values()) == {"Running"} else None
    found = wait_for("the five pods running", all_running, timeout=120, log=real_cluster.logs)
    held = regions(node)
    for pod in found:
        mib, cores = asked[pod["metadata"]["name"]]
        region = held.get(f"{pod['metadata']['uid']}_main")
        assert region and region[0]["memory"] == mib * MIB and region[0]["cores"] == cores, (
            pod["metadata"]["name"], mib, cores, region)
    agent = next(p for p in kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE,
                                         "-l", "app.kubernetes.io/component=node")["items"]
                 if p["spec"]["nodeName"] == node.name)["metadata"]["name"]
    told_apart = node.container_log(RELEASE_NAMESPACE, agent, "device-plugin").count("kubelet is admitting this one")
    print(f"\nfive pods at once on one GPU of a real node: each region holds its own cap and share; "
          f"{told_apart} Allocate call(s) matched among several pending pods by the real kubelet's PodResources API")
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")


def test_a_container_gets_only_the_gpus_its_node_grants_whatever_it_names(real_cluster):
    """NVIDIA's runtime gives a container the GPUs its NVIDIA_VISIBLE_DEVICES
    names, by the toolkit's default even in an unprivileged container: a
    pod that asks for no vGPU but has the variable from a ConfigMap
    (envFrom, which admission cannot read) or from its image (CUDA's base
    images set `all`) gets the driver and every GPU of its node, with no
    shim. With the toolkit set as deploy/README.md says (the variable
    ignored in unprivileged containers, the GPUs read from mounts), neither
    gets a GPU; a vGPU container whose image names every GPU gets the one
    its node granted (the device plugin's mount), and vgpu's node agent,
    started afresh, still sees the node's GPUs (its own mount)."""
    cluster, node = real_cluster.cluster, real_cluster.node
    namespace = "tenant-gpus"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("create", "configmap", "gpus", "-n", namespace, "--from-literal=NVIDIA_VISIBLE_DEVICES=all")
    show = ["sh", "-c", "echo visible=$SIMGPU_VISIBLE_DEVICES; "
            "if [ -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ]; then echo driver=yes; else echo driver=no; fi"]

    def seen(name: str, image: str = WORKLOADS_IMAGE, env_from: bool = False, limits: dict | None = None) -> dict:
        pod = workload_pod(name, namespace, show, limits or {})
        spec = pod["spec"]
        spec["restartPolicy"] = "Never"
        spec["nodeSelector"] = {"kubernetes.io/hostname": node.name}
        spec["containers"][0]["image"] = image
        if not limits:
            del spec["containers"][0]["resources"]
        if env_from:
            spec["containers"][0]["envFrom"] = [{"configMapRef": {"name": "gpus"}}]
        cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
        wait_for(f"{name} done", lambda: kubectl_json(cluster, "get", "pod", name, "-n", namespace)["status"].get(
            "phase") in ("Succeeded", "Failed"), timeout=120, log=real_cluster.logs)
        text = node.container_log(namespace, name, "main")
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    settings_path = node.workdir / "gpu-runtime.json"
    default = settings_path.read_text()
    try:
        # The toolkit's default: the variable is taken from anywhere.
        assert seen("env-from-default", env_from=True) == {"visible": "all", "driver": "yes"}
        # As deploy/README.md says to set it.
        settings_path.write_text(json.dumps({**json.loads(default), "accept_envvar_unprivileged": False,
                                             "accept_volume_mounts": True}))
        assert seen("env-from", env_from=True) == {"visible": "", "driver": "no"}
        assert seen("image-env", image=CUDA_ENV_IMAGE) == {"visible": "", "driver": "no"}
        granted = seen("granted", image=CUDA_ENV_IMAGE, limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1024"})
        decision = json.loads(kubectl_json(cluster, "get", "pod", "granted", "-n", namespace)["metadata"][
            "annotations"]["vgpu.io/decision"])
        assert granted == {"visible": decision["containers"][0]["devices"][0]["uuid"], "driver": "yes"}
        # vgpu's own node agent, started under these settings, still sees
        # every GPU of its node (and publishes them).
        agents = kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "vgpu.io/monitor=true",
                              "--field-selector", f"spec.nodeName={node.name}")["items"]
        before = {agent["metadata"]["uid"] for agent in agents}
        cluster.kubectl("delete", "pod", "-n", RELEASE_NAMESPACE, *[a["metadata"]["name"] for a in agents],
                        "--wait=true", "--timeout=60s")

        def restarted_and_ready():
            pods = kubectl_json(cluster, "get", "pods", "-n", RELEASE_NAMESPACE, "-l", "vgpu.io/monitor=true",
                                "--field-selector", f"spec.nodeName={node.name}")["items"]
            return [p for p in pods if p["metadata"]["uid"] not in before and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        wait_for("node-1's agent restarted and ready", restarted_and_ready, timeout=120, log=real_cluster.logs)
        def every_gpu_measured():
            text = real_cluster.metrics(node)
            totals = [line for line in text.splitlines() if line.startswith("vgpu_gpu_memory_total_bytes{")]
            return totals if len(totals) == len(node_inventory(cluster, node)["gpus"]) == 2 else None
        wait_for("the new monitor measuring both GPUs", every_gpu_measured, timeout=60, log=real_cluster.logs)
    finally:
        settings_path.write_text(default)
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")
