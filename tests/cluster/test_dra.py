"""GPUs shared by amount through Dynamic Resource Allocation, on the real
control plane (kube-apiserver, kube-controller-manager and the default
kube-scheduler, 1.36, where consumable capacity is on by default) with the
chart's vgpu-dra driver on a simulated node whose kubelet side is kubelet's
own DRA code (plugin registry watcher and DRA manager; the node applies the
CDI specs, there being no container runtime).

- The driver's ResourceSlice, accepted by the API server, offers both 24 GiB
  GPUs as shareable devices with `memory` and `cores` capacities.
- Claims for 4 GiB/30 % and 8 GiB/50 % land on one GPU, placed by the real
  kube-scheduler; 16 GiB then lands on the other; a claim that fits neither
  stays Pending with the scheduler's reason.
- The claims' regions hold exactly what the allocation consumed, and the
  workloads are held there: the 4 GiB claim's memory cap stops its
  allocations, the 50 % claim's kernels get about half the GPU.
- The node monitor beside the driver names each claim's series by
  namespace, pod and claim.
- The driver is killed and restarts between Prepare and Unprepare: the
  pod's deletion still releases its claim (CDI spec and region gone), and a
  new claim is prepared by the restarted driver.
- The README's ResourceClaimTemplates are accepted; "two GPUs of one
  model" gets two different GPUs, capped in one region.
- A whole GPU by the vgpu.io-exclusive class's extended resource
  (`limits: {vgpu.io/gpu: 1}`, no claim of the pod's own): kube-scheduler
  makes the claim, kubelet's code has the driver prepare it, the region is
  the whole GPU.
- A GPU cordoned by the node's annotation (HAMi's `hami.io/device-cordon`)
  leaves the slice while the claim on it keeps running; a new claim gets
  the other GPU; uncordoned, it returns. `vgpu cordon` and `vgpu uncordon`
  do the same by index, refuse unknown GPUs and nodes, and clear HAMi's
  spelling too.
- A GPU marked unhealthy (an XID on the simulated GPU) leaves the slice, and
  a claim only it could hold stays Pending.
- Each claim prepared changes the slice (its `vgpu.io/claims-prepared`
  count; devices and generation unchanged), which makes kube-scheduler
  retry the pods it set aside for want of room; a burst of 20 pods a GPU
  whose claims (from a template) exactly fill the GPUs all run, none
  waiting for the scheduler's five-minute flush, no GPU granted more than
  it has, and one more pod waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))
from shares import UncappedRun, assert_share  # noqa: E402

from chartcluster import (  # noqa: E402
    REPO,
    TARGET,
    ChartCluster,
    compile_workload,
    kill_9,
    kubectl_json,
    wait_for,
)

NAMESPACE = "dra"
FILL = HERE / "workloads/fill.py"
GIB = 1 << 30


@pytest.fixture(scope="module")
def dra_cluster(tmp_path_factory):
    with ChartCluster(tmp_path_factory.mktemp("dra-cluster"), nodes=1, gpus=2, memory="24Gi",
                      dra_nodes=1) as running:
        running.cluster.kubectl("create", "namespace", NAMESPACE)
        yield running


@pytest.fixture(autouse=True)
def cleared(dra_cluster):
    """Each test leaves no pod or claim behind, passed or failed, so the
    next one starts with both GPUs free."""
    yield
    for kind in ("pods", "resourceclaims"):
        dra_cluster.cluster.kubectl("delete", kind, "--all", "-n", NAMESPACE, "--wait=true", "--timeout=120s")


def claim(name: str, memory: str | None, cores: str | None, device_class: str = "vgpu.io") -> dict:
    capacity = {key: value for key, value in (("memory", memory), ("cores", cores)) if value is not None}
    exactly = {"deviceClassName": device_class}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def pod(name: str, claim_name: str, command: list[str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                     "containers": [{"name": "main", "image": "cuda:test", "command": command,
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


def create(cc: ChartCluster, *objects: dict) -> None:
    for item in objects:
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(item))


def allocation(cc: ChartCluster, name: str) -> dict | None:
    found = kubectl_json(cc.cluster, "get", "resourceclaim", name, "-n", NAMESPACE)
    return (found.get("status") or {}).get("allocation")


def allocated(cc: ChartCluster, name: str) -> dict:
    """The claim's one result, once kube-scheduler allocated it."""
    done = wait_for(f"claim {name} allocated", lambda: allocation(cc, name), timeout=90, log=cc.logs)
    results = done["devices"]["results"]
    assert len(results) == 1, results
    return results[0]


def running(cc: ChartCluster, name: str) -> dict:
    def phase():
        found = kubectl_json(cc.cluster, "get", "pod", name, "-n", NAMESPACE)
        return found if found["status"].get("phase") in ("Running", "Succeeded", "Failed") else None
    found = wait_for(f"pod {name} running", phase, timeout=90, log=cc.logs)
    assert found["status"]["phase"] == "Running", json.dumps(found["status"], indent=1)
    return found


def pending_reason(cc: ChartCluster, name: str) -> str:
    def unschedulable():
        found = kubectl_json(cc.cluster, "get", "pod", name, "-n", NAMESPACE)
        for condition in found["status"].get("conditions", []):
            if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
                return condition.get("message") or "(no message)"
        return None
    return wait_for(f"pod {name} unschedulable", unschedulable, timeout=60, log=cc.logs)


def region_limits(cc: ChartCluster, claim_uid: str) -> list[dict]:
    """The limits in the claim's region, as `vgpu inspect` reads them."""
    node = cc.nodes[0]
    path = node.host_root / f"usr/local/vgpu/containers/claim-{claim_uid}/region.cache"
    shown = subprocess.run([str(TARGET / "vgpu"), "inspect", str(path), "--json"],
                           capture_output=True, text=True, check=True)
    return [device["limits"] for device in json.loads(shown.stdout)["devices"]]


def uid_of(cc: ChartCluster, name: str) -> str:
    return kubectl_json(cc.cluster, "get", "resourceclaim", name, "-n", NAMESPACE)["metadata"]["uid"]


def test_the_slice_offers_both_gpus_by_amount(dra_cluster):
    cc = dra_cluster
    slices = [item for item in kubectl_json(cc.cluster, "get", "resourceslices")["items"]
              if item["spec"]["driver"] == "vgpu.io"]
    assert len(slices) == 1, slices
    spec = slices[0]["spec"]
    assert spec["nodeName"] == cc.nodes[0].name
    assert spec["pool"]["name"] == cc.nodes[0].name
    devices = {device["name"]: device for device in spec["devices"]}
    assert sorted(devices) == ["gpu-0", "gpu-1"], devices
    for device in devices.values():
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"]["memory"]["value"] in ("24Gi", str(24 * GIB)), device
        assert device["capacity"]["cores"]["value"] == "100", device
        assert device["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] in ("1Mi", str(1 << 20))
        assert device["attributes"]["uuid"]["string"].startswith("GPU-"), device
    classes = {item["metadata"]["name"] for item in kubectl_json(cc.cluster, "get", "deviceclasses")["items"]}
    assert {"vgpu.io", "vgpu.io-exclusive"} <= classes


def test_claims_share_a_gpu_by_amount_and_are_held_there(dra_cluster):
    cc = dra_cluster
    workload = compile_workload("workload", cc.workdir, source=REPO / "testkit/programs/workload.c")
    # One at a time, so that kube-scheduler's choices are deterministic:
    # it takes the first device that fits.
    create(cc, claim("small", "4Gi", "30"), pod("small", "small", [sys.executable, str(FILL), "256"]))
    small = allocated(cc, "small")
    create(cc, claim("half", "8Gi", "50"),
           pod("half", "half", ["/bin/sh", "-c", f"{workload} sync k1ms 4; exec sleep 600"]))
    half = allocated(cc, "half")
    # The same program with no cap, on a simulated GPU of its own, while
    # half's container starts and runs: what this machine gives it now.
    uncapped = UncappedRun(workload, ["sync", "k1ms", "4"], cc.nodes[0].simulated_gpu, cc.workdir)
    assert small["device"] == half["device"], (small, half)
    assert small["consumedCapacity"] == {"memory": "4Gi", "cores": "30"}, small
    assert half["consumedCapacity"] == {"memory": "8Gi", "cores": "50"}, half
    create(cc, claim("big", "16Gi", None), pod("big", "big", [sys.executable, str(FILL), "1024"]))
    big = allocated(cc, "big")
    assert big["device"] != small["device"], (small, big)
    # 12 GiB and 20 % are left on the first GPU, 8 GiB on the second.
    create(cc, claim("toomuch", "10Gi", "30"), pod("toomuch", "toomuch", [sys.executable, str(FILL), "256"]))
    reason = pending_reason(cc, "toomuch")
    assert "cannot allocate all claims" in reason, reason
    assert allocation(cc, "toomuch") is None

    for name in ("small", "half", "big"):
        running(cc, name)
    # The regions hold what the allocation consumed, exactly.
    assert region_limits(cc, uid_of(cc, "small"))[0] == {"memory": 4 * GIB, "cores": 30, "burst": None, "swap": None}
    assert region_limits(cc, uid_of(cc, "half"))[0] == {"memory": 8 * GIB, "cores": 50, "burst": None, "swap": None}
    # No cores named: none reserved, so no share cap.
    assert region_limits(cc, uid_of(cc, "big"))[0] == {"memory": 16 * GIB, "cores": None, "burst": None, "swap": None}

    node = cc.nodes[0]
    line = wait_for("small's workload report", lambda: node.container_log(NAMESPACE, "small", "main").strip(),
                    timeout=30, log=cc.logs)
    report = json.loads(line.splitlines()[-1])
    # 256 MiB chunks under a 4 GiB cap: the shim refuses the allocation
    # that would pass it (CUDA_ERROR_OUT_OF_MEMORY), and the device shows
    # the cap as its total.
    assert report["error"] == 2, report
    assert report["total_mib"] == 4096, report
    assert 3072 <= report["allocated_mib"] <= 4096, report

    # The node monitor beside the driver names each claim's series by
    # namespace, pod and claim.
    def limits() -> list[str]:
        try:
            text = node.get(f"http://{node.address}:31992/metrics")
        except OSError as error:
            return [f"(monitor not serving: {error})"]
        return [line for line in text.splitlines() if line.startswith("vgpu_container_memory_limit_bytes{")]

    def named():
        return [line for line in limits()
                if 'namespace="dra"' in line and 'pod="small"' in line and 'container="small"' in line]
    lines = wait_for("the monitor naming the claim", named, timeout=30,
                     log=lambda: "\n".join(limits()) + "\n" + cc.logs())
    assert lines[0].endswith(f" {4 * GIB}"), lines

    log = wait_for("half's kernels done", lambda: "launches=" in node.container_log(NAMESPACE, "half", "main")
                   and node.container_log(NAMESPACE, "half", "main"), timeout=60, log=cc.logs)
    launches = int(log.split("launches=")[1].split()[0])
    # 1 ms kernels back to back for 4 s: at a 50 % share about 2000 run.
    share = 100 * launches / 4000
    reference = 100 * uncapped.launches() / 4000
    print(f"\nclaim half (cores 50): {launches} launches of 1 ms in 4 s = {share:.1f} % of the GPU "
          f"(uncapped beside it: {reference:.1f} %)")
    assert_share("claim half (cores 50)", share, 50, reference, tolerance=8)

    for name in ("small", "half", "big", "toomuch"):
        cc.cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
        cc.cluster.kubectl("delete", "resourceclaim", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")


def test_a_restarted_driver_releases_what_it_prepared(dra_cluster):
    cc = dra_cluster
    node = cc.nodes[0]
    create(cc, claim("kept", "2Gi", "20"), pod("kept", "kept", [sys.executable, str(FILL), "256"]))
    running(cc, "kept")
    uid = uid_of(cc, "kept")
    spec = node.host_root / f"var/run/cdi/vgpu.io-claim_{uid}.json"
    region = node.host_root / f"usr/local/vgpu/containers/claim-{uid}"
    assert spec.is_file() and region.is_dir()
    edits = json.loads(spec.read_text())["devices"][0]["containerEdits"]
    assert "CUDA_DEVICE_SM_LIMIT_0=20" in edits["env"] or "CUDA_DEVICE_SM_LIMIT=20" in edits["env"], edits

    driver_pod = next(item["metadata"]["name"] for item in kubectl_json(
        cc.cluster, "get", "pods", "-n", "vgpu-system", "-l", "app.kubernetes.io/component=dra")["items"])
    kill_9(driver_pod, "vgpu-dra")

    def restarted():
        found = kubectl_json(cc.cluster, "get", "pod", driver_pod, "-n", "vgpu-system")
        statuses = found["status"].get("containerStatuses", [])
        return any(status["restartCount"] >= 1 and status.get("ready") for status in statuses)
    wait_for("the driver restarted", restarted, timeout=60, log=cc.logs)

    cc.cluster.kubectl("delete", "pod", "kept", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    wait_for("the claim's CDI spec and region removed by the restarted driver",
             lambda: not spec.exists() and not region.exists(), timeout=60, log=cc.logs)
    cc.cluster.kubectl("delete", "resourceclaim", "kept", "-n", NAMESPACE, "--wait=true", "--timeout=60s")

    create(cc, claim("after", "1Gi", "10"), pod("after", "after", [sys.executable, str(FILL), "256"]))
    running(cc, "after")
    assert region_limits(cc, uid_of(cc, "after"))[0]["memory"] == GIB
    cc.cluster.kubectl("delete", "pod", "after", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    cc.cluster.kubectl("delete", "resourceclaim", "after", "-n", NAMESPACE, "--wait=true", "--timeout=60s")


def test_the_readme_templates_are_accepted_and_two_gpus_are_two(dra_cluster):
    """The README's ResourceClaimTemplates (deploy/examples/dra/) are
    accepted by the API server; a pod of "two GPUs of one model" gets two
    different GPUs, each capped in its one region."""
    cc = dra_cluster
    examples = REPO / "deploy/examples/dra"
    for name in ("gpu-4gib-30pct", "two-gpus-one-model", "whole-h100"):
        cc.cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(examples / f"{name}.yaml"))
    workload = compile_workload("workload", cc.workdir, source=REPO / "testkit/programs/workload.c")
    # Kernels on both GPUs for a second (the shim records each GPU it is
    # used on, which is what `vgpu inspect` lists), then idle.
    paired = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "paired", "namespace": NAMESPACE},
              "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                       "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus-one-model"}],
                       "containers": [{"name": "main", "image": "cuda:test",
                                       "command": ["/bin/sh", "-c", f"{workload} sync k1ms 1 2; exec sleep 600"],
                                       "resources": {"claims": [{"name": "gpus"}]}}]}}
    create(cc, paired)
    found = running(cc, "paired")
    node = cc.nodes[0]
    wait_for("the paired pod's kernels on both GPUs", lambda: "launches=" in node.container_log(
        NAMESPACE, "paired", "main"), timeout=60, log=cc.logs)
    # kube-controller-manager made the claim from the template, for this pod.
    claim_name = next(item["metadata"]["name"] for item in kubectl_json(
        cc.cluster, "get", "resourceclaims", "-n", NAMESPACE)["items"]
        if any(owner["uid"] == found["metadata"]["uid"] for owner in item["metadata"].get("ownerReferences", [])))
    results = allocation(cc, claim_name)["devices"]["results"]
    assert sorted(result["device"] for result in results) == ["gpu-0", "gpu-1"], results
    assert all(result["consumedCapacity"] == {"memory": "8Gi", "cores": "50"} for result in results), results
    limits = region_limits(cc, uid_of(cc, claim_name))
    assert limits == [{"memory": 8 * GIB, "cores": 50, "burst": None, "swap": None}] * 2, limits
    cc.cluster.kubectl("delete", "pod", "paired", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    wait_for("the template's claim deleted with its pod", lambda: claim_name not in cc.cluster.kubectl(
        "get", "resourceclaims", "-n", NAMESPACE, "-o", "name").stdout, timeout=60, log=cc.logs)


def test_a_whole_gpu_by_extended_resource_is_prepared_by_the_nodes_kubelet_code(dra_cluster):
    """`limits: {vgpu.io/gpu: 1}` and no claim of the pod's own (the chart's
    `dra.extendedResourceName` on the vgpu.io-exclusive class): kube-scheduler
    makes the claim, kubelet's device manager leaves the resource to DRA and
    its DRA manager has our driver prepare the claim; the container's
    region is the whole GPU, and its program is held there."""
    cc = dra_cluster
    whole = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whole", "namespace": NAMESPACE},
             "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                      "containers": [{"name": "main", "image": "cuda:test",
                                      "command": ["/bin/sh", "-c", f"{sys.executable} {FILL} 4096; exec sleep 600"],
                                      "resources": {"limits": {"vgpu.io/gpu": "1"}}}]}}
    create(cc, whole)
    found = running(cc, "whole")
    claim_name = (found["status"].get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    assert claim_name, found["status"]
    (result,) = allocation(cc, claim_name)["devices"]["results"]
    assert result["driver"] == "vgpu.io", result
    limits = region_limits(cc, uid_of(cc, claim_name))
    assert limits == [{"memory": 24 * GIB, "cores": None, "burst": None, "swap": None}], limits
    node = cc.nodes[0]
    line = wait_for("the whole GPU's workload report", lambda: node.container_log(NAMESPACE, "whole", "main").strip(),
                    timeout=30, log=cc.logs)
    report = json.loads(line.splitlines()[-1])
    assert report["total_mib"] == 24 * 1024 and report["error"] == 2, report
    assert report["allocated_mib"] >= 16 * 1024, report
    cc.cluster.kubectl("delete", "pod", "whole", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    wait_for("kube-scheduler's claim deleted with its pod", lambda: claim_name not in cc.cluster.kubectl(
        "get", "resourceclaims", "-n", NAMESPACE, "-o", "name").stdout, timeout=60, log=cc.logs)


def inject_xid(cc: ChartCluster, device: int, xid: int) -> None:
    """An XID on the node's simulated GPU, as the driver's NVML sees it."""
    node = cc.nodes[0]
    env = {**os.environ, "SIMGPU_DEVICES": str(cc.gpus), "SIMGPU_MEMORY": cc.memory,
           "SIMGPU_STATE": str(node.workdir / "simgpu.state"), "SIMGPU_UUID_SEED": str(node.index)}
    subprocess.run([sys.executable, "-c",
                    "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]);"
                    "lib.simgpu_inject_xid.restype = ctypes.c_uint64;"
                    "lib.simgpu_inject_xid(int(sys.argv[2]), int(sys.argv[3]))",
                    str(TARGET / "libsimgpu.so"), str(device), str(xid)], env=env, check=True)


def slice_devices(cc: ChartCluster) -> dict[str, str]:
    """The devices of the driver's ResourceSlice: name -> GPU UUID."""
    for item in kubectl_json(cc.cluster, "get", "resourceslices")["items"]:
        if item["spec"]["driver"] == "vgpu.io":
            return {device["name"]: device["attributes"]["uuid"]["string"]
                    for device in item["spec"].get("devices") or []}
    return {}


def test_a_cordoned_gpu_leaves_the_slice_while_its_claims_keep_running(dra_cluster):
    cc = dra_cluster
    node = cc.nodes[0].name
    uuids = slice_devices(cc)
    assert sorted(uuids) == ["gpu-0", "gpu-1"]
    create(cc, claim("kept", "1Gi", "10"), pod("kept", "kept", [sys.executable, str(FILL), "256"]))
    taken = allocated(cc, "kept")["device"]
    running(cc, "kept")
    other = "gpu-1" if taken == "gpu-0" else "gpu-0"
    # HAMi's spelling, as its users write it.
    cc.cluster.kubectl("annotate", "node", node, f"hami.io/device-cordon={uuids[taken]}")
    wait_for(f"{taken} gone from the slice", lambda: sorted(slice_devices(cc)) == [other], timeout=60,
             log=cc.logs)
    create(cc, claim("new", "1Gi", "10"), pod("new", "new", [sys.executable, str(FILL), "256"]))
    assert allocated(cc, "new")["device"] == other
    running(cc, "new")
    kept = kubectl_json(cc.cluster, "get", "pod", "kept", "-n", NAMESPACE)
    assert kept["status"]["phase"] == "Running", "the claim on the cordoned GPU keeps running"
    cc.cluster.kubectl("annotate", "node", node, "hami.io/device-cordon-")
    wait_for("both GPUs back in the slice", lambda: sorted(slice_devices(cc)) == ["gpu-0", "gpu-1"],
             timeout=60, log=cc.logs)


def vgpu_verb(cc: ChartCluster, *args: str) -> subprocess.CompletedProcess:
    """`vgpu` run against the test cluster as its administrator."""
    return subprocess.run(cc.cluster.command([str(TARGET / "vgpu"), *args, "--kubeconfig",
                                              str(cc.cluster.admin_kubeconfig)]),
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def uncordoned(dra_cluster):
    """The node's cordon annotations gone after the test, passed or failed."""
    yield
    dra_cluster.cluster.kubectl("annotate", "node", dra_cluster.nodes[0].name, "vgpu.io/cordoned-gpus-",
                                "hami.io/device-cordon-", check=False)


def test_vgpu_cordon_and_uncordon_take_a_gpu_out_and_back(dra_cluster, uncordoned):
    cc = dra_cluster
    node = cc.nodes[0].name
    uuids = slice_devices(cc)
    assert sorted(uuids) == ["gpu-0", "gpu-1"]
    shown = vgpu_verb(cc, "cordon", node)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"node {node}: GPU {i} ({uuids[f'gpu-{i}']}): in service" for i in (0, 1)]

    done = vgpu_verb(cc, "cordon", node, "0")
    assert done.returncode == 0, done.stderr
    assert f"node {node}: 0 ({uuids['gpu-0']}) cordoned" in done.stdout, done.stdout
    annotations = kubectl_json(cc.cluster, "get", "node", node)["metadata"]["annotations"]
    assert annotations["vgpu.io/cordoned-gpus"] == uuids["gpu-0"]
    wait_for("gpu-0 gone from the slice", lambda: sorted(slice_devices(cc)) == ["gpu-1"], timeout=60, log=cc.logs)
    create(cc, claim("elsewhere", "1Gi", "10"), pod("elsewhere", "elsewhere", [sys.executable, str(FILL), "256"]))
    assert allocated(cc, "elsewhere")["device"] == "gpu-1"
    running(cc, "elsewhere")

    # Bad names are refused with what there is, and change nothing.
    unknown = vgpu_verb(cc, "cordon", node, "7")
    assert unknown.returncode == 1, unknown
    assert f"node {node} has no GPU 7: its GPUs are 1 ({uuids['gpu-1']})" in unknown.stderr, unknown.stderr
    missing = vgpu_verb(cc, "cordon", "no-such-node", "0")
    assert missing.returncode == 1 and "node no-such-node not found" in missing.stderr, missing
    usage = vgpu_verb(cc, "uncordon", node)
    assert usage.returncode == 2, usage
    assert kubectl_json(cc.cluster, "get", "node", node)["metadata"]["annotations"]["vgpu.io/cordoned-gpus"] == \
        uuids["gpu-0"]

    # HAMi's spelling beside it: uncordon --all clears both.
    cc.cluster.kubectl("annotate", "node", node, f"hami.io/device-cordon={uuids['gpu-1']}")
    wait_for("no GPU left in the slice", lambda: slice_devices(cc) == {}, timeout=60, log=cc.logs)
    back = vgpu_verb(cc, "uncordon", node, "--all")
    assert back.returncode == 0, back.stderr
    annotations = kubectl_json(cc.cluster, "get", "node", node)["metadata"].get("annotations", {})
    assert "vgpu.io/cordoned-gpus" not in annotations and "hami.io/device-cordon" not in annotations, annotations
    wait_for("both GPUs back in the slice", lambda: sorted(slice_devices(cc)) == ["gpu-0", "gpu-1"],
             timeout=60, log=cc.logs)
    kept = kubectl_json(cc.cluster, "get", "pod", "elsewhere", "-n", NAMESPACE)
    assert kept["status"]["phase"] == "Running", "the pod on the GPU cordoned later kept running"


def test_an_unhealthy_gpu_leaves_the_slice(dra_cluster):
    cc = dra_cluster

    def devices():
        return sorted(slice_devices(cc))
    assert devices() == ["gpu-0", "gpu-1"]
    # Fill GPU 0, so that a further claim could only go to GPU 1.
    create(cc, claim("whole", None, None, device_class="vgpu.io-exclusive"),
           pod("whole", "whole", [sys.executable, str(FILL), "1024"]))
    taken = allocated(cc, "whole")["device"]
    running(cc, "whole")
    other = 1 if taken == "gpu-0" else 0
    inject_xid(cc, other, 79)
    wait_for(f"gpu-{other} gone from the slice", lambda: devices() == [taken], timeout=60, log=cc.logs)
    create(cc, claim("stranded", "1Gi", "10"), pod("stranded", "stranded", [sys.executable, str(FILL), "256"]))
    reason = pending_reason(cc, "stranded")
    assert "cannot allocate all claims" in reason, reason
    for name in ("whole", "stranded"):
        cc.cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")
        cc.cluster.kubectl("delete", "resourceclaim", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")


PREPARED_ANNOTATION = "vgpu.io/claims-prepared"


def driver_slice(cc: ChartCluster) -> dict:
    return next(item for item in kubectl_json(cc.cluster, "get", "resourceslices")["items"]
                if item["spec"]["driver"] == "vgpu.io")


def prepared_count(cc: ChartCluster) -> int:
    return int(driver_slice(cc)["metadata"].get("annotations", {}).get(PREPARED_ANNOTATION, "0"))


def test_a_prepared_claim_changes_the_slice_and_nothing_else(dra_cluster):
    cc = dra_cluster
    before = driver_slice(cc)
    counted = prepared_count(cc)
    create(cc, claim("nudge", "1Gi", "10"), pod("nudge", "nudge", [sys.executable, str(FILL), "256"]))
    running(cc, "nudge")
    wait_for("the slice's prepared count raised", lambda: prepared_count(cc) > counted, timeout=30, log=cc.logs)
    after = driver_slice(cc)
    assert after["metadata"]["resourceVersion"] != before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"], "devices and pool generation stay as they were"


def test_a_burst_that_exactly_fills_the_gpus_all_runs(dra_cluster):
    cc = dra_cluster
    # The GPUs in the slice (an earlier test may have left one unhealthy).
    devices = sorted(slice_devices(cc))
    assert devices, "no GPU in the slice"
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "twentieth", "namespace": NAMESPACE},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "vgpu.io",
                    "capacity": {"requests": {"memory": "1Gi", "cores": "5"}}}}]}}}}

    def burst_pod(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "twentieth"}],
                         "containers": [{"name": "main", "image": "cuda:test", "command": ["sleep", "600"],
                                         "resources": {"claims": [{"name": "gpu"}]}}]}}
    create(cc, template)
    try:
        names = [f"burst-{index}" for index in range(20 * len(devices))]
        # All at once, as one list: 20 claims of 5 % for each GPU.
        cc.cluster.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": [burst_pod(name) for name in names]}))

        def phases() -> dict[str, str]:
            found = kubectl_json(cc.cluster, "get", "pods", "-n", NAMESPACE)["items"]
            return {item["metadata"]["name"]: item["status"].get("phase", "") for item in found}

        # kube-scheduler retries a pod it set aside for no event only after
        # five minutes: a pod that waited for that fails here. (Alone here
        # the burst ran in under 30 s; the bound leaves room for a busy
        # machine and still comes before the flush.)
        wait_for(f"all {len(names)} pods of the burst running",
                 lambda: all(phases().get(name) == "Running" for name in names), timeout=240, log=cc.logs)
        consumed: dict[str, int] = {}
        for item in kubectl_json(cc.cluster, "get", "resourceclaims", "-n", NAMESPACE)["items"]:
            for result in item["status"]["allocation"]["devices"]["results"]:
                consumed[result["device"]] = consumed.get(result["device"], 0) + int(
                    result["consumedCapacity"]["cores"])
        assert consumed == {device: 100 for device in devices}, consumed
        create(cc, burst_pod("one-more"))
        reason = pending_reason(cc, "one-more")
        assert "cannot allocate all claims" in reason, reason
    finally:
        cc.cluster.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=120s")
        cc.cluster.kubectl("delete", "resourceclaimtemplate", "twentieth", "-n", NAMESPACE)
