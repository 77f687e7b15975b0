"""The per-pod trace of bench_pods read from audit lines written the way the
API server writes them (JSON, one event a line, in order of completion)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from podtrace import durations, missing, read_steps, table  # noqa: E402

NAMESPACE = "rate-vgpu-0"


def event(verb: str, resource: str, name: str, at: str, subresource: str = "", user: str = "admin",
          code: int = 201, received: str | None = None, response: dict | None = None,
          group: str = "") -> dict:
    ref = {"resource": resource, "namespace": NAMESPACE, "name": name, "apiGroup": group}
    if subresource:
        ref["subresource"] = subresource
    line = {"kind": "Event", "stage": "ResponseComplete", "verb": verb, "objectRef": ref,
            "user": {"username": user}, "responseStatus": {"code": code},
            "requestReceivedTimestamp": received or at, "stageTimestamp": at}
    if response is not None:
        line["responseObject"] = response
    return line


def write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_vgpu_pods_steps_come_from_the_writes_that_mark_them(tmp_path):
    log = write(tmp_path / "audit.log", [
        event("create", "pods", "p", "2026-11-27T10:00:00.030000Z", received="2026-11-27T10:00:00.000000Z"),
        # The extender's decision comes with the binding; a patch of its
        # (clearing an earlier attempt's records) is no step.
        event("patch", "pods", "p", "2026-11-27T10:00:00.100000Z",
              user="system:serviceaccount:vgpu-system:vgpu-scheduler", code=200),
        # kubelet's status write completes before the binding's line is
        # written: matched to the binding all the same.
        event("patch", "pods", "p", "2026-11-27T10:00:00.400000Z", subresource="status", code=200),
        event("create", "pods", "p", "2026-11-27T10:00:00.250000Z", subresource="binding"),
        event("patch", "pods", "p", "2026-11-27T10:00:00.300000Z",
              user="system:serviceaccount:vgpu-system:vgpu-node", code=200),
        # A refused write and another namespace's pod are not steps.
        event("patch", "pods", "p", "2026-11-27T10:00:00.050000Z",
              user="system:serviceaccount:vgpu-system:vgpu-scheduler", code=409),
        {**event("create", "pods", "q", "2026-11-27T10:00:00.010000Z"),
         "objectRef": {"resource": "pods", "namespace": "other", "name": "q"}},
    ])
    running = {"p": 1_795_773_600.9}  # 2026-11-27T10:00:00.900Z
    steps = read_steps(log, NAMESPACE, running)
    assert set(steps) == {"p"}
    p = steps["p"]
    assert round(p["admitted"] - p["created"], 3) == 0.030
    assert "decided" not in p
    assert round(p["bound"] - p["created"], 3) == 0.250
    assert round(p["allocated"] - p["created"], 3) == 0.300
    assert round(p["kubelet"] - p["created"], 3) == 0.400
    assert missing("vgpu", steps) == []
    spent = durations("vgpu", steps)
    assert [round(spent[step][0], 3) for step in ("bound", "kubelet")] == [0.22, 0.15]
    lines = table("vgpu", "one vGPU", steps)
    assert lines[-1].startswith("| create to Running | 900 |"), lines
    # The plugin's record is a side step, timed from the binding.
    assert any("1 of 1 pods, ms from the binding | 50 |" in line for line in lines), lines


def test_a_vgpu_pod_without_the_plugins_record_is_traced_whole(tmp_path):
    """Where kubelet's status shows the pod admitted first, the plugin
    writes no record: no step is missing, and kubelet's follows the
    binding."""
    log = write(tmp_path / "audit.log", [
        event("create", "pods", "p", "2026-11-27T10:00:00.030000Z", received="2026-11-27T10:00:00.000000Z"),
        event("create", "pods", "p", "2026-11-27T10:00:00.250000Z", subresource="binding"),
        event("patch", "pods", "p", "2026-11-27T10:00:00.400000Z", subresource="status", code=200),
    ])
    steps = read_steps(log, NAMESPACE, {"p": 1_795_773_600.9})
    assert missing("vgpu", steps) == []
    assert [round(durations("vgpu", steps)[step][0], 3) for step in ("bound", "kubelet")] == [0.22, 0.15]
    assert any("0 of 1 pods" in line for line in table("vgpu", "one vGPU", steps))


def test_a_dra_pods_claim_is_found_by_its_owner(tmp_path):
    claim = {"metadata": {"name": "d-gpu-x7k2p", "ownerReferences": [{"kind": "Pod", "name": "d"}]}}
    log = write(tmp_path / "audit.log", [
        event("create", "pods", "d", "2026-11-27T10:00:00.020000Z", received="2026-11-27T10:00:00.000000Z"),
        event("create", "resourceclaims", "", "2026-11-27T10:00:00.200000Z", response=claim,
              group="resource.k8s.io"),
        event("update", "resourceclaims", "d-gpu-x7k2p", "2026-11-27T10:00:00.500000Z", subresource="status",
              user="system:kube-scheduler", code=200, group="resource.k8s.io"),
        event("create", "pods", "d", "2026-11-27T10:00:00.600000Z", subresource="binding"),
    ])
    steps = read_steps(log, NAMESPACE, {})
    d = steps["d"]
    assert round(d["claim"] - d["created"], 3) == 0.2
    assert round(d["claim allocated"] - d["created"], 3) == 0.5
    assert missing("dra", steps) == ["d: running"], "kubelet's step is found by order alone and may be absent"
