"""Several "hosts" on this machine: network namespaces that a test makes, joined by a bridge.

Each host is a namespace with one interface, ``lv0``, holding ``10.231.<net>.<n>/24``; the
bridge lives in a namespace of its own, so nothing is added to the machine's own network and
traffic can only go to these addresses (or to each host's loopback). Everything is deleted on
:meth:`Hosts.close`. Tests that cannot make namespaces (no root, no iproute2) skip with the
reason. Used by the ``tests/engines/test_multihost*.py`` modules.
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

INTERFACE = "lv0"
"""The name of each host's one interface (names are per namespace, so every host has it)."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Listener:
    """A TCP socket in state LISTEN, as ``ss -ltnp`` shows it."""

    address: str
    port: int
    pids: frozenset[int]

    def __str__(self) -> str:
        return f"{self.address}:{self.port} pids={sorted(self.pids)}"


def listened_on_by(pid: int) -> list[str]:
    """``address:port`` of every TCP socket process ``pid`` listens on, as ``ss`` prints them
    (``ss`` sees the caller's own host, its namespace, only)."""
    lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30, check=True).stdout
    return sorted({line.split()[3] for line in lines.splitlines() if f"pid={pid}," in line})


class Hosts:
    """Namespaces ``names`` (``10.231.<net>.1``, ``.2``, ... in that order) on one bridge.

    Example::

        hosts = Hosts(["trainer", "server"], net=8)
        hosts.run("trainer", ["ping", "-c1", hosts.address("server")])
        hosts.close()
    """

    def __init__(self, names: list[str], net: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = list(names)
        self.namespaces = {name: f"lv-{name}-{tag}" for name in names}
        self._addresses = {name: f"10.231.{net}.{index + 1}" for index, name in enumerate(names)}
        self.switch = f"lv-switch-{tag}"
        try:
            ip("netns", "add", self.switch)
        except (OSError, subprocess.CalledProcessError) as error:
            pytest.skip(f"cannot make network namespaces here (needs root and iproute2): {error}")
        try:
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for index, name in enumerate(names):
                namespace, port = self.namespaces[name], f"p{index}"
                ip("netns", "add", namespace)
                ip(
                    "link",
                    "add",
                    INTERFACE,
                    "netns",
                    namespace,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.switch,
                )
                ip("-n", self.switch, "link", "set", port, "master", "br0")
                ip("-n", self.switch, "link", "set", port, "up")
                ip("-n", namespace, "addr", "add", f"{self._addresses[name]}/24", "dev", INTERFACE)
                ip("-n", namespace, "link", "set", INTERFACE, "up")
                ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, name: str) -> str:
        return self._addresses[name]

    def command(self, name: str, command: list[str]) -> list[str]:
        """``command`` as run inside host ``name``."""
        return ["ip", "netns", "exec", self.namespaces[name], *command]

    def start(self, name: str, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``command`` inside host ``name``, its output going to the file ``log`` (no pipe to drain)."""
        with open(log, "w") as output:
            return subprocess.Popen(self.command(name, command), env=env, stdout=output, stderr=subprocess.STDOUT)

    def listening(self, name: str) -> list[Listener]:
        """Every TCP socket listening in host ``name``, with the processes that hold it."""
        lines = subprocess.run(
            self.command(name, ["ss", "-Hltnp"]), capture_output=True, text=True, timeout=30, check=True
        ).stdout
        listeners = []
        for line in lines.splitlines():
            local = line.split()[3]
            address, _, port = local.rpartition(":")
            pids = frozenset(int(part.split(",")[0]) for part in line.split("pid=")[1:])
            listeners.append(Listener(address.strip("[]"), int(port), pids))
        return listeners

    def limit(self, name: str, rate: str) -> None:
        """Shape what host ``name`` sends to ``rate`` (``tc`` syntax, e.g. ``"1gbit"``)."""
        shape = ["tc", "qdisc", "replace", "dev", INTERFACE, "root", "tbf", "rate", rate]
        subprocess.run(self.command(name, [*shape, "burst", "256kb", "latency", "50ms"]), check=True, timeout=30)

    def close(self) -> None:
        """Delete every namespace (deleting one deletes its ends of the links)."""
        for namespace in [*self.namespaces.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
