"""200 ResourceClaims over 10 simulated nodes (two 24 GiB GPUs each) with the
vgpu-dra driver, allocated by the real kube-scheduler against the drivers'
ResourceSlices and prepared through kubelet's DRA code. The claims ask for
more than the cluster has.

- No GPU is given more memory or cores than it has, counted from the
  allocation results the API server holds.
- The caps in our regions (what the driver prepared on each node), summed
  per GPU, equal what the allocation results consumed there, exactly.
- Every claim left unallocated fits no GPU's remaining capacity, and its
  pod carries the scheduler's reason.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import TARGET, ChartCluster, kubectl_json, wait_for  # noqa: E402
from placement import count  # noqa: E402

NAMESPACE = "dra-scale"
NODES, GPUS, GPU_GIB = 10, 2, 24
CLAIMS = 200
GIB = 1 << 30


def requests(seed: int) -> list[tuple[int, int]]:
    """(GiB, cores) per claim: more than the 480 GiB and 2000 % there are."""
    chooser = random.Random(seed)
    return [(chooser.choice((1, 2, 3, 4, 6, 8)), chooser.choice((0, 5, 10, 20, 30))) for _ in range(CLAIMS)]


def objects(asked: list[tuple[int, int]]) -> dict:
    items = []
    for number, (gib, cores) in enumerate(asked):
        name = f"c{number:03d}"
        capacity = {"memory": f"{gib}Gi", "cores": str(cores)}
        items.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                      "metadata": {"name": name, "namespace": NAMESPACE},
                      "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                          "deviceClassName": "vgpu.io", "capacity": {"requests": capacity}}}]}}})
        items.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
                      "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                               "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                               "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "3600"],
                                               "resources": {"claims": [{"name": "gpu"}]}}]}})
    return {"apiVersion": "v1", "kind": "List", "items": items}


def test_200_claims_never_overcommit_and_regions_match_the_allocations(tmp_path):
    with ChartCluster(tmp_path, nodes=NODES, gpus=GPUS, memory=f"{GPU_GIB}Gi", dra_nodes=NODES,
                      helm_args=("--set", "dra.logLevel=warn")) as cc:
        cluster = cc.cluster
        cluster.kubectl("create", "namespace", NAMESPACE)
        asked = requests(seed=20261124)
        cluster.kubectl("create", "-f", "-", input=json.dumps(objects(asked)))

        def settled():
            pods = kubectl_json(cluster, "get", "pods", "-n", NAMESPACE)["items"]
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            refused = [p for p in pods if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                                              for c in p["status"].get("conditions", []))]
            return (running, refused) if len(pods) == CLAIMS and len(running) + len(refused) == CLAIMS else None
        running, refused = wait_for("every pod Running or refused by the scheduler", settled, timeout=600,
                                    log=cc.logs)
        claims = {c["metadata"]["name"]: c for c in kubectl_json(cluster, "get", "resourceclaims", "-n",
                                                                  NAMESPACE)["items"]}
        slices = [s for s in kubectl_json(cluster, "get", "resourceslices")["items"]
                  if s["spec"]["driver"] == "vgpu.io"]
        devices = {(s["spec"]["pool"]["name"], d["name"]): d for s in slices for d in s["spec"]["devices"]}
        assert len(devices) == NODES * GPUS

        # What the allocation results consume, per GPU.
        consumed = defaultdict(lambda: [0, 0])
        allocated = {}
        for found in claims.values():
            allocation = (found.get("status") or {}).get("allocation")
            if not allocation:
                continue
            (result,) = allocation["devices"]["results"]
            key = (result["pool"], result["device"])
            consumed[key][0] += count(result["consumedCapacity"]["memory"])
            consumed[key][1] += count(result["consumedCapacity"]["cores"])
            allocated[found["metadata"]["uid"]] = key
        for key, (memory, cores) in consumed.items():
            assert memory <= GPU_GIB * GIB and cores <= 100, (key, memory, cores)
        print(f"\n{len(running)} of {CLAIMS} claims allocated and prepared, {len(refused)} refused; "
              f"fullest GPU {max(m for m, _ in consumed.values()) / GIB:.0f} GiB, "
              f"{max(c for _, c in consumed.values())} % cores")
        assert len(running) == len(allocated)
        assert refused, "the claims ask for more than the cluster has"

        # What our regions hold, per GPU: every allocated claim was prepared
        # on its node with exactly what it consumed.
        held = defaultdict(lambda: [0, 0])
        for node in cc.nodes:
            for region in sorted((node.host_root / "usr/local/vgpu/containers").glob("claim-*/region.cache")):
                uid = region.parent.name.removeprefix("claim-")
                assert uid in allocated, f"{region}: no allocated claim has UID {uid}"
                assert allocated[uid][0] == node.name, f"{region} on {node.name}, claim allocated on {allocated[uid]}"
                shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(region), "--json"],
                                       capture_output=True, text=True, check=True)
                (device,) = json.loads(shown.stdout)["devices"]
                held[allocated[uid]][0] += device["limits"]["memory"]
                held[allocated[uid]][1] += device["limits"]["cores"] or 0
        assert dict(held) == {key: value for key, value in consumed.items()}

        # Nothing refused would have fit anywhere.
        for pod in refused:
            gib, cores = asked[int(pod["metadata"]["name"][1:])]
            for key in devices:
                memory_left = GPU_GIB * GIB - consumed[key][0]
                cores_left = 100 - consumed[key][1]
                assert gib * GIB > memory_left or cores > cores_left, (pod["metadata"]["name"], key)
            message = next(c.get("message", "") for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
            assert "cannot allocate all claims" in message, message
