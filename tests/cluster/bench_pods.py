#!/usr/bin/env python3
"""Pods per second, created to Running, on the chart installed in the real
control plane with simulated nodes: pods that ask for a vGPU (through the
chart's admission, kube-scheduler with our extender, and kubelet's
device-plugin code calling our plugin), pods that claim a share of a GPU through DRA (a
ResourceClaimTemplate of the vgpu.io DeviceClass: claims made by
kube-controller-manager, allocated by the default kube-scheduler against
our drivers' ResourceSlices, prepared by kubelet's DRA code calling our
driver), the same claims from a DRA driver that prepares nothing
(tests/cluster/nulldra: what DRA costs the control plane and kubelet
alone), against pods that ask for neither, placed by the chart's
kube-scheduler (by `schedulerName`; it calls no extender for them) on the
nodes the vGPU pods run on, in rotating rounds of one run. Half the nodes offer their GPUs through DRA,
half through the device plugin (the null driver runs there too). Also the extender's own time per verb from
its `/metrics`, over the vGPU rounds (kube-scheduler has no per-extender
latency figure), the API server's own time for its calls to the webhook
and evaluating vgpu's mutating admission policy (both from the API server's
`/metrics`), and where each kind of pod spends its time, step by step
(podtrace: the API server's audit log).

Prints a Markdown table of medians over the rounds. Needs root (network
namespaces) and the control-plane binaries (tests/cluster/build)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chartcluster import DRA_NODE_LABEL, EXTENDER_PORT, TARGET, ChartCluster, extender_address  # noqa: E402
from controlplane import wait_for  # noqa: E402
from placement import GPU_MIB, count  # noqa: E402
from podtrace import AUDIT_POLICY, missing, read_steps, table  # noqa: E402

SCHEDULER_NAME = "vgpu-scheduler"
HISTOGRAM = "vgpu_extender_request_duration_seconds"
VERBS = ("filter", "prioritize", "bind", "mutate")
# The API server's histogram of its calls to admission webhooks, and the
# name of vgpu's (the chart's MutatingWebhookConfiguration).
WEBHOOK_HISTOGRAM = "apiserver_admission_webhook_admission_duration_seconds"
WEBHOOK_NAME = "scheduler.vgpu.io"
# The API server's time evaluating vgpu's mutating admission policy, per
# pod it mutates, from its /metrics (the API server here reports no such
# figure for validating policies that pass).
POLICY_HISTOGRAM = "apiserver_mutating_admission_policy_check_duration_seconds"


KINDS = ("plain", "vgpu", "dra", "null")
# Whole GPUs through vgpu's DRA driver (`--whole-gpus`), each round one pod
# for every GPU of the DRA nodes: a claim from a template of the
# vgpu.io-exclusive class, or the class's extended resource with no claim
# of the pod's own (kube-scheduler makes it; Kubernetes 1.36).
WHOLE_KINDS = ("whole", "ext")
EXTENDED_RESOURCE = "vgpu.io/gpu"
# What a DRA pod's claim asks for: what a vGPU pod asks for.
CLAIM_TEMPLATE = "share"
# The DRA driver that prepares nothing (tests/cluster/nulldra): what DRA
# costs the control plane and kubelet alone. It runs beside the device
# plugin on the plugin nodes, publishing the same GPUs the same way.
NULL_DRIVER = "null.vgpu.test"
CLASSES = {"dra": "vgpu.io", "null": NULL_DRIVER, "whole": "vgpu.io-exclusive"}
# The kinds whose claims vgpu's driver prepares (a region per claim).
OUR_DRIVER = ("dra", "whole", "ext")


def claim_template(namespace: str, device_class: str, share: bool = True) -> dict:
    """The template of a claim of `device_class`: 256 MiB and 5 % of a GPU,
    or (not `share`) a whole one."""
    exactly: dict = {"deviceClassName": device_class}
    if share:
        exactly["capacity"] = {"requests": {"memory": "256Mi", "cores": "5"}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": CLAIM_TEMPLATE, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}


def null_driver() -> Path:
    """The null DRA driver's binary (tests/cluster/nulldra/build)."""
    done = subprocess.run([str(HERE / "nulldra/build"), "--print-dir"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tests/cluster/nulldra/build failed: {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1]) / "nulldra"


def start_null_drivers(cc: ChartCluster, nodes: list, stack: contextlib.ExitStack) -> None:
    """The null driver on each of `nodes`, registered with its kubelet,
    with its DeviceClass; returns once every node's slice is published."""
    binary = null_driver()
    cc.cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": NULL_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NULL_DRIVER}'"}}]}}))
    for node in nodes:
        kubelet = node.host_root / "var/lib/kubelet"
        log = open(node.workdir / "nulldra.log", "w")  # noqa: SIM115 -- open while the process runs
        process = subprocess.Popen(cc.cluster.command([
            str(binary), f"--node-name={node.name}", f"--kubeconfig={cc.cluster.admin_kubeconfig}",
            f"--registry-dir={kubelet / 'plugins_registry'}", f"--plugin-dir=/var/lib/kubelet/plugins/{NULL_DRIVER}",
            f"--host-root={node.host_root}",
            "--gpus=2", f"--memory-bytes={GPU_MIB << 20}"]), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        log.close()
        stack.callback(process.wait, 30)
        stack.callback(process.terminate)

    def published() -> bool:
        slices = json.loads(cc.cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
        served = {item["spec"].get("nodeName") for item in slices if item["spec"].get("driver") == NULL_DRIVER}
        return served >= {node.name for node in nodes}
    wait_for("the null DRA driver's slices", published, timeout=120, log=cc.logs)


def pods(kind: str, namespace: str, count: int) -> list[dict]:
    """`count` pods sleeping in their container; `vgpu` ones ask for one vGPU
    the way a HAMi user writes it (no schedulerName: admission sets it),
    `dra` ones the same share through a claim from the template (default
    scheduler; `null` the same from the null driver; `whole` a whole GPU
    through a claim from the template, `ext` through the extended resource),
    `plain` ones name the chart's scheduler, ask for no GPU and go to the
    device plugin's nodes, as the `vgpu` ones do."""
    out = []
    for number in range(count):
        container: dict = {"name": "main", "image": "busybox", "command": ["sleep", "3600"]}
        spec: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
        if kind == "vgpu":
            container["resources"] = {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "256",
                                                 "nvidia.com/gpucores": "5"}}
        elif kind == "ext":
            container["resources"] = {"limits": {EXTENDED_RESOURCE: "1"}}
        elif kind in CLASSES:
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": CLAIM_TEMPLATE}]
            container["resources"] = {"claims": [{"name": "gpu"}]}
        else:
            spec["schedulerName"] = SCHEDULER_NAME
            # On the nodes the vGPU pods (and the null driver's) run on:
            # the same kubelets admit them, so the ratio is what a vGPU
            # costs, not what twice the nodes give.
            spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": DRA_NODE_LABEL, "operator": "DoesNotExist"}]}]}}}
        out.append({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{kind}-{number:04d}", "namespace": namespace}, "spec": spec})
    return out


def histogram(text: str, metric: str = HISTOGRAM, key=lambda labels: labels.get("verb"),
              keys: tuple[str, ...] = VERBS) -> dict[str, dict]:
    """Per key (by default the extender's verbs): cumulative bucket counts by
    upper bound, sum and count, added up over the metric's series that
    `key` maps to it."""
    out = {name: {"buckets": {}, "sum": 0.0, "count": 0.0} for name in keys}
    for line in text.splitlines():
        if not line.startswith(metric + "_") or "{" not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series[:series.index("{")]
        labels = {label: text.strip('"') for label, text in
                  (part.split("=", 1) for part in series[series.index("{") + 1:-1].split(","))}
        found = out.get(key(labels))
        if found is None:
            continue
        if name == metric + "_bucket":
            bound = float(labels["le"])
            found["buckets"][bound] = found["buckets"].get(bound, 0.0) + float(value)
        elif name == metric + "_sum":
            found["sum"] += float(value)
        elif name == metric + "_count":
            found["count"] += float(value)
    return out


def webhook_histogram(text: str) -> dict[str, dict]:
    """The API server's own time for its calls to vgpu's webhook on pod
    creation, from its /metrics."""
    return histogram(text, WEBHOOK_HISTOGRAM, keys=("webhook",),
                     key=lambda labels: "webhook" if (labels.get("name"), labels.get("operation"))
                     == (WEBHOOK_NAME, "CREATE") else None)


def policy_histogram(text: str) -> dict[str, dict]:
    """The API server's own time evaluating vgpu's mutating admission
    policy (in-process admission of vGPU pods), from its /metrics."""
    return histogram(text, POLICY_HISTOGRAM, keys=("policy",),
                     key=lambda labels: "policy" if labels.get("policy", "").endswith("-vgpu-pods") else None)


def difference(after: dict, before: dict) -> dict:
    return {name: {"buckets": {le: count - before[name]["buckets"].get(le, 0.0)
                               for le, count in after[name]["buckets"].items()},
                   "sum": after[name]["sum"] - before[name]["sum"],
                   "count": after[name]["count"] - before[name]["count"]} for name in after}


def add(total: dict, delta: dict) -> None:
    """Adds one round's `difference` into `total`."""
    for name, series in delta.items():
        into = total.setdefault(name, {"buckets": {}, "sum": 0.0, "count": 0.0})
        for le, calls in series["buckets"].items():
            into["buckets"][le] = into["buckets"].get(le, 0.0) + calls
        into["sum"] += series["sum"]
        into["count"] += series["count"]


def quantile(series: dict, q: float) -> float:
    """Linear interpolation within the bucket that holds quantile `q`, as
    Prometheus' histogram_quantile does."""
    total = series["count"]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, cumulative in sorted(series["buckets"].items()):
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = le, cumulative
    return lower


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def extender_metrics_url(cc: ChartCluster) -> str:
    return f"http://{extender_address(cc)}:{EXTENDER_PORT}/metrics"


def region_limits(cc: ChartCluster, folder: str) -> dict | None:
    """The limits in the region `folder` (`<pod UID>_<container>` or
    `claim-<UID>`) on whichever node has it, as `vgpu inspect` reads them."""
    for node in cc.nodes:
        path = node.host_root / "usr/local/vgpu/containers" / folder / "region.cache"
        if path.is_file():
            shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"], capture_output=True,
                                   text=True, check=True)
            return json.loads(shown.stdout)["devices"][0]["limits"]
    return None


def double_bookings(cc: ChartCluster, kind: str, namespace: str) -> tuple[list[str], str]:
    """What this round's pods were granted beyond a GPU's memory or
    compute, per GPU, summed from what each pod holds: a vGPU pod's
    decision (checked by the device plugin at Allocate) or a claim's
    allocation; and every grant our nodes made that differs from what its
    region holds (the null driver keeps nothing on the node); and the
    fullest GPU."""
    if kind == "plain":
        return [], "no GPU"
    held: dict[tuple[str, str], list[int]] = {}
    wrong = []
    if kind == "vgpu":
        listed = json.loads(cc.cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        for pod in listed:
            decision = json.loads(pod["metadata"]["annotations"]["vgpu.io/decision"])
            for container in decision["containers"]:
                for device in container["devices"]:
                    key = (decision["node"], device["uuid"])
                    memory, cores = device["memoryBytes"], device["coresPercent"]
                    entry = held.setdefault(key, [0, 0])
                    entry[0], entry[1] = entry[0] + memory, entry[1] + cores
                    limits = region_limits(cc, f"{pod['metadata']['uid']}_{container['name']}")
                    if limits is None or (limits["memory"], limits["cores"]) != (memory, cores):
                        wrong.append(f"{pod['metadata']['name']}: region {limits}, granted {memory} B {cores} %")
    else:
        listed = json.loads(cc.cluster.kubectl("get", "resourceclaims", "-n", namespace, "-o", "json").stdout)["items"]
        for claim in listed:
            for result in claim["status"]["allocation"]["devices"]["results"]:
                consumed = result["consumedCapacity"]
                memory, cores = count(consumed["memory"]), count(consumed.get("cores", "0"))
                entry = held.setdefault((result["pool"], result["device"]), [0, 0])
                entry[0], entry[1] = entry[0] + memory, entry[1] + cores
                if kind in OUR_DRIVER:
                    limits = region_limits(cc, f"claim-{claim['metadata']['uid']}")
                    # A whole GPU's compute is no cap (none in the region).
                    share = None if cores in (0, 100) and kind != "dra" else cores
                    if limits is None or (limits["memory"], limits["cores"]) != (memory, share):
                        wrong.append(f"{claim['metadata']['name']}: region {limits}, allocated {memory} B {cores} %")
    over = [f"{node} {gpu}: {memory} B, {cores} %" for (node, gpu), (memory, cores) in sorted(held.items())
            if memory > GPU_MIB << 20 or cores > 100]
    fullest = max(held.values(), default=[0, 0])
    return over + wrong, f"{len(held)} GPUs used, the fullest {fullest[0] >> 20} MiB, {fullest[1]} %"


def run_round(cc: ChartCluster, kind: str, namespace: str, pod_count: int, parallel: int,
              metrics: str | None) -> dict:
    cc.cluster.kubectl("create", "namespace", namespace)
    if kind in CLASSES:
        template = claim_template(namespace, CLASSES[kind], share=kind not in WHOLE_KINDS)
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(template))
    command = cc.cluster.command([sys.executable, str(HERE / "podrate.py"), "--server", cc.cluster.server,
                                  "--pki", str(cc.cluster.pki), "--namespace", namespace,
                                  "--parallel", str(parallel)] + (["--metrics", metrics] if metrics else []))
    server_before = cc.cluster.kubectl("get", "--raw", "/metrics").stdout if metrics else ""
    done = subprocess.run(command, input=json.dumps(pods(kind, namespace, pod_count)), capture_output=True,
                          text=True, check=False)
    server_after = cc.cluster.kubectl("get", "--raw", "/metrics").stdout if metrics else ""
    if done.returncode != 0:
        raise SystemExit(f"podrate failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    if result["errors"]:
        raise SystemExit(f"{kind} round in {namespace}: {result['errors'][:5]}\n{cc.logs()[-6000:]}")
    sent, running = result["sent"], result["running"]
    latencies = [running[name] - sent[name] for name in sent]
    elapsed = max(running.values()) - min(sent.values())
    overbooked, fullest = double_bookings(cc, kind, namespace)
    if not overbooked:
        print(f"{kind} in {namespace}: no GPU granted more than it has ({fullest})", file=sys.stderr)
    else:
        raise SystemExit(f"{kind} round in {namespace}: GPUs granted more than they have, or regions unlike "
                         f"their grants: {overbooked[:5]}")
    # Nothing from this round may hold capacity in the next.
    cc.cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=300s")
    steps = read_steps(cc.cluster.audit_log, namespace,
                       {name: at + result["clock"] for name, at in running.items()})
    return {"rate": pod_count / elapsed, "latencies": latencies, "steps": steps,
            "metrics": (histogram(result["metrics"]["after"]), histogram(result["metrics"]["before"]))
            if metrics else None,
            "webhook": (webhook_histogram(server_after), webhook_histogram(server_before)) if metrics else None,
            "policy": (policy_histogram(server_after), policy_histogram(server_before)) if metrics else None}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example: sudo .venv/bin/python tests/cluster/bench_pods.py --repeats 3")
    parser.add_argument("--nodes", type=int, default=10, help="simulated nodes, 2 GPUs each (default 10)")
    parser.add_argument("--pods", type=int, default=100, help="pods per round (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each kind (default 3)")
    parser.add_argument("--parallel", type=int, default=4, help="concurrent creators (default 4)")
    parser.add_argument("--node-policy", choices=("binpack", "spread", "random"),
                        help="the extender's node policy (default: the chart's, binpack)")
    parser.add_argument("--controller-manager-qps", type=float, metavar="QPS",
                        help="kube-controller-manager's --kube-api-qps, its --kube-api-burst twice that (default: "
                             "its own, 20 and 30): the rate at which it makes DRA pods' claims")
    parser.add_argument("--whole-gpus", action="store_true",
                        help="also rounds of whole GPUs through vgpu's DRA driver, one pod for every GPU of the DRA "
                             "nodes: a claim from a template against the class's extended resource (vgpu.io/gpu)")
    parser.add_argument("--webhook-admission", action="store_true",
                        help="every vGPU pod through the extender's webhook (scheduler.webhook.inProcess=false); "
                             "default: the chart's, on Kubernetes 1.36 the API server's own admission "
                             "(a MutatingAdmissionPolicy), with no call to the webhook for these pods")
    parser.add_argument("--warmup", type=int, default=10, metavar="PODS",
                        help="pods of each kind in one untimed round before the timed ones (default 10; 0: none): "
                             "what a path does once per API server or node (the API server builds the type "
                             "converter a mutating policy needs on its first use, about a second) stays out of "
                             "the rates")
    parser.add_argument("--quick", action="store_true",
                        help="4 nodes, 20 pods, 1 round, no warm-up: proves the bench runs")
    parser.add_argument("--workdir", type=Path, help="keep the cluster's files here (default: a temporary folder)")
    options = parser.parse_args(argv)
    if options.quick:
        options.nodes, options.pods, options.repeats, options.warmup = 4, 20, 1, 0
    for name in ("nodes", "pods", "repeats", "parallel"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if options.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if options.controller_manager_qps is not None and options.controller_manager_qps <= 0:
        parser.error("--controller-manager-qps must be above 0")
    if options.nodes < 2:
        parser.error("--nodes must be at least 2: half offer their GPUs through DRA, half through the device plugin")
    dra_nodes = options.nodes // 2
    plugin_nodes = options.nodes - dra_nodes
    # Two GPUs per node, 10 vGPUs each (and 20 claims of 5 % each): every
    # round's GPU pods fit.
    if options.pods > min(plugin_nodes, dra_nodes) * 2 * 10:
        parser.error(f"--pods {options.pods} is more GPU pods than {min(plugin_nodes, dra_nodes)} nodes of a "
                     f"kind hold ({min(plugin_nodes, dra_nodes) * 20})")
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="vgpu-bench-pods-"))
    started = time.monotonic()
    kinds = KINDS + (WHOLE_KINDS if options.whole_gpus else ())
    # Whole GPUs: every GPU of the DRA nodes once per round.
    round_size = {kind: dra_nodes * 2 if kind in WHOLE_KINDS else options.pods for kind in kinds}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    # Per kind, each pod's steps (pod names made unique by round).
    traces: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in kinds}
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    verbs: dict[str, dict] = {}
    webhook: dict[str, dict] = {}
    policy: dict[str, dict] = {}
    # The monitors sample once a second: the nodes' agents share this
    # machine's cores with the control plane.
    helm_args = ["--set", "node.monitor.intervalMs=1000"]
    if options.node_policy:
        helm_args += ["--set", f"scheduler.extender.nodePolicy={options.node_policy}"]
    if options.webhook_admission:
        helm_args += ["--set", "scheduler.webhook.inProcess=false"]
    qps = options.controller_manager_qps
    controller_manager = (f"--kube-api-qps={qps:g}", f"--kube-api-burst={2 * qps:g}") if qps else ()
    with contextlib.ExitStack() as stack:
        cc = stack.enter_context(ChartCluster(workdir, nodes=options.nodes, gpus=2, memory=f"{GPU_MIB}Mi",
                                              helm_args=tuple(helm_args), dra_nodes=dra_nodes,
                                              audit_policy=AUDIT_POLICY,
                                              controller_manager_args=controller_manager))
        start_null_drivers(cc, cc.nodes[dra_nodes:], stack)
        policies = json.loads(cc.cluster.kubectl("get", "mutatingadmissionpolicies", "-o", "json").stdout)["items"]
        in_process = any(p["metadata"]["name"].endswith("-vgpu-pods") for p in policies)
        metrics = extender_metrics_url(cc)
        for kind in kinds if options.warmup else ():
            size = min(options.warmup, round_size[kind])
            result = run_round(cc, kind, f"warmup-{kind}", size, options.parallel, None)
            print(f"warm-up {kind}: {size} pods, {result['rate']:.1f} pods/s (not counted)", file=sys.stderr)
        for round_ in range(options.repeats):
            # Each kind goes first, second, ... in turn.
            shift = round_ % len(kinds)
            order = kinds[shift:] + kinds[:shift]
            for kind in order:
                result = run_round(cc, kind, f"rate-{kind}-{round_}", round_size[kind], options.parallel,
                                   metrics if kind == "vgpu" else None)
                rates[kind].append(result["rate"])
                traces[kind].update({f"{round_}/{name}": pod for name, pod in result["steps"].items()})
                latencies[kind].extend(result["latencies"])
                if result["metrics"]:
                    add(verbs, difference(*result["metrics"]))
                    add(webhook, difference(*result["webhook"]))
                    add(policy, difference(*result["policy"]))
                print(f"round {round_ + 1} {kind}: {result['rate']:.1f} pods/s", file=sys.stderr)

    rate = {kind: statistics.median(rates[kind]) for kind in kinds}
    warmed = f"after an untimed round of {options.warmup} of each kind" if options.warmup else "no warm-up round"
    print(f"\n{options.pods} pods per round, {options.repeats} round(s) of each kind ({warmed}), "
          f"{options.nodes} nodes x 2 simulated GPUs ({dra_nodes} through DRA; the no-GPU, vGPU and null DRA pods "
          f"on the other {plugin_nodes}), {options.parallel} creators, node policy "
          f"{options.node_policy or 'binpack'}, kube-controller-manager's client "
          f"{f'{qps:g} requests/s' if qps else 'at its default rate'}, vGPU pods admitted by "
          f"{'the API server itself (MutatingAdmissionPolicy)' if in_process else 'the webhook'}; medians over rounds "
          f"({time.monotonic() - started:.0f} s)\n")
    print("| figure | no GPU | one vGPU each (extender) | one claim each (vgpu's DRA driver) | "
          "one claim each (null DRA driver) | vGPU / no GPU | vgpu's DRA / null DRA |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| pods/s, first create to last Running | {rate['plain']:.1f} | {rate['vgpu']:.1f} | {rate['dra']:.1f} | "
          f"{rate['null']:.1f} | {rate['vgpu'] / rate['plain']:.2f} | {rate['dra'] / rate['null']:.2f} |")
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        plain, vgpu, dra, null = (percentile(latencies[kind], q) for kind in KINDS)
        print(f"| one pod, create to Running, {label} | {plain * 1000:.0f} ms | {vgpu * 1000:.0f} ms | "
              f"{dra * 1000:.0f} ms | {null * 1000:.0f} ms | {vgpu / plain:.2f} | {dra / null:.2f} |")
    print("\n| extender verb or API server step (its own time, from its /metrics) | calls | mean | p50 | p99 |")
    print("|---|---:|---:|---:|---:|")
    rows = [(verb, verbs.get(verb)) for verb in VERBS]
    rows.append(("the API server's call to the webhook, pod creation (its /metrics)", webhook.get("webhook")))
    rows.append(("the API server's evaluation of vgpu's mutating policy, pod creation (its /metrics)",
                 policy.get("policy")))
    for label, series in rows:
        if not series or series["count"] <= 0:
            print(f"| {label} | 0 | - | - | - |")
            continue
        print(f"| {label} | {series['count']:.0f} | {series['sum'] / series['count'] * 1000:.2f} ms | "
              f"{quantile(series, 0.5) * 1000:.2f} ms | {quantile(series, 0.99) * 1000:.2f} ms |")
    if options.whole_gpus:
        whole, ext = rate["whole"], rate["ext"]
        print(f"\nWhole GPUs through vgpu's DRA driver, {round_size['whole']} pods a round (every GPU of the DRA "
              "nodes)\n")
        print("| figure | a claim from a template (vgpu.io-exclusive) | the extended resource (vgpu.io/gpu) | "
              "extended / template |")
        print("|---|---:|---:|---:|")
        print(f"| pods/s, first create to last Running | {whole:.1f} | {ext:.1f} | {ext / whole:.2f} |")
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            by_template, by_resource = (percentile(latencies[kind], q) for kind in WHOLE_KINDS)
            print(f"| one pod, create to Running, {label} | {by_template * 1000:.0f} ms | "
                  f"{by_resource * 1000:.0f} ms | {by_resource / by_template:.2f} |")
    titles = {"plain": "no GPU", "vgpu": "one vGPU (extender)", "dra": "one claim (vgpu's DRA driver)",
              "null": "one claim (null DRA driver)", "whole": "a whole GPU, claim from a template",
              "ext": "a whole GPU, extended resource"}
    print("\nWhere the time goes, per pod: each step's time from the one before, from the API server's audit log "
          "(the write that marks the step, completed) and the bench's watch (Running)")
    for kind in kinds:
        print()
        print("\n".join(table(kind, titles[kind], traces[kind])))
    status = 0
    untraced = {kind: missing(kind, traces[kind]) for kind in kinds}
    for kind, gaps in untraced.items():
        if gaps:
            print(f"bench_pods: {len(gaps)} step(s) of {kind} pods not in the audit log, e.g. {gaps[:3]}",
                  file=sys.stderr)
            status = 1
    vgpu_pods = options.pods * options.repeats
    missed = [verb for verb in ("filter", "bind") + (() if in_process else ("mutate",))
              if verbs.get(verb, {}).get("count", 0) < vgpu_pods]
    if missed:
        print(f"bench_pods: the extender counted fewer {', '.join(missed)} calls than vGPU pods", file=sys.stderr)
        status = 1
    calls = webhook.get("webhook", {}).get("count", 0)
    if in_process and (calls or verbs.get("mutate", {}).get("count", 0)):
        print(f"bench_pods: the API server admits these vGPU pods itself, yet called {WEBHOOK_NAME} {calls:.0f} "
              "time(s)", file=sys.stderr)
        status = 1
    if not in_process and calls < vgpu_pods:
        print(f"bench_pods: the API server counted fewer calls to {WEBHOOK_NAME} ({WEBHOOK_HISTOGRAM}) than vGPU "
              "pods", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
