#!/usr/bin/env python3
"""A local Kubernetes control plane of real components, for tests and by hand.

Starts etcd, kube-apiserver (RBAC, admission webhooks, service-account
tokens), kube-controller-manager and kube-scheduler from the binaries
`tests/cluster/build` makes, all on loopback ports, waits until each is
healthy, and writes an admin kubeconfig. Stopping it stops exactly the
processes it started (by pid) and nothing else.

    python3 tests/cluster/controlplane.py up [--dir DIR] [--api-only]
        runs until Ctrl-C (or SIGTERM); prints the kubeconfig's path.
        --api-only: etcd and kube-apiserver alone (what the Rust
        integration tests start, one per test, through vgpu-testkit).

From Python (the tests):

    with ControlPlane(workdir) as cluster:
        cluster.kubectl("get", "namespaces")
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SERVICE_RANGE = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service's address in that range


class ControlPlaneError(Exception):
    """A component could not be started or never became healthy."""


def binaries() -> Path:
    """Where `tests/cluster/build` put the binaries (it prints the folder)."""
    done = subprocess.run([str(HERE / "build"), "--print-dir"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"tests/cluster/build failed: {done.stderr.strip()[-2000:]}")
    folder = Path(done.stdout.strip().splitlines()[-1])
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm", "simnode"):
        if not (folder / name).is_file():
            raise ControlPlaneError(f"{folder / name} is missing: run tests/cluster/build")
    return folder


# Ports are picked from here up to the start of the kernel's ephemeral
# range (see `free_port`).
LOWEST_PORT = 20000
# How many times a component is started on fresh ports when one it was
# given was taken before it could bind it.
BIND_ATTEMPTS = 4


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nothing listens on now, picked at random below the
    ephemeral range. A port from bind(0) lies inside that range, where any
    outgoing connection on the machine can take it as its source port
    between this check and the server's own bind: CI saw kube-apiserver
    fail so ("address already in use") while many control planes started
    at once. What remains (two tests picking the same port) is handled by
    `ControlPlane` starting a component again on fresh ports."""
    low = ephemeral_range()[0]
    if low - LOWEST_PORT < 1000:
        # An unusual range leaves no room below it: fall back to the kernel's pick.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    for _ in range(200):
        port = random.randrange(LOWEST_PORT, low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ControlPlaneError(f"no free loopback port between {LOWEST_PORT} and {low}")


def openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)}: {done.stderr.strip()}")


# Made certificates are kept here, one set per API server address and day,
# and copied into each control plane's `pki`: the Rust integration tests
# start well over a hundred API servers, and making the four RSA keys took
# one to one and a half seconds of each start on a 2-core machine.
PKI_CACHE = Path(tempfile.gettempdir()) / "vgpu-test-pki"


def make_certificates(pki: Path, address: str) -> None:
    """A CA, the API server's serving certificate (for `address` too), an
    admin client certificate (group system:masters) and the service-account
    key pair: today's set for `address`, made by the first control plane
    to need it (the certificates last two days)."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    # A change to how they are made makes a new set the same day.
    how = hashlib.sha256(inspect.getsource(write_certificates).encode()).hexdigest()[:12]
    cached = PKI_CACHE / f"{address}-{SERVICE_IP}-{day}-{how}"
    if not (cached / "sa.pub").exists():
        PKI_CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".making-", dir=PKI_CACHE))
        write_certificates(staging, address)
        try:
            # Whole or not at all: a rename onto a set another process
            # finished meanwhile fails, and that set is used.
            staging.rename(cached)
        except OSError:
            if not (cached / "sa.pub").exists():
                raise
            for made in staging.iterdir():
                made.unlink()
            staging.rmdir()
    pki.mkdir(parents=True, exist_ok=True)
    for made in cached.iterdir():
        shutil.copy(made, pki / made.name)


def write_certificates(pki: Path, address: str) -> None:
    """Makes the set `make_certificates` describes in `pki`."""
    pki.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=vgpu-test-ca", cwd=pki)
    (pki / "server.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:{address},IP:{SERVICE_IP},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n"
    )
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject, ext in (("server", "/CN=kube-apiserver", "server.ext"),
                               ("admin", "/O=system:masters/CN=admin", "client.ext")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", subject, cwd=pki)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=pki)
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig(server: str, pki: Path, user: dict) -> str:
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "user"}}],
        "current-context": "test",
    }, indent=2)


class Started:
    """A context manager over `start()` and `stop()`: a start that fails
    part way stops what it had started, and leaving the block stops it."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ControlPlane(Started):
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler as
    child processes of this one."""

    def __init__(self, workdir: Path | None = None, network=None, controllers: str | None = None,
                 api_only: bool = False, audit_policy: dict | None = None,
                 controller_manager_args: tuple[str, ...] = ()):
        """`network`: a nodenet.TestNetwork to run everything in (the API
        server then listens on its address, which can also be a Service
        endpoint); default: loopback of this namespace. `controllers`:
        kube-controller-manager's `--controllers` (default: all).
        `api_only`: no kube-controller-manager nor kube-scheduler.
        `audit_policy`: the API server logs what it names (an audit
        Policy) to `audit_log`, as JSON lines. `controller_manager_args`:
        added to kube-controller-manager's (its client's `--kube-api-qps`,
        say)."""
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="vgpu-controlplane-")).resolve()
        self.bin = binaries()
        self.pki = self.workdir / "pki"
        self.processes: dict[str, subprocess.Popen] = {}
        self.arguments: dict[str, list[str]] = {}
        self.health: dict[str, object] = {}
        self.network = network
        self.address = network.address if network else "127.0.0.1"
        self.controllers = controllers
        self.api_only = api_only
        # Set once the API server has started on a port of its own.
        self.api_port = 0
        self.server = ""
        self.etcd_url = ""
        self.admin_kubeconfig = self.workdir / "admin.kubeconfig"
        self.audit_policy = audit_policy
        self.audit_log = self.workdir / "audit.log"
        self.controller_manager_args = tuple(controller_manager_args)

    def _audit_arguments(self) -> list[str]:
        if self.audit_policy is None:
            return []
        policy = self.workdir / "audit-policy.json"
        policy.write_text(json.dumps(self.audit_policy))
        # The default (blocking) mode: each event is written in its
        # request's path, none waits in a buffer.
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json"]

    # Life cycle ----------------------------------------------------------

    def start(self) -> None:
        make_certificates(self.pki, self.address)
        pki = self.pki

        def etcd(attempt: int, client: int, peer: int, metrics: int) -> list[str]:
            self.health["etcd"] = lambda: self._probe(f"http://127.0.0.1:{client}/health")
            self.etcd_url = f"http://127.0.0.1:{client}"
            return [
                # A fresh folder per attempt: a member that once started
                # keeps its first peer address in its data.
                "--data-dir", str(self.workdir / ("etcd" if attempt == 0 else f"etcd-{attempt}")),
                "--listen-client-urls", f"http://127.0.0.1:{client}",
                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                "--listen-metrics-urls", f"http://127.0.0.1:{metrics}",
                # A test cluster's data is thrown away: waiting for the disk on
                # every write made etcd time out requests under the 300-pod
                # burst on a 2-core machine.
                "--unsafe-no-fsync",
            ]

        self._start_listening("etcd", 3, etcd)

        def api_server(attempt: int, port: int) -> list[str]:
            self.api_port = port
            self.server = f"https://{self.address}:{port}"
            self.admin_kubeconfig.write_text(kubeconfig(self.server, self.pki, {
                "client-certificate": str(self.pki / "admin.crt"),
                "client-key": str(self.pki / "admin.key"),
            }))
            self.health["kube-apiserver"] = lambda: self._api_ok("/readyz")
            return [
                f"--etcd-servers={self.etcd_url}",
                f"--bind-address={self.address}",
                f"--secure-port={self.api_port}",
                f"--advertise-address={self.address}",
                # The `kubernetes` Service gets no endpoints (loopback may not
                # be one; nothing in the tests uses it).
                "--endpoint-reconciler-type=none",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                # What a production cluster runs: kubelets (the real test
                # nodes, with system:node:<name> certificates) may touch only
                # their own Node, its pods and what those pods use.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--tls-cert-file={pki / 'server.crt'}",
                f"--tls-private-key-file={pki / 'server.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                # Webhook Services are reached through their endpoints (there is
                # no kube-proxy).
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                # Without the controller manager nothing gives namespaces their
                # `default` ServiceAccount, which this admission plugin requires
                # of every pod.
                *(["--disable-admission-plugins=ServiceAccount"] if self.api_only else []),
                *self._audit_arguments(),
            ]

        self._start_listening("kube-apiserver", 1, api_server)
        # The API server creates the namespace of node Leases (where the
        # chart's device plugins keep theirs) just after it is ready.
        self._wait("kube-apiserver", lambda: self._api_ok("/api/v1/namespaces/kube-node-lease"))
        if self.api_only:
            return
        for name, extra in (
            ("kube-controller-manager", [
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                *([f"--controllers={self.controllers}"] if self.controllers else []),
                *self.controller_manager_args,
            ]),
            ("kube-scheduler", []),
        ):
            def component(_attempt: int, port: int, name=name, extra=extra) -> list[str]:
                self.health[name] = lambda: self._probe(f"https://127.0.0.1:{port}/healthz", insecure=True)
                return [
                    f"--kubeconfig={self.admin_kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    *extra,
                ]

            self._start_listening(name, 1, component)
        # The controller manager gives every namespace its `default`
        # ServiceAccount: ready once the default namespace has one.
        self._wait("kube-controller-manager", lambda: self._api_ok(
            "/api/v1/namespaces/default/serviceaccounts/default"))

    def stop(self) -> None:
        """Stops, newest first, exactly the processes this object started.
        SIGKILL: a test control plane's state is thrown away with it, and
        kube-apiserver's graceful stop took over a second of every test's
        teardown."""
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.kill()
                process.wait()
        self.processes.clear()

    def restart(self, name: str, kill: bool = True) -> float:
        """Stops component `name` (SIGKILL, or SIGTERM with `kill=False`),
        starts it again with the same arguments and data, and waits until it
        is healthy; answers the seconds that took."""
        started = time.monotonic()
        process = self.processes[name]
        if kill:
            process.kill()
        else:
            process.terminate()
        process.wait(timeout=30)
        self._spawn(name, self.arguments[name], append=True)
        self._wait(name, self.health[name])
        return time.monotonic() - started

    # Use -----------------------------------------------------------------

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command([str(self.bin / "kubectl"),
                                            f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args]),
                              capture_output=True, text=True, input=input, check=False)
        if check and done.returncode != 0:
            raise ControlPlaneError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, HELM_CACHE_HOME=str(self.workdir / "helm-cache"),
                   HELM_CONFIG_HOME=str(self.workdir / "helm-config"), HELM_DATA_HOME=str(self.workdir / "helm-data"))
        done = subprocess.run(self.command([str(self.bin / "helm"), f"--kubeconfig={self.admin_kubeconfig}", *args]),
                              capture_output=True, text=True, env=env, check=False)
        if check and done.returncode != 0:
            raise ControlPlaneError(f"helm {' '.join(args)}: {done.stderr.strip()}")
        return done

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path) -> Path:
        """A kubeconfig that acts as `service_account`, with a token the API
        server issues for it (as a pod of that account would have)."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h").stdout.strip()
        path.write_text(kubeconfig(self.server, self.pki, {"token": token}))
        return path

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run where the control plane runs (its test network, if any)."""
        return self.network.command(argv) if self.network else argv

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    # Internals -----------------------------------------------------------

    def _start_listening(self, name: str, ports: int, arguments) -> None:
        """Starts component `name` with `arguments(attempt, *ports)` (which
        also sets its health check) on `ports` free ports and waits until it
        is healthy. When it fails because a port was taken between the pick
        and its bind, it is started again on fresh ports; any other failure
        is raised at once."""
        for attempt in range(BIND_ATTEMPTS):
            chosen = [free_port() for _ in range(ports)]
            self._spawn(name, arguments(attempt, *chosen), append=attempt > 0)
            try:
                self._wait(name, self.health[name])
                return
            except ControlPlaneError as error:
                if "address already in use" not in str(error) or attempt + 1 == BIND_ATTEMPTS:
                    raise
                print(f"{name}: a port was taken before it could bind it; starting it on others",
                      file=sys.stderr, flush=True)

    def _spawn(self, name: str, args: list[str], append: bool = False) -> None:
        self.arguments[name] = args
        log = open(self.workdir / f"{name}.log", "a" if append else "w")  # noqa: SIM115 -- open while it runs
        self.processes[name] = subprocess.Popen(self.command([str(self.bin / name), *args]), stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def _wait(self, name: str, healthy, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            process = self.processes.get(name)
            if process is not None and process.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            if healthy():
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"{name} not healthy after {timeout:.0f} s:\n{self.log(name)[-3000:]}")

    def _api_ok(self, path: str) -> bool:
        return self._probe(self.server + path, client=True)

    def _probe(self, url: str, insecure: bool = False, client: bool = False) -> bool:
        """Whether `url` answers 200, asked from where the control plane runs."""
        if self.network is None:
            return http_ok(url, insecure, self.pki if client else None)
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from controlplane import http_ok; " \
               f"from pathlib import Path; sys.exit(0 if http_ok({url!r}, {insecure!r}, " \
               f"{str(self.pki)!r} and Path({str(self.pki)!r}) if {client!r} else None) else 1)"
        return subprocess.run(self.network.command([sys.executable, "-c", code]), capture_output=True,
                              check=False).returncode == 0


def wait_for(what: str, check, timeout: float = 30, log=lambda: ""):
    """`check()`'s first true value, asked every 0.2 s; AssertionError
    naming `what` (and `log()`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not seen: {what} within {timeout:.0f} s\n{log()}")


def http_ok(url: str, insecure: bool = False, client_pki: Path | None = None) -> bool:
    """Whether `url` answers 200: verified against the test CA (with the
    admin client certificate) when `client_pki` is given, unverified when
    `insecure` (the components' own self-signed serving certificates)."""
    context = None
    if client_pki is not None:
        context = ssl.create_default_context(cafile=str(client_pki / "ca.crt"))
        context.load_cert_chain(str(client_pki / "admin.crt"), str(client_pki / "admin.key"))
    elif insecure:
        context = ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the control plane and keep it running until Ctrl-C")
    up.add_argument("--dir", help="where its data, certificates, logs and kubeconfig go "
                    "(default: a new temporary folder)")
    up.add_argument("--api-only", action="store_true",
                    help="start etcd and kube-apiserver only (no controller manager, no scheduler)")
    args = parser.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        with ControlPlane(Path(args.dir) if args.dir else None, api_only=args.api_only) as cluster:
            print(f"control plane up: export KUBECONFIG={cluster.admin_kubeconfig}", flush=True)
            print(f"logs in {cluster.workdir}; Ctrl-C stops it", flush=True)
            while not stopping:
                for name, process in cluster.processes.items():
                    if process.poll() is not None:
                        print(f"{name} exited with {process.returncode}; stopping", file=sys.stderr)
                        return 1
                time.sleep(0.5)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
