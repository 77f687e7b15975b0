#!/usr/bin/env python3
"""The test node's container runtime: runc, with the simulated GPU's driver
given to containers the way NVIDIA's container runtime gives the real one.

containerd calls this in runc's place (`BinaryName`) with runc's own
arguments. On `create` of a container that gets GPUs (named by
`NVIDIA_VISIBLE_DEVICES` or, as the toolkit reads them when told to, by
mounts under /var/run/nvidia-container-devices: see `requested`), it edits
the bundle's OCI config before runc reads it: the driver
(`libsimgpu.so`) mounted read-only as `libcuda.so.1` and
`libnvidia-ml.so.1` where Debian keeps libraries, the node's simulated-GPU
state folder mounted (every container on the node shares one device
timeline, as processes share one GPU), and the simulated GPU's settings
plus the visible devices in its environment. Every other call goes to runc
unchanged.

    gpu_runtime.py SETTINGS.json RUNC-ARGUMENTS...

SETTINGS.json: {"runc": path, "driver": libsimgpu.so, "state_dir": folder,
"library_dir": in the container, "env": {SIMGPU_*: value},
"accept_envvar_unprivileged": bool (default true, as the toolkit's),
"accept_volume_mounts": bool (default false)}, read at every `create`, so a
test may change the toolkit's settings while the node runs.
"""

from __future__ import annotations

import json
import os
import sys

# NVIDIA_VISIBLE_DEVICES values that ask for no GPU.
NO_GPU = {"", "void", "none"}
# Where the toolkit reads a container's GPUs from mounts, one per GPU.
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
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


def requested(config: dict, settings: dict) -> str:
    """The GPUs a container gets, as NVIDIA's runtime reads them under the
    toolkit's two settings: with `accept_volume_mounts`
    (accept-nvidia-visible-devices-as-volume-mounts, default off), the
    names of the mounts under DEVICE_LIST_DIR, if any; else
    NVIDIA_VISIBLE_DEVICES, in a privileged container (every capability:
    CAP_SYS_ADMIN among them) or where `accept_envvar_unprivileged`
    (accept-nvidia-visible-devices-envvar-when-unprivileged, default on)."""
    if settings.get("accept_volume_mounts", False):
        listed = [os.path.basename(mount["destination"].rstrip("/")) for mount in config.get("mounts", [])
                  if os.path.dirname(mount.get("destination", "").rstrip("/")) == DEVICE_LIST_DIR]
        if listed:
            return ",".join(listed)
    process = config.get("process", {})
    privileged = "CAP_SYS_ADMIN" in process.get("capabilities", {}).get("bounding", [])
    if not (privileged or settings.get("accept_envvar_unprivileged", True)):
        return ""
    values = dict(entry.split("=", 1) for entry in process.get("env", []) if "=" in entry)
    return values.get("NVIDIA_VISIBLE_DEVICES", "").strip()


def give_gpus(config: dict, settings: dict) -> bool:
    """Adds the driver to `config` when its process gets GPUs."""
    env = config.get("process", {}).get("env", [])
    visible = requested(config, settings)
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
