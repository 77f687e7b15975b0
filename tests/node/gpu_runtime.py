#!/usr/bin/env python3
"""The test node's container runtime: runc, with the simulated GPU's driver
given to containers the way NVIDIA's container runtime gives the real one.

containerd calls this in runc's place (`BinaryName`) with runc's own
arguments. On `create` of a container whose environment names GPUs
(`NVIDIA_VISIBLE_DEVICES`, as the device plugin and the chart's node agent
set it), it edits the bundle's OCI config before runc reads it: the driver
(`libsimgpu.so`) mounted read-only as `libcuda.so.1` and
`libnvidia-ml.so.1` where Debian keeps libraries, the node's simulated-GPU
state folder mounted (every container on the node shares one device
timeline, as processes share one GPU), and the simulated GPU's settings
plus the visible devices in its environment. Every other call goes to runc
unchanged.

    gpu_runtime.py SETTINGS.json RUNC-ARGUMENTS...

SETTINGS.json: {"runc": path, "driver": libsimgpu.so, "state_dir": folder,
"library_dir": in the container, "env": {SIMGPU_*: value}}.
"""

from __future__ import annotations

import json
import os
import sys

# NVIDIA_VISIBLE_DEVICES values that ask for no GPU.
NO_GPU = {"", "void", "none"}
# runc options that take a value (so the subcommand is found after them).
VALUED_GLOBAL_OPTIONS = {"--root", "--log", "--log-format", "--criu", "--rootless"}


def subcommand(argv: list[str]) -> tuple[str | None, int]:
    index = 0
    while index < len(argv):
        word = argv[index]
        if word in VALUED_GLOBAL_OPTIONS:
            index += 2
            continue
        if word.startswith("-"):
            index += 1
            continue
        return word, index
    return None, index


def bundle_of(arguments: list[str]) -> str:
    for index, word in enumerate(arguments):
        if word in ("--bundle", "-b") and index + 1 < len(arguments):
            return arguments[index + 1]
        if word.startswith("--bundle="):
            return word.split("=", 1)[1]
    return os.getcwd()


def give_gpus(config: dict, settings: dict) -> bool:
    """Adds the driver to `config` when its process asks for GPUs."""
    env = config.get("process", {}).get("env", [])
    values = dict(entry.split("=", 1) for entry in env if "=" in entry)
    visible = values.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if visible.lower() in NO_GPU:
        return False
    mounts = config.setdefault("mounts", [])
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        mounts.append({"destination": f"{settings['library_dir']}/{name}", "type": "bind",
                       "source": settings["driver"], "options": ["rbind", "ro", "nosuid", "nodev"]})
    mounts.append({"destination": settings["state_dir"], "type": "bind", "source": settings["state_dir"],
                   "options": ["rbind", "rw", "nosuid", "nodev"]})
    # The real runtime shows a container only the GPUs it names (by index
    # or UUID, or "all").
    added = {**settings["env"], "SIMGPU_VISIBLE_DEVICES": visible}
    kept = [entry for entry in env if entry.split("=", 1)[0] not in added]
    config["process"]["env"] = kept + [f"{key}={value}" for key, value in added.items()]
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: gpu_runtime.py SETTINGS.json RUNC-ARGUMENTS...", file=sys.stderr)
        return 2
    with open(argv[1]) as file:
        settings = json.load(file)
    arguments = argv[2:]
    command, at = subcommand(arguments)
    if command == "create":
        path = os.path.join(bundle_of(arguments[at + 1:]), "config.json")
        with open(path) as file:
            config = json.load(file)
        if give_gpus(config, settings):
            with open(path + ".new", "w") as file:
                json.dump(config, file)
            os.replace(path + ".new", path)
    os.execv(settings["runc"], [settings["runc"], *arguments])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
