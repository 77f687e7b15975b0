"""Sandboxes for running real Python CUDA/NVML clients under the shim.

Each test gets its own simulated GPU (driver state file) and container
region. Clients run in subprocesses so the shim is preloaded from the start,
as in a container.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = pathlib.Path(os.environ.get("VGPU_TARGET_DIR", ROOT / "target" / "debug")).resolve()


def _library(name):
    path = TARGET / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build the workspace first (cargo build --workspace)")
    return path


def shim_library():
    """The shim under test: $VGPU_SHIM_LIBRARY when set (scripts/test points
    it at the shipped glibc-2.17 build), as in testkit::shim_library(); else
    the libvgpu.so in the target directory."""
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    if not named:
        return _library("libvgpu.so")
    path = pathlib.Path(named).resolve()
    if not path.is_file():
        pytest.fail(f"VGPU_SHIM_LIBRARY={named} is missing: build it first (see scripts/test)")
    return path


class Sandbox:
    def __init__(self, tmp_path, memory="16Gi"):
        self.dir = tmp_path
        lib = tmp_path / "lib"
        lib.mkdir()
        simulated = _library("libsimgpu.so")
        for alias in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
            (lib / alias).symlink_to(simulated)
        self.region = tmp_path / "region.cache"
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(lib),
            "SIMGPU_DEVICES": "1",
            "SIMGPU_MEMORY": memory,
            "SIMGPU_STATE": str(tmp_path / "simgpu.state"),
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(self.region),
            "VGPU_CONTEXT_RESERVE": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.shim = str(shim_library())

    def python(self, code, shim=True, **kwargs):
        """Runs `code` in a fresh interpreter; returns its last stdout line
        parsed as JSON."""
        env = dict(self.env)
        if shim:
            env["LD_PRELOAD"] = self.shim
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False, **kwargs
        )
        assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        return json.loads(result.stdout.strip().splitlines()[-1])

    def spawn(self, code, shim=True):
        env = dict(self.env)
        if shim:
            env["LD_PRELOAD"] = self.shim
        return subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )


@pytest.fixture
def sandbox(tmp_path):
    return Sandbox(tmp_path)
