"""A PyTorch program that run.py steers line by line, for limits changed
while it runs (`vgpu set`).

    python3 resize.py [--size N]

Prints "ready" once CUDA is set up, then answers each line on stdin with
one JSON line:

    loop S      bf16 matrix products back to back for S seconds:
                {"rate", "start", "end"} (time.monotonic(), the same
                clock as run.py's)
    alloc MIB   a new tensor of MIB MiB, kept until the program exits:
                {"ok", "error", "held_mib"}
    info        the device's memory as the program sees it:
                {"free_mib", "total_mib", "held_mib"}

and exits when stdin closes. Nothing it allocates is freed before then, so
a lower cap can never have been met by giving memory back.
"""

import argparse
import json
import sys
import time

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()

    import torch

    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    torch.cuda.synchronize()
    held: list = []

    def held_mib() -> int:
        return sum(t.numel() for t in held) // MIB

    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "loop":
            start = time.monotonic()
            end = start + float(words[1])
            done = 0
            while time.monotonic() < end:
                c = a @ b
                done += 1
            torch.cuda.synchronize()
            finished = time.monotonic()
            answer = {"rate": done / (finished - start), "start": start, "end": finished}
        elif words[0] == "alloc":
            try:
                held.append(torch.empty(int(words[1]) * MIB, dtype=torch.uint8, device="cuda"))
                answer = {"ok": True, "error": ""}
            except torch.cuda.OutOfMemoryError as exc:
                answer = {"ok": False, "error": str(exc).splitlines()[0]}
            answer["held_mib"] = held_mib()
        elif words[0] == "info":
            free, total = torch.cuda.mem_get_info()
            answer = {"free_mib": free // MIB, "total_mib": total // MIB, "held_mib": held_mib()}
        else:
            answer = {"error": f"unknown command {words[0]!r}"}
        print(json.dumps(answer), flush=True)
    del c


if __name__ == "__main__":
    main()
