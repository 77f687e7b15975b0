"""nvidia-ml-py (pynvml), the NVML client most monitoring tools use, sees
the cap as the device's memory and the container's use as used."""


MIB = 1 << 20

HOLD = r"""
import sys
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == 0
err, device = cu.cuDeviceGet(0)
err, context = cu.cuCtxCreate(0, device)
err, ptr = cu.cuMemAlloc(300 << 20)
assert err == 0, err
print("ready", flush=True)
sys.stdin.read()
"""

QUERY = r"""
import json, os
import pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
print(json.dumps({"total": v1.total, "used": v1.used, "free": v1.free,
                  "v2_total": v2.total, "v2_used": v2.used,
                  "processes": [[p.pid, p.usedGpuMemory] for p in processes]}))
"""


def test_pynvml_sees_the_cap_and_the_container_use(sandbox):
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "4Gi"
    holder = sandbox.spawn(HOLD)
    try:
        assert holder.stdout.readline().strip() == "ready"
        result = sandbox.python(QUERY)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert result["total"] == 4096 * MIB
    assert result["used"] == 300 * MIB
    assert result["free"] == 3796 * MIB
    assert result["v2_total"] == 4096 * MIB
    assert result["v2_used"] == 300 * MIB
    assert result["processes"] == [[holder.pid, 300 * MIB]]


def test_pynvml_without_the_shim_sees_the_physical_device(sandbox):
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "4Gi"
    result = sandbox.python(QUERY, shim=False)
    assert result["total"] == 16384 * MIB
