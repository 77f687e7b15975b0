"""The GPU suite's handshake with run.py, for its Python programs.

A program prints "ready" once set up, starts measuring when run.py writes a
line, prints one JSON line with its result, then keeps everything it holds
until run.py closes its stdin (so run.py can read NVML at the peak).
"""

import json
import sys


def ready_then_wait_for_go() -> None:
    print("ready", flush=True)
    if not sys.stdin.readline():
        sys.exit(4)


def report_and_hold(result: dict) -> None:
    print(json.dumps(result), flush=True)
    for _ in sys.stdin:
        pass
