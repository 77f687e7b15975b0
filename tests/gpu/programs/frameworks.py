"""Fills the GPU through a framework's own allocator until it refuses.

    python3 frameworks.py --framework torch|cupy|jax --chunk-mib N --ceiling-mib M

Reports what the framework says the device holds (total and free, and for
JAX the limit its preallocating allocator took), how much it allocated
before it raised, and the exception's type, so run.py can check that the
cap is what the framework sees and what stops it.
"""

import argparse
import time

from handshake import ready_then_wait_for_go, report_and_hold

MIB = 1 << 20


def fill(allocate, out_of_memory, chunk: int, ceiling: int) -> dict:
    held, allocated, error, message = [], 0, None, None
    while allocated + chunk <= ceiling:
        try:
            held.append(allocate(chunk))
        except out_of_memory as exc:
            error, message = type(exc).__name__, str(exc)[:300]
            break
        except Exception as exc:  # noqa: BLE001 -- any other refusal is a finding, not a crash
            error, message = type(exc).__name__, str(exc)[:300]
            break
        allocated += chunk
    return {"allocated": allocated, "error": error, "message": message, "held": held}


def run_torch(chunk: int, ceiling: int) -> dict:
    import torch

    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    ready_then_wait_for_go()

    def allocate(size):
        buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        buffer.fill_(1)
        torch.cuda.synchronize()
        return buffer

    result = fill(allocate, torch.cuda.OutOfMemoryError, chunk, ceiling)
    result.update(total=total, free=free, reserved=torch.cuda.memory_reserved())
    return result


def run_cupy(chunk: int, ceiling: int) -> dict:
    import cupy

    cupy.zeros(1)
    free, total = cupy.cuda.runtime.memGetInfo()
    ready_then_wait_for_go()

    def allocate(size):
        buffer = cupy.empty(size, dtype=cupy.uint8)
        buffer.fill(1)
        cupy.cuda.runtime.deviceSynchronize()
        return buffer

    result = fill(allocate, cupy.cuda.memory.OutOfMemoryError, chunk, ceiling)
    result.update(total=total, free=free)
    return result


def run_jax(chunk: int, ceiling: int) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices("gpu")[0]
    jnp.zeros(1).block_until_ready()
    stats = device.memory_stats() or {}
    ready_then_wait_for_go()

    def allocate(size):
        return jnp.ones((size,), dtype=jnp.uint8).block_until_ready()

    # XLA reports allocation failures as a runtime error whose message says
    # RESOURCE_EXHAUSTED; there is no narrower exception type to catch.
    result = fill(allocate, Exception, chunk, ceiling)
    result.update(limit=stats.get("bytes_limit"), reserved=stats.get("bytes_reserved"))
    return result


RUNNERS = {"torch": run_torch, "cupy": run_cupy, "jax": run_jax}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(RUNNERS), required=True)
    parser.add_argument("--chunk-mib", type=int, required=True)
    parser.add_argument("--ceiling-mib", type=int, required=True)
    args = parser.parse_args()
    if args.chunk_mib < 1 or args.ceiling_mib < 0:
        parser.error("--chunk-mib must be at least 1 and --ceiling-mib not negative")
    started = time.monotonic()
    result = RUNNERS[args.framework](args.chunk_mib * MIB, args.ceiling_mib * MIB)
    held = result.pop("held")
    result["seconds"] = time.monotonic() - started
    report_and_hold(result)
    del held  # the buffers lived until run.py had read NVML at the peak


if __name__ == "__main__":
    main()
