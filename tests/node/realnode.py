"""A real Kubernetes node for the tests: kubelet, containerd 2.x and runc
(built by tests/node/build; runc and the CNI plugins are Debian's), joined
to a test control plane with a node identity (a `system:node:<name>`
client certificate, so the API server's Node authorizer and NodeRestriction
apply to it).

Each node has a network namespace of its own (joined to the control
plane's by a veth pair, its pods on a bridge in a /24 of their own) and a
mount namespace of its own, where its folder stands for the paths a node
owns: /var/lib/kubelet (whose device-plugin directory kubelet fixes),
/var/lib/containerd, /run/containerd, the CNI and CDI folders, the pod
logs, and vgpu's /usr/local/vgpu. Its containers get the simulated GPU the
way NVIDIA's runtime gives the real driver (tests/node/gpu_runtime.py).
kubelet's cgroups go under a cgroup root of the node's own, on cgroup v1 or
v2, whichever the machine has. Needs root.

    with RealNode(cluster, hub, 1, workdir, simulated_gpu=...) as node:
        node.import_image(archive)
        ...
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests/cluster"))
from controlplane import SERVICE_IP, ControlPlane, ControlPlaneError, Started, kubeconfig, openssl  # noqa: E402
from nodenet import TestNetwork, _ip, add_node_network  # noqa: E402

# Pods of node i get 198.19.i.0/24 (the benchmarking range, never routed;
# the simulated nodes' links are in 198.18.0.0/16).
POD_NET = "198.19"
LINK_NET = "198.18"
CGROUP = Path("/sys/fs/cgroup")
# Paths a node owns, each backed by a folder of the node's own in its
# mount namespace.
NODE_PATHS = ("var/lib/kubelet", "var/lib/containerd", "run/containerd", "run/nri", "run/netns", "var/lib/cni",
              "etc/cni/net.d", "etc/cdi", "var/run/cdi", "var/log/pods", "var/log/containers", "usr/local/vgpu")
# Where Debian (the image's base) keeps libraries: the driver goes there.
LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
# The simulated GPU's state, shared by every container of the node.
STATE_DIR = "/run/simgpu"


class NodeError(ControlPlaneError):
    """The node could not be started, or did something unexpected."""


def node_binaries() -> Path:
    """Where tests/node/build put kubelet and containerd (it builds them
    once per pinned version)."""
    done = subprocess.run([str(HERE / "build"), "--print-dir"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"tests/node/build failed: {done.stderr.strip()[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def missing_tools() -> list[str]:
    found = [tool for tool in ("runc", "nsenter", "iptables") if not shutil.which(tool)]
    if not Path("/usr/lib/cni/bridge").is_file():
        found.append("containernetworking-plugins (/usr/lib/cni)")
    return found


def snapshotter_for(folder: Path) -> str:
    """containerd's snapshotter for images kept under `folder`: overlayfs,
    unless the folder is itself on an overlay (a machine that is a
    container), where the kernel refuses another overlay: then native
    (plain copies)."""
    done = subprocess.run(["stat", "-fc", "%T", str(folder)], capture_output=True, text=True, check=False)
    return "native" if done.stdout.strip() == "overlayfs" else "overlayfs"


def cgroup_v2() -> bool:
    """Whether /sys/fs/cgroup is the unified hierarchy (else v1: one
    hierarchy per controller)."""
    done = subprocess.run(["stat", "-fc", "%T", str(CGROUP)], capture_output=True, text=True, check=False)
    return done.stdout.strip() == "cgroup2fs"


class RealNode(Started):
    """Node `name` (number `index`, 1-250) with `gpus` simulated GPUs of
    `memory` each, labelled `labels`."""

    def __init__(self, cluster: ControlPlane, hub: TestNetwork, index: int, workdir: Path,
                 simulated_gpu: Path, name: str | None = None, gpus: int = 2, memory: str = "16Gi",
                 labels: dict[str, str] | None = None):
        self.cluster = cluster
        self.hub = hub
        self.index = index
        self.workdir = workdir.resolve()
        self.name = name or f"node-{index}"
        self.gpus = gpus
        self.memory = memory
        self.labels = labels or {}
        self.simulated_gpu = simulated_gpu.resolve()
        self.namespace = f"{hub.name}-r{index}"
        self.address = f"{LINK_NET}.{index}.2"
        self.hub_address = f"{LINK_NET}.{index}.1"
        self.pod_subnet = f"{POD_NET}.{index}.0/24"
        self.host = self.workdir / "host"
        self.bin = node_binaries()
        self.cgroup_root = f"/{self.namespace}"
        self.holder: subprocess.Popen | None = None
        self.processes: dict[str, subprocess.Popen] = {}

    # Life cycle ----------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._network()
        self._mount_namespace()
        self._cgroups()
        self._credentials()
        self._configure()
        self.start_containerd()
        self.start_kubelet()

    def stop(self) -> None:
        """Stops kubelet, containerd and every container of the node, then
        removes its namespaces and cgroups."""
        for name in ("kubelet", "containerd"):
            self._stop(name)
        self._kill_cgroups()
        if self.holder is not None:
            # Container mounts live in the node's mount namespace: they go
            # with it.
            self.holder.kill()
            self.holder.wait()
            self.holder = None
        subprocess.run(["ip", "netns", "exec", self.hub.name, "ip", "route", "del", self.pod_subnet],
                       capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)
        self._remove_cgroups()
        # The images and containers' files (a gigabyte a node); the logs
        # stay for whoever reads the test's folder.
        shutil.rmtree(self.host / "var/lib/containerd", ignore_errors=True)

    def start_containerd(self) -> None:
        self._spawn("containerd", [str(self.bin / "containerd"), "--config", str(self.workdir / "containerd.toml")])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self._alive("containerd")
            if self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise NodeError(f"containerd on {self.name} never answered:\n{self.log('containerd')[-3000:]}")

    def start_kubelet(self) -> None:
        labels = ",".join(f"{key}={value}" for key, value in self.labels.items())
        self._spawn("kubelet", [
            str(self.bin / "kubelet"), f"--config={self.workdir / 'kubelet.yaml'}",
            f"--kubeconfig={self.workdir / 'kubelet.kubeconfig'}", "--root-dir=/var/lib/kubelet",
            f"--hostname-override={self.name}", f"--node-ip={self.address}",
            *([f"--node-labels={labels}"] if labels else []), "--v=2"])

    def restart(self, name: str) -> None:
        """Stops `name` (kubelet or containerd) and starts it again; the
        containers keep running (their shims are not containerd's
        children)."""
        self._stop(name)
        {"kubelet": self.start_kubelet, "containerd": self.start_containerd}[name]()

    # Use -----------------------------------------------------------------

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run in the node's network and mount namespaces."""
        if self.holder is None:
            raise NodeError(f"{self.name} is not running")
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", "--", *argv]

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command([str(self.bin / "ctr"), "--namespace=k8s.io", *args]),
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} on {self.name}: {done.stderr.strip()[-2000:]}")
        return done

    def import_image(self, archive: Path) -> None:
        """A docker-archive into the node's containerd, for pods that name
        it (pull policy Never or IfNotPresent: nothing is pulled here)."""
        self.ctr("images", "import", str(archive))

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def container_log(self, namespace: str, pod: str, container: str) -> str:
        """The newest log of `container` in pod `namespace/pod`."""
        found = sorted((self.host / "var/log/pods").glob(f"{namespace}_{pod}_*/{container}/*.log"),
                       key=lambda path: path.stat().st_mtime)
        if not found:
            return ""
        # CRI log lines: TIME STREAM TAG TEXT.
        return "".join(line.split(" ", 3)[3] if line.count(" ") >= 3 else line
                       for line in found[-1].read_text(errors="replace").splitlines(keepends=True))

    def pids_named(self, name: str) -> list[int]:
        """Host PIDs of the node's processes (its daemons and containers)
        whose command name (`/proc/PID/comm`) is `name`."""
        found = set()
        for folder in self._cgroup_dirs():
            for procs in folder.rglob("cgroup.procs"):
                try:
                    pids = procs.read_text().split()
                except OSError:
                    continue  # a cgroup removed while read
                for pid in pids:
                    try:
                        if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                            found.add(int(pid))
                    except OSError:
                        continue  # a process gone while read
        return sorted(found)

    def get(self, url: str, timeout: float = 5) -> str:
        """GET `url` from inside the node's network."""
        code = ("import sys, urllib.request; "
                f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode())")
        done = subprocess.run(["ip", "netns", "exec", self.namespace, sys.executable, "-c", code],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise OSError(f"GET {url} from {self.name}: {done.stderr.strip()[-500:]}")
        return done.stdout

    # Set-up --------------------------------------------------------------

    def _network(self) -> None:
        add_node_network(self.hub, self.namespace, f"vr{os.getpid() % 100000}x{self.index}", self.address,
                         self.hub_address)
        # The node's pods are reached through the node (the API server
        # calls webhooks at pod addresses).
        _ip("netns", "exec", self.hub.name, "ip", "route", "add", self.pod_subnet, "via", self.address)
        for namespace in (self.hub.name, self.namespace):
            _ip("netns", "exec", namespace, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        # No kube-proxy: the `kubernetes` Service's address, which in-cluster
        # clients are given, leads to the API server.
        api = f"{self.cluster.address}:{self.cluster.api_port}"
        for chain in ("PREROUTING", "OUTPUT"):
            _ip("netns", "exec", self.namespace, "iptables", "-t", "nat", "-A", chain, "-d", f"{SERVICE_IP}/32",
                "-p", "tcp", "--dport", "443", "-j", "DNAT", "--to-destination", api)

    def _mount_namespace(self) -> None:
        """A process holding the node's mount namespace (a slave of the
        host's) in its network namespace, with the node's folders over the
        paths a node owns. Not `ip netns exec`: it mounts a /sys of its own,
        which hides the cgroup hierarchies kubelet and runc need."""
        binds = []
        for path in NODE_PATHS:
            (self.host / path).mkdir(parents=True, exist_ok=True)
            binds.append(f"mkdir -p /{path} && mount --bind {self.host / path} /{path}")
        state = self.workdir / "simgpu"
        state.mkdir(exist_ok=True)
        # Containers running as any user share the device's state file.
        state.chmod(0o1777)
        binds.append(f"mkdir -p {STATE_DIR} && mount --bind {state} {STATE_DIR}")
        script = " && ".join(binds) + " && echo ready && exec sleep infinity"
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "slave",
                                        "nsenter", f"--net=/run/netns/{self.namespace}", "sh", "-c", script],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.holder.stdout.readline() if self.holder.stdout else ""
        if line.strip() != "ready":
            error = self.holder.stderr.read() if self.holder.stderr else ""
            raise NodeError(f"{self.name}'s mount namespace: {error.strip()}")

    def _cgroup_dirs(self) -> list[Path]:
        if cgroup_v2():
            return [CGROUP / self.cgroup_root.lstrip("/")]
        return [CGROUP / controller / self.cgroup_root.lstrip("/")
                for controller in sorted(os.listdir(CGROUP))
                if (CGROUP / controller / "cgroup.procs").exists() and not (CGROUP / controller).is_symlink()]

    def _cgroups(self) -> None:
        """kubelet's cgroup root, in every hierarchy (v1) or the unified
        one (v2), with the controllers kubelet needs enabled for its
        children."""
        for folder in self._cgroup_dirs():
            # The root kubelet is given, and a leaf beside its pods for the
            # node's own daemons (v2 lets no process sit in a cgroup whose
            # children have controllers).
            for cgroup in (folder, folder / "daemons"):
                cgroup.mkdir(exist_ok=True)
                # A cpuset cgroup takes no process until it has CPUs and
                # memory nodes (v1 starts them empty).
                for name in ("cpuset.cpus", "cpuset.mems"):
                    own, parent = cgroup / name, cgroup.parent / name
                    if own.exists() and not own.read_text().strip():
                        own.write_text(parent.read_text())
            if cgroup_v2():
                wanted = set((CGROUP / "cgroup.subtree_control").read_text().split())
                (folder / "cgroup.subtree_control").write_text(" ".join(f"+{name}" for name in sorted(wanted)))

    def _kill_cgroups(self) -> None:
        """Every process left under the node's cgroups (its containers and
        shims), killed."""
        for folder in self._cgroup_dirs():
            for procs in folder.rglob("cgroup.procs"):
                try:
                    for pid in procs.read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    continue

    def _remove_cgroups(self) -> None:
        deadline = time.monotonic() + 10
        for folder in self._cgroup_dirs():
            if not folder.exists():
                continue
            for child in sorted((path for path in folder.rglob("*") if path.is_dir()),
                                key=lambda path: len(path.parts), reverse=True) + [folder]:
                while True:
                    try:
                        child.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        # Killed processes leave their cgroup a moment later.
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.05)

    def _credentials(self) -> None:
        """kubelet's client certificate: user system:node:<name> in group
        system:nodes, signed by the cluster's CA."""
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        ca = self.cluster.pki
        (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet.key", "-out", "kubelet.csr",
                "-subj", f"/O=system:nodes/CN=system:node:{self.name}", cwd=pki)
        openssl("x509", "-req", "-in", "kubelet.csr", "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
                "-CAcreateserial", "-out", "kubelet.crt", "-days", "2", "-extfile", "client.ext", cwd=pki)
        (self.workdir / "kubelet.kubeconfig").write_text(kubeconfig(self.cluster.server, ca, {
            "client-certificate": str(pki / "kubelet.crt"), "client-key": str(pki / "kubelet.key")}))

    def _configure(self) -> None:
        runtime_settings = self.workdir / "gpu-runtime.json"
        runtime_settings.write_text(json.dumps({
            "runc": shutil.which("runc"), "driver": str(self.simulated_gpu), "state_dir": STATE_DIR,
            "library_dir": LIBRARY_DIR,
            "env": {"SIMGPU_DEVICES": str(self.gpus), "SIMGPU_MEMORY": self.memory,
                    "SIMGPU_STATE": f"{STATE_DIR}/state", "SIMGPU_UUID_SEED": str(self.index)},
        }))
        runtime = self.workdir / "gpu-runtime"
        runtime.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'gpu_runtime.py'} {runtime_settings} \"$@\"\n")
        runtime.chmod(0o755)
        runtimes = "".join(f"""
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{name}]
  runtime_type = 'io.containerd.runc.v2'
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{name}.options]
  BinaryName = '{runtime}'
  SystemdCgroup = false
""" for name in ("runc", "nvidia"))
        (self.workdir / "containerd.toml").write_text(f"""version = 3
root = '/var/lib/containerd'
state = '/run/containerd'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = '{snapshotter_for(self.host / "var/lib/containerd")}'
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{PAUSE_IMAGE}'

[plugins.'io.containerd.cri.v1.runtime']
  # Lowering a process's oom_score_adj needs CAP_SYS_RESOURCE, which a test
  # machine may not give (every sandbox would fail).
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
{runtimes}
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['/usr/lib/cni']
  conf_dir = '/etc/cni/net.d'
""")
        (self.host / "etc/cni/net.d/10-pods.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "pods", "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_subnet}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}))
        (self.workdir / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.address,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            # This machine may have cgroup v1, which kubelet refuses unless told.
            "failCgroupV1": False,
            "failSwapOn": False,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.cluster.pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "podLogsDir": "/var/log/pods",
            "resolvConf": "/etc/resolv.conf",
            # The test machine's disk is shared and may be fuller than a
            # production node's thresholds allow (a full test run here left
            # 2 % free, and kubelet evicted the node agent): evict only when
            # it is truly out.
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "100Mi",
                             "imagefs.available": "100Mi", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "5s",
        }))

    # Processes -----------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "a")  # noqa: SIM115 -- open while the process runs
        env = dict(os.environ, PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        daemons = " ".join(str(folder / "daemons" / "cgroup.procs") for folder in self._cgroup_dirs())
        # kubelet, containerd and the shims containerd starts live in the
        # node's cgroups, so stopping the node finds every one of them.
        joined = ["sh", "-c", f'for procs in {daemons}; do echo $$ > "$procs"; done; exec "$@"', name, *argv]
        self.processes[name] = subprocess.Popen(self.command(joined), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()

    def _alive(self, name: str) -> None:
        process = self.processes.get(name)
        if process is None or process.poll() is not None:
            code = process.returncode if process else None
            raise NodeError(f"{name} on {self.name} exited ({code}):\n{self.log(name)[-3000:]}")

    def _stop(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# The sandbox image containerd is pinned to (made by the tests, never pulled).
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"
