"""Checks of where pods went, made from what the simulated nodes hold (the
container specs they started, their GPUs' inventory), not from the
extender's state; and waiting until a burst has settled."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from chartcluster import ChartCluster, kubectl_json, wait_for

GPU_MIB, SPLIT = 16384, 10
CONTEXT_RESERVE_MIB = 256  # the shim's default, charged against every cap


def gpu_container(name: str, hold: Path, gpus: int, mib: int, cores: int) -> dict:
    limits = {"nvidia.com/gpu": str(gpus), "nvidia.com/gpumem": str(mib), "nvidia.com/gpucores": str(cores)}
    return {"name": name, "image": "cuda:test", "command": [str(hold), str(max(mib - CONTEXT_RESERVE_MIB, 0))],
            "resources": {"limits": limits}}


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


def node_holdings(cc: ChartCluster, namespace: str, running: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (node, GPU): MiB, cores and containers the node started running
    containers with, read from the container specs the node wrote (the
    environment kubelet's code handed the runtime)."""
    held: dict[tuple[str, str], dict] = defaultdict(lambda: {"mib": 0, "cores": 0, "containers": 0, "who": []})
    for pod in running:
        node = cc.node(pod["spec"]["nodeName"])
        folder = node.pod_dir(namespace, pod["metadata"]["name"])
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


def limits_not_their_own(cc: ChartCluster, namespace: str, running: list[dict]) -> list[str]:
    """The GPU containers whose node started them with another memory cap
    or compute share than they ask for: an allocation served to the wrong
    pod."""
    wrong = []
    for pod in running:
        folder = cc.node(pod["spec"]["nodeName"]).pod_dir(namespace, pod["metadata"]["name"])
        assert folder is not None, f"nothing kept of {pod['metadata']['name']}"
        for container in pod["spec"]["containers"]:
            limits = container.get("resources", {}).get("limits", {})
            if "nvidia.com/gpumem" not in limits:
                continue
            spec = json.loads((folder / f"{container['name']}.json").read_text())
            env = dict(item.split("=", 1) for item in spec["env"])
            for index, _ in enumerate(env.get("NVIDIA_VISIBLE_DEVICES", "").split(",")):
                memory = env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{index}", env.get("CUDA_DEVICE_MEMORY_LIMIT", "0"))
                cores = env.get(f"CUDA_DEVICE_SM_LIMIT_{index}", env.get("CUDA_DEVICE_SM_LIMIT", "0"))
                got = (mib_of(memory), int(cores))
                asked = (int(limits["nvidia.com/gpumem"]), int(limits.get("nvidia.com/gpucores", "0")))
                if got != asked:
                    wrong.append(f"{pod['metadata']['name']}/{container['name']} device {index}: "
                                 f"asked {asked[0]} MiB and {asked[1]} %, started with {got[0]} MiB and {got[1]} %")
    return wrong


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


def free_capacity(cc: ChartCluster, held: dict) -> dict[str, list[dict]]:
    """Per node, each GPU's free MiB, cores and slots (from its inventory
    less what the node holds)."""
    free: dict[str, list[dict]] = {}
    for node in cc.nodes:
        inventory = json.loads(kubectl_json(cc.cluster, "get", "node", node.name)["metadata"]["annotations"]
                               ["vgpu.io/node-gpus"])
        free[node.name] = []
        for gpu in inventory["gpus"]:
            entry = held.get((node.name, gpu["uuid"]), {"mib": 0, "cores": 0, "containers": 0})
            offered = gpu.get("offeredMemoryBytes", gpu["memoryBytes"])
            free[node.name].append({"mib": (offered >> 20) - entry["mib"],
                                    "cores": 100 - entry["cores"], "slots": SPLIT - entry["containers"]})
    return free


def assert_not_overcommitted(held: dict) -> None:
    for (node, uuid), entry in held.items():
        assert entry["mib"] <= GPU_MIB, (node, uuid, entry)
        assert entry["cores"] <= 100, (node, uuid, entry)
        assert entry["containers"] <= SPLIT, (node, uuid, entry)


def settle(cc: ChartCluster, namespace: str, timeout: float = 600,
           allow_failed_admission: bool = False) -> tuple[dict, dict]:
    """Waits until every pod of `namespace` is Running, or Pending (unbound)
    with a FailedScheduling event (or, with `allow_failed_admission`, Failed
    by kubelet's admission); answers the pods by name and the events'
    messages by pod name."""
    def listed():
        items = kubectl_json(cc.cluster, "get", "pods", "-n", namespace)["items"]
        return {pod["metadata"]["name"]: pod for pod in items}

    def reasons() -> dict[str, list[str]]:
        found: dict[str, list[str]] = defaultdict(list)
        for event in kubectl_json(cc.cluster, "get", "events", "-n", namespace)["items"]:
            if event.get("reason") == "FailedScheduling":
                found[event["involvedObject"]["name"]].append(event.get("message", ""))
        return found

    def settled():
        current = listed()
        why = reasons() if any(pod["status"].get("phase") == "Pending" for pod in current.values()) else {}
        unsettled = [name for name, pod in current.items()
                     if not (pod["status"].get("phase") == "Running"
                             or (pod["status"].get("phase") == "Pending" and not pod["spec"].get("nodeName")
                                 and why.get(name))
                             or (allow_failed_admission and pod["status"].get("phase") == "Failed"
                                 and pod["status"].get("reason") == "UnexpectedAdmissionError"))]
        if unsettled:
            return None
        # A Pending pod that fits may only be waiting for its retry (after
        # a transient refusal): settled means none fits.
        pending = [pod for pod in current.values() if pod["status"].get("phase") == "Pending"]
        if pending:
            running = [pod for pod in current.values() if pod["status"].get("phase") == "Running"]
            free = free_capacity(cc, node_holdings(cc, namespace, running))
            if any(fits_somewhere(pod, free) for pod in pending):
                return None
        return current, why

    def log():
        pods = cc.cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        events = cc.cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
        return (cc.logs()[-4000:] + f"\n--- pods of {namespace}\n{pods}\n--- events\n{events[-4000:]}\n"
                + cc.troubles())
    return wait_for(f"every pod of {namespace} Running, or Pending with the scheduler's reason and no room",
                    settled, timeout=timeout, log=log)


def workload_reports(cc: ChartCluster, namespace: str, running: list[dict]) -> list[tuple]:
    """Waits for every running GPU workload's report; answers those that did
    not get all the memory they asked for."""
    def reports():
        missing, wrong = [], []
        for pod in running:
            if not demands(pod):
                continue
            node = cc.node(pod["spec"]["nodeName"])
            for container in pod["spec"]["containers"]:
                line = node.container_log(namespace, pod["metadata"]["name"], container["name"]).strip()
                if not line:
                    missing.append(pod["metadata"]["name"])
                    continue
                limits = container["resources"]["limits"]
                want = count(limits["nvidia.com/gpu"]) * (count(limits["nvidia.com/gpumem"]) - CONTEXT_RESERVE_MIB)
                if line.splitlines()[-1] != f"devices={limits['nvidia.com/gpu']} allocated_mib={want} error=0":
                    wrong.append((pod["metadata"]["name"], container["name"], line))
        return missing, wrong
    _, wrong = wait_for("every running GPU workload's report", lambda: (lambda r: r if not r[0] else None)(reports()),
                        timeout=60, log=lambda: str(reports()))
    return wrong
