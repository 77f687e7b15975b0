"""Simulated nodes for the cluster tests: each one is `simnode` (the real
kubelet's device-plugin code, see kube/simnode/main.go) in a network
namespace of its own, joined to the control plane's namespace by a veth
pair, with a folder of its own standing for its disk (`/var/lib/kubelet`,
`/usr/local/vgpu`, ...) and simulated GPUs (libsimgpu.so as the driver,
state shared by the node's processes only). Containers are made from one
root folder (`NodeImage`): the host's /usr, its own /etc, and our binaries
where the chart's images have them. Needs root.

    with TestNetwork() as hub, ControlPlane(dir, network=hub) as cluster:
        image = NodeImage(dir / "image", binaries)
        with SimulatedNode(cluster, hub, 1, image, dir / "node-1") as node:
            ...
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from controlplane import ControlPlane, ControlPlaneError, Started  # noqa: E402
from nodenet import TestNetwork, _ip, add_node_network  # noqa: E402

# Node networks come from the benchmarking range (198.18.0.0/15, RFC 2544):
# never routed, and not the host's own.
NODE_NET = "198.18"


class NodeImage:
    """The root folder every simulated container is made from, and the
    mounts that complete it: the host's /usr (read-only) with a /usr/local
    of its own holding `binaries` ({path in the image: file on this
    machine}), its own /etc (a copy), a tmpfs /tmp, and `shared` folders at
    their own paths (the test's folder, the repository)."""

    def __init__(self, root: Path, binaries: dict[str, Path], shared: list[Path]):
        self.root = root
        self.binaries = binaries
        self.shared = [path.resolve() for path in shared]
        if not root.exists():
            self._make()

    def _make(self) -> None:
        staging = self.root.with_name(self.root.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copytree("/etc", staging / "etc", symlinks=True, ignore_dangling_symlinks=True,
                        ignore=shutil.ignore_patterns("ld.so.preload"))
        # An empty ld.so.preload to mount the plugin's over.
        (staging / "etc/ld.so.preload").write_text("")
        for name in ("usr", "var/run", "var/lib", "tmp", "host", "root", "run", "dev", "sys", "proc"):
            (staging / name).mkdir(parents=True, exist_ok=True)
        (staging / "tmp").chmod(0o1777)
        for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                (staging / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                (staging / name).mkdir()
        staging.rename(self.root)

    def mounts(self) -> list[str]:
        """simnode's --mount flags, in order."""
        flags = ["bind:/usr:/usr:ro", "tmpfs:/usr/local"]
        for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
            host = Path("/") / name
            if host.is_dir() and not host.is_symlink():
                flags.append(f"bind:{host}:/{name}:ro")
        for inside, outside in sorted(self.binaries.items()):
            flags.append(f"bind:{Path(outside).resolve()}:{inside}:ro")
        flags.append("tmpfs:/tmp")
        for path in self.shared:
            flags.append(f"bind:{path}:{path}")
        return flags


class SimulatedNode(Started):
    """A node named `name` (number `index`, 1-250) with `gpus` simulated
    GPUs of `memory` each, named `gpu_name` (the simulated GPU's own name
    when None), with the simulated GPU's further settings in `gpu_env`
    (e.g. its topology: SIMGPU_NUMA, SIMGPU_NVLINK)."""

    def __init__(self, cluster: ControlPlane, hub: TestNetwork, index: int, image: NodeImage, workdir: Path,
                 name: str | None = None, gpus: int = 2, memory: str = "16Gi", labels: dict[str, str] | None = None,
                 simulated_gpu: Path | None = None, gpu_name: str | None = None,
                 gpu_env: dict[str, str] | None = None):
        self.cluster = cluster
        self.gpu_name = gpu_name
        self.gpu_env = gpu_env or {}
        self.hub = hub
        self.index = index
        self.image = image
        self.workdir = workdir.resolve()
        self.name = name or f"node-{index}"
        self.gpus = gpus
        self.memory = memory
        self.labels = labels or {}
        self.simulated_gpu = simulated_gpu
        self.namespace = f"{hub.name}-n{index}"
        self.address = f"{NODE_NET}.{index}.2"
        self.hub_address = f"{NODE_NET}.{index}.1"
        self.host_root = self.workdir / "host"
        self.process: subprocess.Popen | None = None

    # Life cycle ----------------------------------------------------------

    def start(self) -> None:
        self._network()
        for path in ("var/lib/kubelet/device-plugins", "usr/local/vgpu"):
            (self.host_root / path).mkdir(parents=True, exist_ok=True)
        driver = self.workdir / "driver"
        driver.mkdir(parents=True, exist_ok=True)
        if self.simulated_gpu is None:
            raise ControlPlaneError("a simulated node needs libsimgpu.so (simulated_gpu)")
        for alias in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
            link = driver / alias
            if not link.is_symlink():
                link.symlink_to(self.simulated_gpu.resolve())
        runtime_env = {
            "LD_LIBRARY_PATH": str(driver),
            "SIMGPU_DEVICES": str(self.gpus),
            "SIMGPU_MEMORY": self.memory,
            "SIMGPU_STATE": str(self.workdir / "simgpu.state"),
            "SIMGPU_UUID_SEED": str(self.index),
        }
        if self.gpu_name:
            runtime_env["SIMGPU_NAME"] = self.gpu_name
        runtime_env.update(self.gpu_env)
        argv = [
            str(self.cluster.bin / "simnode"), f"--name={self.name}", f"--kubeconfig={self.cluster.admin_kubeconfig}",
            f"--address={self.address}", f"--host-root={self.host_root}", f"--rootfs={self.image.root}",
            f"--workdir={self.workdir}", f"--api-host={self.cluster.address}", f"--api-port={self.cluster.api_port}",
            *[f"--mount={flag}" for flag in self.image.mounts()],
            *[f"--runtime-env={key}={value}" for key, value in runtime_env.items()],
            # The NVIDIA runtime's part: a container sees the GPUs its
            # NVIDIA_VISIBLE_DEVICES names, and no others.
            "--gpu-visibility-env=SIMGPU_VISIBLE_DEVICES",
            *[f"--label={key}={value}" for key, value in self.labels.items()],
        ]
        log = open(self.workdir / "simnode.log", "w")  # noqa: SIM115 -- open while the process runs
        self.process = subprocess.Popen(self.command(argv), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ControlPlaneError(f"simnode {self.name} exited with {self.process.returncode}:\n{self.log()}")
            if "node up" in self.log():
                return
            time.sleep(0.1)
        raise ControlPlaneError(f"simnode {self.name} did not come up:\n{self.log()}")

    def stop(self) -> None:
        """Stops the node and its containers, removes its network."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)

    def _network(self) -> None:
        add_node_network(self.hub, self.namespace, f"vg{os.getpid() % 100000}x{self.index}", self.address,
                         self.hub_address)

    # Use -----------------------------------------------------------------

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run in the node's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def log(self) -> str:
        path = self.workdir / "simnode.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def pod_dir(self, namespace: str, name: str) -> Path | None:
        """Where the node keeps pod `namespace/name`'s volumes and logs."""
        found = sorted((self.workdir / "pods").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        folder = self.pod_dir(namespace, pod)
        path = folder / f"{container}.log" if folder else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def get(self, url: str, timeout: float = 5) -> str:
        """GET `url` from inside the node's network."""
        code = ("import sys, urllib.request; "
                f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode())")
        done = subprocess.run(self.command([sys.executable, "-c", code]), capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise OSError(f"GET {url} from {self.name}: {done.stderr.strip()[-500:]}")
        return done.stdout


def enable_forwarding(hub: TestNetwork) -> None:
    """Lets nodes reach each other through the hub (as nodes of one
    cluster network do)."""
    _ip("netns", "exec", hub.name, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")

