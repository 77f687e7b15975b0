"""The chart installed with the real helm on simulated nodes under the real
control plane, for the cluster tests: `ChartCluster` starts a control plane
in a test network, `nodes` simulated nodes joined to it, creates what a GPU
cluster's set-up provides (the `nvidia` RuntimeClass) and installs
deploy/helm/vgpu, then waits until every node's plugin has registered and
the extender's pod is a ready Service endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHART = REPO / "deploy/helm/vgpu"
TARGET = Path(os.environ.get("VGPU_TARGET_DIR", REPO / "target/release")).resolve()
sys.path.insert(0, str(HERE))
from controlplane import ControlPlane, ControlPlaneError, free_port, wait_for  # noqa: E402
from nodenet import TestNetwork  # noqa: E402
from simnodes import NodeImage, SimulatedNode, enable_forwarding  # noqa: E402

RELEASE_NAMESPACE = "vgpu-system"
# The node label (the chart's dra.nodeLabel) that moves a node to DRA.
DRA_NODE_LABEL = "vgpu.io/allocation"


def shim_library() -> Path:
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    return Path(named).resolve() if named else TARGET / "libvgpu.so"


def image(cluster: ControlPlane, root: Path, shared: list[Path]) -> NodeImage:
    """One root for the chart's two images (ours and kube-scheduler's) and
    the test workloads: our binaries where the Dockerfile puts them, the
    real kube-scheduler on PATH, this Python for the workloads."""
    binaries = {f"/usr/local/bin/{name}": TARGET / name
                for name in ("vgpu-device-plugin", "vgpu-dra", "vgpu-monitor", "vgpu-scheduler")}
    binaries["/usr/local/lib/vgpu/libvgpu.so"] = shim_library()
    binaries["/usr/local/bin/kube-scheduler"] = cluster.bin / "kube-scheduler"
    for path in binaries.values():
        if not path.is_file():
            raise ControlPlaneError(f"{path} is missing: build the release binaries first (scripts/test does)")
    python = Path(sys.base_prefix).resolve()
    extra = [] if str(python).startswith("/usr") else [python]
    return NodeImage(root, binaries, [*shared, REPO, *extra])


# The extender's ports (the chart's defaults): plain HTTP for kube-scheduler
# and metrics, HTTPS for the API server's webhooks.
EXTENDER_PORT = 39999
EXTENDER_SECURE_PORT = 39443


def extender_address(cc: ChartCluster) -> str:
    """The pod IP of the one running extender (reachable from the test
    network)."""
    pods = kubectl_json(cc.cluster, "get", "pods", "-n", RELEASE_NAMESPACE,
                        "-l", "app.kubernetes.io/component=scheduler")["items"]
    running = [pod for pod in pods if pod["status"].get("phase") == "Running" and pod["status"].get("podIP")]
    if len(running) != 1:
        raise AssertionError(f"expected one running scheduler pod, found {len(running)}")
    return running[0]["status"]["podIP"]


def pids_of(pod: str, program: str) -> list[int]:
    """Processes of container program `program` in pod `pod` (simulated
    containers carry HOSTNAME=<pod name>, as kubelet's do)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.path.basename(os.readlink(entry / "exe")) != program:
                continue
            if f"HOSTNAME={pod}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_9(pod: str, program: str) -> None:
    pids = pids_of(pod, program)
    assert pids, f"no {program} process in pod {pod}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def extra_kube_scheduler(cc: ChartCluster, name: str, extender: dict):
    """A kube-scheduler of the cluster's own beside the chart's, with one
    profile `name` calling `extender` (a KubeSchedulerConfiguration
    extender stanza); yields its log's path and stops it at the end."""
    workdir = cc.workdir / name
    workdir.mkdir(exist_ok=True)
    config = workdir / "config.yaml"
    config.write_text(json.dumps({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cc.cluster.admin_kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": name}],
        "extenders": [extender],
    }))
    log_path = workdir / "kube-scheduler.log"
    log = open(log_path, "w")  # noqa: SIM115 -- open while it runs
    scheduler = subprocess.Popen(cc.cluster.command([
        str(cc.cluster.bin / "kube-scheduler"), f"--config={config}", "--bind-address=127.0.0.1",
        f"--secure-port={free_port()}", "--v=2"]), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        yield log_path
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=30)


def extender_endpoint_ready(cluster: ControlPlane) -> bool:
    """Whether the extender's Service has a ready endpoint (the API server
    can call the webhook)."""
    slices = kubectl_json(cluster, "get", "endpointslices", "-n", RELEASE_NAMESPACE)["items"]
    return any(endpoint.get("conditions", {}).get("ready") for item in slices
               if item["metadata"]["labels"].get("kubernetes.io/service-name", "").endswith("-scheduler")
               for endpoint in item.get("endpoints") or [])


def kubectl_json(cluster: ControlPlane, *args: str):
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


class ChartCluster:
    """A control plane, `nodes` simulated nodes and the chart installed
    with the real helm, its pods running on those nodes."""

    def __init__(self, workdir: Path, nodes: int, gpus: int = 2, memory: str = "16Gi", helm_args: tuple = (),
                 gpu_names: tuple = (), gpu_env: dict[str, str] | None = None, dra_nodes: int = 0,
                 audit_policy: dict | None = None, controller_manager_args: tuple[str, ...] = ()):
        """`gpu_names[i]`, where given, names node i+1's GPUs; `gpu_env`
        sets up every node's simulated GPUs further. The first `dra_nodes`
        nodes are labelled to offer their GPUs through the DRA driver (the
        chart is then installed with it); the others run the device plugin.
        `audit_policy`: what the API server logs, `controller_manager_args`:
        kube-controller-manager's extra flags (ControlPlane)."""
        self.audit_policy = audit_policy
        self.controller_manager_args = controller_manager_args
        self.dra_nodes = dra_nodes
        self.gpu_env = gpu_env or {}
        self.workdir = workdir
        self.gpu_names = gpu_names
        self.count, self.gpus, self.memory, self.helm_args = nodes, gpus, memory, helm_args
        self.nodes: list[SimulatedNode] = []

    def __enter__(self) -> ChartCluster:
        # Nodes live under a short path: kubelet.sock's path in it must fit
        # a unix socket address (108 bytes).
        self.nodes_dir = Path(tempfile.mkdtemp(prefix="vgpu-nodes-", dir="/tmp"))
        self.network = TestNetwork().__enter__()
        try:
            self.cluster = ControlPlane(self.workdir / "control-plane", network=self.network,
                                        audit_policy=self.audit_policy,
                                        controller_manager_args=self.controller_manager_args).__enter__()
            enable_forwarding(self.network)
            shared = [self.workdir, self.nodes_dir]
            self.image = image(self.cluster, self.workdir / "image", shared)
            for index in range(1, self.count + 1):
                node = SimulatedNode(self.cluster, self.network, index, self.image, self.nodes_dir / f"node-{index}",
                                     gpus=self.gpus, memory=self.memory,
                                     labels={"gpu": "on",
                                             **({DRA_NODE_LABEL: "dra"} if index <= self.dra_nodes else {})},
                                     simulated_gpu=TARGET / "libsimgpu.so",
                                     gpu_name=self.gpu_names[index - 1] if index <= len(self.gpu_names) else None,
                                     gpu_env=self.gpu_env)
                self.nodes.append(node)
                node.start()
            # What the NVIDIA container toolkit sets up on a GPU cluster;
            # the chart's node agent runs with it.
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps({
                "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                "handler": "nvidia"}))
            self.cluster.helm("install", "vgpu", str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
                              "--set", "image.pullPolicy=Never",
                              *(("--set", "dra.enabled=true") if self.dra_nodes else ()), *self.helm_args)
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
        self.keep_node_logs()
        shutil.rmtree(self.nodes_dir, ignore_errors=True)

    def keep_node_logs(self) -> None:
        """The nodes' logs (simnode's and every container's), copied into
        the test's folder, which pytest keeps, before the nodes' folder
        goes: what a failed test needs to be understood."""
        kept = self.workdir / "node-logs"
        for log in self.nodes_dir.glob("*/simnode.log"):
            target = kept / log.parent.name / log.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, target)
        for log in self.nodes_dir.glob("*/pods/*/*.log"):
            target = kept / log.relative_to(self.nodes_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, target)

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

    def troubles(self) -> str:
        """What the nodes said went wrong, whole: kubelet's admission
        refusals and the node agents' warnings and errors (the tail of
        `logs()` is mostly events and would cut them off)."""
        parts = []
        for node in self.nodes:
            refusals = [line for line in node.log().splitlines() if "refused at admission" in line]
            if refusals:
                parts.append(f"--- {node.name} admission refusals\n" + "\n".join(refusals))
            for folder in sorted((node.workdir / "pods").glob(f"{RELEASE_NAMESPACE}_*")):
                for log in sorted(folder.glob("*.log")):
                    bad = [line for line in log.read_text(errors="replace").splitlines()
                           if " WARN " in line or " ERROR " in line]
                    if bad:
                        parts.append(f"--- {node.name} {folder.name}/{log.name} warnings\n" + "\n".join(bad[-40:]))
        return "\n".join(parts)

    def wait_until_serving(self) -> None:
        """Every node's plugin has registered and published its GPUs (a DRA
        node's driver: its ResourceSlice), and the webhook's Service has a
        ready endpoint."""
        def plugins_registered():
            nodes = kubectl_json(self.cluster, "get", "nodes")["items"]
            dra = [node for node in nodes if node["metadata"]["labels"].get(DRA_NODE_LABEL) == "dra"]
            plugin = [node for node in nodes if node not in dra]
            if dra:
                slices = kubectl_json(self.cluster, "get", "resourceslices")["items"]
                drivers = {item["spec"].get("nodeName") for item in slices if item["spec"]["driver"] == "vgpu.io"}
                if not all(node["metadata"]["name"] in drivers for node in dra):
                    return False
            counts = [int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) for node in plugin]
            published = all("vgpu.io/node-gpus" in node["metadata"].get("annotations", {}) for node in plugin)
            return len(nodes) == self.count and all(counts) and published
        wait_for("every node's plugin registered with its kubelet and published its GPUs", plugins_registered,
                 timeout=120, log=self.logs)

        wait_for("the extender's pod ready behind its Service", lambda: extender_endpoint_ready(self.cluster),
                 timeout=120, log=self.logs)

    def node(self, name: str) -> SimulatedNode:
        return next(node for node in self.nodes if node.name == name)




def compile_workload(name: str, folder: Path, source: Path | None = None) -> Path:
    """Builds tests/cluster/workloads/<name>.c (or `source`) into `folder`
    (once)."""
    program = folder / name
    if not program.exists():
        done = subprocess.run([os.environ.get("CC", "cc"), "-O2", "-Wall", "-Werror",
                               "-I", str(REPO / "testkit/programs"), "-o", str(program),
                               str(source or HERE / f"workloads/{name}.c"), "-ldl", "-lpthread"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ControlPlaneError(f"building {name}: {done.stderr}")
    return program
