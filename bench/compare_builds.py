#!/usr/bin/env python3
"""Runs the same benchmark from two builds side by side and compares them.

    bench/compare_builds.py OLD_DIR NEW_DIR [--rounds N] [--bench "NAME ARGS..."]...

OLD_DIR and NEW_DIR each hold a build's benchmark binaries next to the
libvgpu.so and libsimgpu.so they measure (a copy of target/release). Each
round runs every benchmark once from the old build and once from the new
one, alternating which goes first, so both see the same machine. Every
number a benchmark prints is matched by its place in the output (the line
with its numbers blanked out, and its position on that line); the table
gives the median over rounds of each figure that varies, for both builds,
and new/old.
"""

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

# name, arguments: sizes that keep a round within a minute or two.
DEFAULT_BENCHES = [
    ("vgpu-bench", ["--repeats", "5", "--alloc-iterations", "50000", "--launch-iterations", "5000000"]),
    ("vgpu-monitor-bench", []),
    ("vgpu-scheduler-bench", ["--quick"]),
]


def figures(output):
    """Maps (line shape, position) to the number found there."""
    found = {}
    seen = defaultdict(int)
    for line in output.splitlines():
        numbers = NUMBER.findall(line)
        if not numbers:
            continue
        shape = NUMBER.sub("#", line).strip()
        seen[shape] += 1
        shape = f"{shape} [{seen[shape]}]" if seen[shape] > 1 else shape
        for position, text in enumerate(numbers):
            found[(shape, position)] = float(text)
    return found


def run(binary, args):
    # Each build measures the libvgpu.so beside it: a VGPU_SHIM_LIBRARY left
    # in the environment would make both builds load the same shim.
    env = {key: value for key, value in os.environ.items() if key != "VGPU_SHIM_LIBRARY"}
    result = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=900, check=False, env=env
    )
    if result.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--bench",
        action="append",
        metavar='"NAME ARGS"',
        help="a benchmark binary and its arguments, quoted as one (repeatable)",
    )
    options = parser.parse_args()
    benches = DEFAULT_BENCHES
    if options.bench:
        benches = []
        for text in options.bench:
            words = shlex.split(text)
            if not words:
                sys.exit("--bench needs a benchmark name")
            benches.append((words[0], words[1:]))
    if options.rounds < 1:
        sys.exit("--rounds must be at least 1")
    for build in (options.old, options.new):
        for name, _ in benches:
            if not (build / name).is_file():
                sys.exit(f"{build / name} is missing")

    samples = {name: {"old": defaultdict(list), "new": defaultdict(list)} for name, _ in benches}
    for round_index in range(options.rounds):
        order = ["old", "new"] if round_index % 2 == 0 else ["new", "old"]
        for name, args in benches:
            for build in order:
                directory = options.old if build == "old" else options.new
                output = run(directory / name, args)
                for key, value in figures(output).items():
                    samples[name][build][key].append(value)
        print(f"round {round_index + 1}/{options.rounds} done", file=sys.stderr)

    print(f"old: {options.old}  new: {options.new}  rounds: {options.rounds} (medians)\n")
    print("| benchmark | figure | # | old | new | new/old |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for name, _ in benches:
        old, new = samples[name]["old"], samples[name]["new"]
        for key in old:
            if key not in new or len(old[key]) != options.rounds or len(new[key]) != options.rounds:
                continue
            values = old[key] + new[key]
            if max(values) == min(values):
                continue  # a label or a size, not a measurement
            old_median = statistics.median(old[key])
            new_median = statistics.median(new[key])
            ratio = new_median / old_median if old_median else float("nan")
            if old_median > 0 and new_median > 0:
                worst = max(worst, abs(ratio - 1.0))
            shape, position = key
            label = shape if len(shape) <= 90 else shape[:87] + "..."
            print(f"| {name} | {label} | {position} | {old_median:g} | {new_median:g} | {ratio:.3f} |")
    print(f"\nlargest change of a positive figure: {worst * 100:.1f} %")


if __name__ == "__main__":
    main()
