"""Hosts made of Linux network namespaces: several machines on one, for tests/hosts, bench.missing_node and
bench.cannot_choose.

    with Hosts(3) as hosts:                       # host0, host1, host2
        process = hosts[1].start(["python", "-m", ...], env)

Each host is a network namespace with two interfaces, ``eth0`` on network A (10.90.0.0/24, host i at
10.90.0.(i+1)) and ``eth1`` on network B (10.91.0.0/24), wired through two bridges in a namespace of
their own (the switch), and its own host name, ``host<i>``, which resolves to 127.0.1.1 there, as Debian
and Ubuntu write /etc/hosts, and to its network A address on the other hosts (as a cluster's DNS would).
That is the bare host on which gloo, left alone, advertises a loopback address.

``ip netns exec`` gives each command the namespace's network and mounts ``/etc/netns/<name>/hosts`` over
/etc/hosts; ``unshare --uts`` gives it the host name. Everything else (files, processes) is shared, as
on hosts with a shared file system. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.

``cut_off(i, port)`` breaks host i's routes to network A except to ``port`` (the rendezvous): the other
hosts still reach its rendezvous, as through a firewall that lets one port through, and nothing else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

NETWORKS = {"eth0": "10.90.0", "eth1": "10.91.0"}  # interface in every host -> its network's /24 prefix
CUT_TABLE = 77  # the routing table a cut-off host sends network A's traffic to: one unreachable route
ETC_NETNS = Path("/etc/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str

    @property
    def hostname(self) -> str:
        return f"host{self.index}"

    def address(self, interface: str = "eth0") -> str:
        return f"{NETWORKS[interface]}.{self.index + 1}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host: its network, its /etc/hosts, its host name."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *argv,
        ]

    def start(self, argv: Sequence[str], env: dict[str, str], cwd: str | Path) -> subprocess.Popen:
        """A process group of its own (the test can end the whole node), output collected as text."""
        return subprocess.Popen(
            self.command(argv),
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def run(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)


def settle(processes: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int | None, str]]:
    """Each started node's exit code (None: still running after ``timeout`` s, then killed) and output."""
    ended = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout)
            ended.append((process.returncode, output))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            ended.append((None, process.communicate()[0]))
    return ended


class Hosts:
    """``count`` hosts on networks A and B; removed again on exit, whatever happened."""

    def __init__(self, count: int):
        self.count = count
        self.tag = f"ddplab{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(i, f"{self.tag}-h{i}") for i in range(count)]
        self.cut: set[int] = set()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return self.count

    def __enter__(self) -> "Hosts":
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        for bridge in ("br0", "br1"):
            _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.switch, "link", "set", bridge, "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            for number, interface in enumerate(NETWORKS):
                inside, outside = (
                    f"{self.tag}{host.index}{number}a",
                    f"{self.tag}{host.index}{number}b",
                )  # <= 15 characters
                _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
                _ip("link", "set", inside, "netns", host.namespace)
                _ip("link", "set", outside, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", outside, "master", f"br{number}")
                _ip("-n", self.switch, "link", "set", outside, "up")
                _ip("-n", host.namespace, "link", "set", inside, "name", interface)
                _ip("-n", host.namespace, "address", "add", f"{host.address(interface)}/24", "dev", interface)
                _ip("-n", host.namespace, "link", "set", interface, "up")
            etc = ETC_NETNS / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            others = "".join(f"{other.address()} {other.hostname}\n" for other in self.hosts if other is not host)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.hostname}\n{others}")

    def cut_off(self, index: int, port: int) -> None:
        """Host ``index`` reaches network A on ``port`` only (and so answers the other hosts on it only)."""
        namespace, network = self.hosts[index].namespace, f"{NETWORKS['eth0']}.0/24"
        _ip("-n", namespace, "route", "add", "unreachable", network, "table", str(CUT_TABLE))
        _ip("-n", namespace, "rule", "add", "to", network, "dport", str(port), "lookup", "main", "pref", "100")
        _ip("-n", namespace, "rule", "add", "to", network, "lookup", str(CUT_TABLE), "pref", "101")
        self.cut.add(index)

    def heal(self, index: int) -> None:
        namespace = self.hosts[index].namespace
        for preference in ("100", "101"):
            _ip("-n", namespace, "rule", "del", "pref", preference)
        _ip("-n", namespace, "route", "flush", "table", str(CUT_TABLE))
        self.cut.discard(index)

    def remove(self) -> None:
        for namespace in [h.namespace for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)  # its veths and bridges go with it
            shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)


def cannot_create_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"ddplabprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    return None
