"""A container's workload for the cluster tests: allocates device memory in
chunks through the CUDA driver API until an allocation fails, prints one
JSON line saying how far it got and with which error (and the memory each
device it sees reports), then holds its memory
until it is stopped (so the monitor sees it). With --verify it first writes
a pattern into every byte of every buffer, reads each back and reports the
buffers that read back wrong and those the driver says live in host memory.

    python3 fill.py [CHUNK_MIB] [--exit] [--verify]
"""

import ctypes
import json
import signal
import sys
import time

# CU_POINTER_ATTRIBUTE_MEMORY_TYPE and its CU_MEMORYTYPE_HOST value.
MEMORY_TYPE, HOST = 2, 1


def verify(cuda, buffers: list, chunk_bytes: int) -> dict:
    """Writes every buffer whole, then reads each back and compares: the
    pattern depends on the buffer and on the offset (a 251-byte cycle, so a
    buffer read from the wrong place or shifted does not match)."""
    cycle = bytes(range(251)) * (chunk_bytes // 251 + 2)

    def pattern(index: int) -> bytes:
        start = index % 251
        return cycle[start:start + chunk_bytes]

    wrong = in_host = 0
    for index, pointer in enumerate(buffers):
        if cuda.cuMemcpyHtoD_v2(pointer, pattern(index), ctypes.c_size_t(chunk_bytes)) != 0:
            wrong += 1
    back = ctypes.create_string_buffer(chunk_bytes)
    for index, pointer in enumerate(buffers):
        result = cuda.cuMemcpyDtoH_v2(back, pointer, ctypes.c_size_t(chunk_bytes))
        if result != 0 or back.raw != pattern(index):
            wrong += 1
        kind = ctypes.c_uint()
        if cuda.cuPointerGetAttribute(ctypes.byref(kind), MEMORY_TYPE, pointer) == 0 and kind.value == HOST:
            in_host += 1
    return {"wrong_chunks": wrong, "host_chunks": in_host, "verified_mib": len(buffers) * (chunk_bytes >> 20)}


def main() -> int:
    chunk_mib = int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 256
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), 0)),
                       ("cuCtxCreate_v2", (ctypes.byref(context), 0, device))):
        result = getattr(cuda, call)(*args)
        if result != 0:
            print(json.dumps({"failed": call, "error": result}), flush=True)
            return 1
    buffers = []
    while True:
        pointer = ctypes.c_uint64()
        result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(chunk_mib << 20))
        if result != 0:
            break
        buffers.append(pointer)
        if len(buffers) * chunk_mib > 1 << 20:
            break  # a terabyte: no cap holds
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    # Every device the container sees, with the memory each reports.
    count, totals = ctypes.c_int(), []
    cuda.cuDeviceGetCount(ctypes.byref(count))
    for ordinal in range(count.value):
        other, size = ctypes.c_int(), ctypes.c_size_t()
        cuda.cuDeviceGet(ctypes.byref(other), ordinal)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(size), other)
        totals.append(size.value >> 20)
    report = {"allocated_mib": len(buffers) * chunk_mib, "error": result,
              "total_mib": total.value >> 20, "device_totals_mib": totals}
    if "--verify" in sys.argv:
        report.update(verify(cuda, buffers, chunk_mib << 20))
    print(json.dumps(report), flush=True)
    if "--exit" in sys.argv:
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
