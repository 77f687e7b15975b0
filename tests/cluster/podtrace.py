"""Where a pod's time goes between its create request and Running, step by
step, from the API server's audit log (microsecond timestamps of every
write that moves a pod along) and the bench's own watch for Running.

The API server writes the log when started with `AUDIT_POLICY`
(`ControlPlane(audit_policy=...)`): metadata of pod creates, patches,
bindings and status writes, and the claims made for pods with the response
(a claim made from a template gets its name from the server, and its owner
names the pod)."""

from __future__ import annotations

import json
import statistics
from datetime import datetime
from itertools import pairwise
from pathlib import Path

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "RequestResponse", "verbs": ["create"],
         "resources": [{"group": "resource.k8s.io", "resources": ["resourceclaims"]}]},
        {"level": "Metadata", "verbs": ["create", "update", "patch"],
         "resources": [{"group": "", "resources": ["pods", "pods/binding", "pods/status"]},
                       {"group": "resource.k8s.io", "resources": ["resourceclaims/status"]}]},
        {"level": "None"},
    ],
}

# The steps of each kind of pod, in the order they happen; `created` is the
# create request's arrival, every other step the completion of the write
# that marks it (Running: the bench's watch).
STEPS = {
    "plain": ("created", "admitted", "bound", "kubelet", "running"),
    "vgpu": ("created", "admitted", "bound", "kubelet", "running"),
    "dra": ("created", "admitted", "claim", "claim allocated", "bound", "kubelet", "running"),
    "null": ("created", "admitted", "claim", "claim allocated", "bound", "kubelet", "running"),
    "whole": ("created", "admitted", "claim", "claim allocated", "bound", "kubelet", "running"),
    "ext": ("created", "admitted", "claim", "claim allocated", "bound", "kubelet", "running"),
}
# Steps some pods of a kind show and others do not, each timed from the step
# named beside it: the device plugin's record on a vGPU pod, written only
# where kubelet's status did not show the pod admitted first.
SIDE_STEPS = {"vgpu": (("allocated", "bound"),)}
MEANING = {
    "admitted": "create answered (admission, webhooks included)",
    "bound": "binding created (a vGPU pod's carries the extender's decision)",
    "allocated": "the device plugin's Allocate recorded on the pod (where kubelet's status was not first)",
    "claim": "its ResourceClaim made (from the template; by kube-scheduler for an extended resource)",
    "claim allocated": "the claim's allocation written by kube-scheduler",
    "kubelet": "kubelet's first status write (it took the pod)",
    "running": "seen Running by the bench's watch",
}


def _time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def read_steps(audit_log: Path, namespace: str, running: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per pod of `namespace`: each step's wall-clock time (seconds since
    the epoch), as far as the audit log and `running` (wall-clock) show
    them."""
    steps: dict[str, dict[str, float]] = {}
    claims: dict[str, str] = {}
    # Status writes are matched to the binding once every line is read:
    # the log is in order of completion, not of the events' causes.
    status_writes: dict[str, list[float]] = {}
    with open(audit_log, encoding="utf-8") as lines:
        for line in lines:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if ref.get("namespace") != namespace or event.get("stage") != "ResponseComplete":
                continue
            code = (event.get("responseStatus") or {}).get("code", 0)
            if code >= 300:
                continue
            resource, subresource = ref.get("resource"), ref.get("subresource", "")
            verb, user = event.get("verb"), (event.get("user") or {}).get("username", "")
            done = _time(event["stageTimestamp"])
            if resource == "resourceclaims" and subresource == "" and verb == "create":
                claim = event.get("responseObject") or {}
                owners = claim.get("metadata", {}).get("ownerReferences") or [{}]
                pod, name = owners[0].get("name"), claim.get("metadata", {}).get("name")
                if pod and name:
                    claims[name] = pod
                    steps.setdefault(pod, {}).setdefault("claim", done)
                continue
            if resource == "resourceclaims" and subresource == "status":
                pod = claims.get(ref.get("name", ""))
                if pod:
                    steps.setdefault(pod, {}).setdefault("claim allocated", done)
                continue
            if resource != "pods" or not ref.get("name"):
                continue
            pod = steps.setdefault(ref["name"], {})
            if subresource == "" and verb == "create":
                pod.setdefault("created", _time(event["requestReceivedTimestamp"]))
                pod.setdefault("admitted", done)
            elif subresource == "binding":
                pod.setdefault("bound", done)
            elif subresource == "status":
                status_writes.setdefault(ref["name"], []).append(done)
            elif subresource == "" and verb == "patch" and user.endswith("-node"):
                pod.setdefault("allocated", done)
    for name, writes in status_writes.items():
        bound = steps[name].get("bound")
        after = [at for at in writes if bound is not None and at > bound]
        if after:
            steps[name]["kubelet"] = min(after)
    for name, at in running.items():
        steps.setdefault(name, {})["running"] = at
    return steps


def durations(kind: str, steps: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """Per step of `kind` after the first: the seconds each pod that shows
    it and the step before spent between them."""
    order = STEPS[kind]
    out: dict[str, list[float]] = {step: [] for step in order[1:]}
    for pod in steps.values():
        for before, step in pairwise(order):
            if before in pod and step in pod:
                out[step].append(pod[step] - pod[before])
    return out


# Steps found by time alone, not by who wrote them: kubelet's is the first
# status write completed after the binding. Were the two to complete out
# of order within a moment, a pod would lack it, so its absence is no
# failure.
ORDERED = ("kubelet",)


def missing(kind: str, steps: dict[str, dict[str, float]]) -> list[str]:
    """`pod: step` for each step of `kind` a pod does not show (except the
    ones found by order alone)."""
    return [f"{name}: {step}" for name, pod in sorted(steps.items()) for step in STEPS[kind]
            if step not in pod and step not in ORDERED]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(kind: str, title: str, steps: dict[str, dict[str, float]]) -> list[str]:
    """Markdown: per step, the median and p99 of its time from the step
    before, over every pod; and where the median pod and the p99 pod (by
    create to Running) spent theirs."""
    order = STEPS[kind]
    spent = durations(kind, steps)
    whole = {name: pod["running"] - pod["created"] for name, pod in steps.items()
             if "running" in pod and "created" in pod}
    ranked = sorted(whole, key=whole.get)
    typical = ranked[len(ranked) // 2] if ranked else None
    slow = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))] if ranked else None
    lines = [f"| {title}: step (ms from the step before) | median | p99 | the median pod | the p99 pod |",
             "|---|---:|---:|---:|---:|"]

    def of(pod: str | None, before: str, step: str) -> str:
        if pod is None or before not in steps[pod] or step not in steps[pod]:
            return "-"
        return f"{(steps[pod][step] - steps[pod][before]) * 1000:.0f}"
    for before, step in pairwise(order):
        values = spent[step]
        median = f"{statistics.median(values) * 1000:.0f}" if values else "-"
        p99 = f"{_percentile(values, 0.99) * 1000:.0f}" if values else "-"
        lines.append(f"| {MEANING[step]} | {median} | {p99} | {of(typical, before, step)} | {of(slow, before, step)} |")
    for step, since in SIDE_STEPS.get(kind, ()):
        values = [pod[step] - pod[since] for pod in steps.values() if step in pod and since in pod]
        median = f"{statistics.median(values) * 1000:.0f}" if values else "-"
        p99 = f"{_percentile(values, 0.99) * 1000:.0f}" if values else "-"
        lines.append(f"| {MEANING[step]}: {len(values)} of {len(steps)} pods, ms from the binding | {median} | "
                     f"{p99} | {of(typical, since, step)} | {of(slow, since, step)} |")
    if typical is not None and slow is not None:
        lines.append(f"| create to Running | {statistics.median(whole.values()) * 1000:.0f} | "
                     f"{_percentile(list(whole.values()), 0.99) * 1000:.0f} | {whole[typical] * 1000:.0f} | "
                     f"{whole[slow] * 1000:.0f} |")
    return lines
