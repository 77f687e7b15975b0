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


def add_node_network(hub: TestNetwork, namespace: str, veth: str, address: str, hub_address: str) -> None:
    """Network namespace `namespace` joined to the hub by a veth pair
    (`veth` + "h" on the hub's side, + "n" on the node's; 14 characters at
    most), `address`/24 on the node's side, `hub_address`/24 on the hub's,
    and the hub as the node's default route."""
    outside, inside = f"{veth}h", f"{veth}n"
    _ip("netns", "add", namespace)
    _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    _ip("link", "set", outside, "netns", hub.name)
    _ip("link", "set", inside, "netns", namespace)
    on_hub = ["netns", "exec", hub.name, "ip"]
    on_node = ["netns", "exec", namespace, "ip"]
    _ip(*on_hub, "addr", "add", f"{hub_address}/24", "dev", outside)
    _ip(*on_hub, "link", "set", outside, "up")
    _ip(*on_node, "link", "set", "lo", "up")
    _ip(*on_node, "addr", "add", f"{address}/24", "dev", inside)
    _ip(*on_node, "link", "set", inside, "up")
    _ip(*on_node, "route", "add", "default", "via", hub_address)
