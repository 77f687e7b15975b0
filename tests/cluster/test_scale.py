"""300 pods over 20 simulated nodes from 4 parallel submitters, through the
real API server, our webhook, the chart's kube-scheduler with our extender,
and kubelet's device-plugin code calling our plugin. The mix has one- and
two-container pods, init containers with GPUs, two-GPU pods, pods that fit
nowhere and pods that ask for no GPU; together they ask for more than the
cluster has.

Over-commit is checked from what the nodes hold, not from the extender: the
limits each node started each container with (what kubelet's code passed
to the runtime), and the simulated GPUs themselves (every running workload
allocates its cap less the shim's context reserve; a GPU given away twice
would refuse someone). Every Pending pod must not fit the final free
capacity and must carry the scheduler's reason in its events."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import ChartCluster, compile_workload, kubectl_json, wait_for  # noqa: E402

NAMESPACE = "burst"
NODES, GPUS, GPU_MIB, SPLIT = 20, 2, 16384, 10
PODS, SUBMITTERS = 300, 4
CONTEXT_RESERVE_MIB = 256  # the shim's default, charged against every cap
TOO_BIG_MIB = 20000


def gpu_container(name: str, hold: Path, gpus: int, mib: int, cores: int) -> dict:
    limits = {"nvidia.com/gpu": str(gpus), "nvidia.com/gpumem": str(mib), "nvidia.com/gpucores": str(cores)}
    return {"name": name, "image": "cuda:test", "command": [str(hold), str(max(mib - CONTEXT_RESERVE_MIB, 0))],
            "resources": {"limits": limits}}


def plan(hold: Path, seed: int = 16) -> list[dict]:
    """The pods, mixed, the same every run."""
    rng = random.Random(seed)
    pods = []
    for number in range(PODS):
        kind = rng.choices(["one", "two", "init", "multi", "too-big", "plain"], [40, 20, 12, 15, 5, 8])[0]
        mib, cores = rng.choice([1024, 2048, 4096]), rng.choice([10, 20, 30])
        spec: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1}
        if kind == "one":
            spec["containers"] = [gpu_container("main", hold, 1, mib, cores)]
        elif kind == "two":
            spec["containers"] = [gpu_container("main", hold, 1, mib, cores),
                                  gpu_container("side", hold, 1, 1024, 10)]
        elif kind == "init":
            init = gpu_container("prepare", hold, 1, 1024, 10)
            init["command"] = ["true"]
            spec["initContainers"] = [init]
            spec["containers"] = [gpu_container("main", hold, 1, mib, cores)]
        elif kind == "multi":
            spec["containers"] = [gpu_container("main", hold, 2, 2048, cores)]
        elif kind == "too-big":
            spec["containers"] = [gpu_container("main", hold, 1, TOO_BIG_MIB, cores)]
        else:
            spec["containers"] = [{"name": "main", "image": "busybox", "command": ["sleep", "3600"]}]
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"p{number:03d}-{kind}", "namespace": NAMESPACE,
                                  "labels": {"kind": kind}},
                     "spec": spec})
    return pods


def count(quantity: str) -> int:
    """A whole-number Kubernetes quantity as the API server writes it back
    ("20000" comes back as "20k")."""
    for suffix, factor in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("k", 10**3), ("M", 10**6), ("G", 10**9)):
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def demands(pod: dict) -> list[tuple[int, int, int]]:
    """(GPUs, MiB each, cores each) per GPU container, init containers too."""
    out = []
    for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
        limits = container.get("resources", {}).get("limits", {})
        if "nvidia.com/gpu" in limits:
            out.append((count(limits["nvidia.com/gpu"]), count(limits["nvidia.com/gpumem"]),
                        count(limits["nvidia.com/gpucores"])))
    return out


def mib_of(text: str) -> int:
    for suffix, shift in (("g", 10), ("m", 0), ("k", -10)):
        if text.endswith(suffix):
            value = int(text[:-1])
            return value << shift if shift >= 0 else value >> -shift
    return int(text) >> 20


def node_holdings(cc: ChartCluster, running: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (node, GPU): MiB, cores and containers the node started running
    containers with, read from the container specs the node wrote (the
    environment kubelet's code handed the runtime)."""
    held: dict[tuple[str, str], dict] = defaultdict(lambda: {"mib": 0, "cores": 0, "containers": 0, "who": []})
    for pod in running:
        node = cc.node(pod["spec"]["nodeName"])
        folder = node.pod_dir(NAMESPACE, pod["metadata"]["name"])
        assert folder is not None, f"{node.name} keeps nothing of {pod['metadata']['name']}"
        for container in pod["spec"]["containers"]:
            spec = json.loads((folder / f"{container['name']}.json").read_text())
            env = dict(item.split("=", 1) for item in spec["env"])
            if "NVIDIA_VISIBLE_DEVICES" not in env:
                continue
            for index, uuid in enumerate(env["NVIDIA_VISIBLE_DEVICES"].split(",")):
                entry = held[(node.name, uuid)]
                memory = env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{index}", env.get("CUDA_DEVICE_MEMORY_LIMIT"))
                cores = env.get(f"CUDA_DEVICE_SM_LIMIT_{index}", env.get("CUDA_DEVICE_SM_LIMIT", "0"))
                entry["mib"] += mib_of(memory)
                entry["cores"] += int(cores)
                entry["containers"] += 1
                entry["who"].append(f"{pod['metadata']['name']}/{container['name']}")
    return held


def fits_somewhere(pod: dict, free: dict[str, list[dict]]) -> str | None:
    """A node where `pod` clearly fits the free capacity: each GPU
    container, in order, on GPUs with room for it (greedy, roomiest
    first). None if no node has room."""
    for node, gpus in free.items():
        trial = [dict(gpu) for gpu in gpus]
        placed = True
        for count, mib, cores in demands(pod):
            room = sorted((g for g in trial if g["mib"] >= mib and g["cores"] >= cores and g["slots"] >= 1),
                          key=lambda g: -g["mib"])
            if len(room) < count:
                placed = False
                break
            for gpu in room[:count]:
                gpu["mib"] -= mib
                gpu["cores"] -= cores
                gpu["slots"] -= 1
        if placed:
            return node
    return None


def test_300_pods_over_20_nodes_from_4_submitters(tmp_path):
    # The 20 nodes' agents share this machine's cores: each monitor samples
    # once a second instead of the chart's ten times.
    with ChartCluster(tmp_path, nodes=NODES, gpus=GPUS, memory=f"{GPU_MIB}Mi",
                      helm_args=("--set", "node.monitor.intervalMs=1000")) as cc:
        cluster = cc.cluster
        hold = compile_workload("hold", tmp_path)
        cluster.kubectl("create", "namespace", NAMESPACE)
        pods = plan(hold)
        errors: list[str] = []

        def submit(share: list[dict]) -> None:
            for pod in share:
                done = cluster.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)
                if done.returncode != 0:
                    errors.append(f"{pod['metadata']['name']}: {done.stderr.strip()}")

        started = time.monotonic()
        submitters = [threading.Thread(target=submit, args=(pods[i::SUBMITTERS],)) for i in range(SUBMITTERS)]
        for thread in submitters:
            thread.start()
        for thread in submitters:
            thread.join()
        assert not errors, errors
        submitted = time.monotonic() - started

        def listed():
            items = kubectl_json(cluster, "get", "pods", "-n", NAMESPACE)["items"]
            return {pod["metadata"]["name"]: pod for pod in items}

        def reasons() -> dict[str, list[str]]:
            found: dict[str, list[str]] = defaultdict(list)
            for event in kubectl_json(cluster, "get", "events", "-n", NAMESPACE)["items"]:
                if event.get("reason") == "FailedScheduling":
                    found[event["involvedObject"]["name"]].append(event.get("message", ""))
            return found

        def settled():
            current, why = listed(), reasons()
            unsettled = [name for name, pod in current.items()
                         if not (pod["status"].get("phase") == "Running"
                                 or (pod["status"].get("phase") == "Pending" and not pod["spec"].get("nodeName")
                                     and why.get(name)))]
            return (current, why) if not unsettled else None

        current, why = wait_for("every pod Running, or Pending with the scheduler's reason", settled, timeout=600,
                                log=lambda: cc.logs()[-6000:])
        settled_after = time.monotonic() - started
        phases = defaultdict(int)
        for pod in current.values():
            phases[(pod["metadata"]["labels"]["kind"], pod["status"]["phase"])] += 1
        print(f"\n{PODS} pods submitted in {submitted:.1f} s, settled in {settled_after:.1f} s: {dict(phases)}")

        # Nothing that asked for no GPU, and nothing too big, is misplaced.
        assert all(phase == "Running" for (kind, phase) in phases if kind == "plain"), phases
        assert all(phase == "Pending" for (kind, phase) in phases if kind == "too-big"), phases
        for name, pod in current.items():
            if pod["metadata"]["labels"]["kind"] == "too-big":
                assert any(f"{TOO_BIG_MIB} MiB" in message for message in why[name]), why[name]

        running = [pod for pod in current.values() if pod["status"]["phase"] == "Running"]
        gpu_running = [pod for pod in running if demands(pod)]
        assert len(gpu_running) > 100, "the burst placed a good share of the GPU pods"

        # The nodes' own record: no GPU carries more than it has.
        held = node_holdings(cc, running)
        for (node, uuid), entry in held.items():
            assert entry["mib"] <= GPU_MIB, (node, uuid, entry)
            assert entry["cores"] <= 100, (node, uuid, entry)
            assert entry["containers"] <= SPLIT, (node, uuid, entry)

        # The simulated GPUs: every GPU workload got all it asked for.
        def reports():
            missing, wrong = [], []
            for pod in gpu_running:
                node = cc.node(pod["spec"]["nodeName"])
                for container in pod["spec"]["containers"]:
                    line = node.container_log(NAMESPACE, pod["metadata"]["name"], container["name"]).strip()
                    if not line:
                        missing.append(pod["metadata"]["name"])
                        continue
                    limits = container["resources"]["limits"]
                    want = count(limits["nvidia.com/gpu"]) * (count(limits["nvidia.com/gpumem"]) - CONTEXT_RESERVE_MIB)
                    if line.splitlines()[-1] != f"devices={limits['nvidia.com/gpu']} allocated_mib={want} error=0":
                        wrong.append((pod["metadata"]["name"], container["name"], line))
            return (missing, wrong)
        missing, wrong = wait_for("every running GPU workload's report",
                                  lambda: (lambda r: r if not r[0] else None)(reports()), timeout=60,
                                  log=lambda: str(reports()))
        assert not wrong, wrong

        # Every Pending pod truly does not fit what is left.
        free = {node.name: [] for node in cc.nodes}
        for node in cc.nodes:
            inventory = json.loads(kubectl_json(cluster, "get", "node", node.name)["metadata"]["annotations"]
                                   ["vgpu.io/node-gpus"])
            for gpu in inventory["gpus"]:
                entry = held.get((node.name, gpu["uuid"]), {"mib": 0, "cores": 0, "containers": 0})
                free[node.name].append({"mib": (gpu["memoryBytes"] >> 20) - entry["mib"],
                                        "cores": 100 - entry["cores"], "slots": SPLIT - entry["containers"]})
        fitting = {name: fits_somewhere(pod, free) for name, pod in current.items()
                   if pod["status"]["phase"] == "Pending"}
        fitting = {name: node for name, node in fitting.items() if node}
        assert not fitting, (f"Pending pods that fit: {fitting}\n"
                             + "\n".join(f"{name}: {why.get(name)}" for name in fitting))
