"""NVIDIA's cuda-bindings, a real third-party client that obtains every
driver entry point through cuGetProcAddress, allocating under the cap."""

MIB = 1 << 20

FILL = r"""
import json
from cuda.bindings import driver as cu

def ok(result):
    err = result[0]
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return result[1] if len(result) == 2 else result[1:]

ok(cu.cuInit(0))
device = ok(cu.cuDeviceGet(0))
context = ok(cu.cuCtxCreate(0, device))
free, total = ok(cu.cuMemGetInfo())
buffers, refusal = [], None
while True:
    err, ptr = cu.cuMemAlloc(64 << 20)
    if err != cu.CUresult.CUDA_SUCCESS:
        refusal = int(err)
        break
    buffers.append(ptr)
used_free, _ = ok(cu.cuMemGetInfo())
for ptr in buffers:
    ok(cu.cuMemFree(ptr))
after_free, _ = ok(cu.cuMemGetInfo())
print(json.dumps({"total": total, "free": free, "chunks": len(buffers), "refusal": refusal,
                  "free_when_full": used_free, "free_after": after_free,
                  "device_total": ok(cu.cuDeviceTotalMem(device))}))
"""


def test_allocation_through_get_proc_address_is_capped(sandbox):
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "1Gi"
    result = sandbox.python(FILL)
    assert result["total"] == 1024 * MIB
    assert result["device_total"] == 1024 * MIB
    assert result["chunks"] == 16
    assert result["refusal"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert result["free_when_full"] == 0
    assert result["free_after"] == 1024 * MIB


def test_same_program_without_the_shim_sees_the_whole_device(sandbox):
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "1Gi"
    sandbox.env["SIMGPU_MEMORY"] = "2Gi"
    result = sandbox.python(FILL, shim=False)
    assert result["total"] == 2048 * MIB
    assert result["chunks"] == 32


def test_per_thread_default_stream_variants_are_hooked_too(sandbox):
    sandbox.env["CUDA_DEVICE_MEMORY_LIMIT"] = "1Gi"
    sandbox.env["CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    result = sandbox.python(FILL)
    assert result["chunks"] == 16
    assert result["refusal"] == 2
