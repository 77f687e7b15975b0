"""A test network: a network namespace of its own, whose loopback
interface also carries an address from the documentation range
(192.0.2.0/24, never routed anywhere). A control plane and our components
run inside it can use that address as a Service endpoint (the API server
refuses loopback ones), and no traffic leaves the namespace. Needs root."""

from __future__ import annotations

import itertools
import os
import subprocess

_networks = itertools.count()


class NetworkError(Exception):
    """The namespace could not be made."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class TestNetwork:
    """Namespace `name` with `address` on its loopback interface."""

    __test__ = False  # not a pytest test class

    def __init__(self):
        number = next(_networks)
        self.name = f"vgpu-test-{os.getpid()}-{number}"
        self.address = f"192.0.2.{number % 250 + 1}"

    def __enter__(self) -> TestNetwork:
        try:
            _ip("netns", "add", self.name)
            _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            _ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.address}/32", "dev", "lo")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]
