"""The interface gloo and NCCL use between nodes (ddp_core/distributed/network.py), on made-up hosts.

Every case is a host (its interfaces), a route (what the kernel answers for MASTER_ADDR), the variables
the user set, and what ddp-lab must decide: an interface and the value it puts in the backend's
variable, or one line that names what is wrong. Real hosts (network namespaces) are in tests/hosts.
"""

from __future__ import annotations

import errno
import os
import socket

import pytest

from ddp_core.distributed import network
from ddp_core.distributed.env import DistEnv
from ddp_core.distributed.network import Interface, NoRouteError
from ddp_core.errors import ConfigError, NodeConfigError, exits_with_one_line

LO = Interface("lo", ("127.0.0.1", "::1"), up=True, loopback=True)
ETH0 = Interface("eth0", ("10.1.0.2", "fe80::1"), up=True, loopback=False)
ETH1 = Interface("eth1", ("10.2.0.2", "10.2.0.9"), up=True, loopback=False)  # a secondary address
DOCKER0 = Interface("docker0", ("172.17.0.1",), up=True, loopback=False)
DOWN = Interface("eth2", ("10.3.0.2",), up=False, loopback=False)
BARE = Interface("eth3", (), up=True, loopback=False)
HOST = [LO, ETH0, ETH1, DOCKER0, DOWN, BARE]

TWO_NODES = DistEnv(rank=1, local_rank=0, world_size=4, local_world_size=2, master_addr="10.1.0.1", master_port=29500)
ONE_NODE = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="10.1.0.1", master_port=29500)


def routes(table: dict[str, str | int]):
    """A kernel whose route to each address leaves from the given local address (an int: that errno)."""

    def route(ip: str, port: int) -> str:
        answer = table[ip]
        if isinstance(answer, int):
            raise OSError(answer, os.strerror(answer))
        return answer

    return route


@pytest.fixture(autouse=True)
def node0_is_loopback_here(monkeypatch):
    """The name 'node0' resolves to 127.0.1.1, as a Debian host's own name does in its /etc/hosts."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        return real("127.0.1.1" if host == "node0" else host, port, *args, **kwargs)

    monkeypatch.setattr(network.socket, "getaddrinfo", getaddrinfo)


def decide(env=TWO_NODES, backend="gloo", environ=None, target=("10.1.0.1", 29500), interfaces=HOST, route=None):
    return network.choose(
        env,
        backend,
        environ or {},
        target,
        interfaces=lambda: list(interfaces),
        route=route or routes({"10.1.0.1": "10.1.0.2", "10.2.0.1": "10.2.0.9", "127.0.1.1": "127.0.0.1"}),
    )


CHOSEN = [
    # (case, arguments, variable, value set, interface, address)
    ("the route's interface", {}, "GLOO_SOCKET_IFNAME", "eth0", "eth0", "10.1.0.2"),
    ("NCCL gets an exact name", {"backend": "nccl"}, "NCCL_SOCKET_IFNAME", "=eth0", "eth0", "10.1.0.2"),
    ("a secondary address", {"target": ("10.2.0.1", 29500)}, "GLOO_SOCKET_IFNAME", "eth1", "eth1", "10.2.0.9"),
    (
        "this host is MASTER_ADDR",
        {"route": routes({"10.1.0.2": "10.1.0.2"}), "target": ("10.1.0.2", 29500)},
        "GLOO_SOCKET_IFNAME",
        "eth0",
        "eth0",
        "10.1.0.2",
    ),
    (
        "MASTER_ADDR is loopback here, one other interface",
        {"target": ("node0", 29500), "interfaces": [LO, ETH0, DOCKER0, DOWN, BARE]},
        "GLOO_SOCKET_IFNAME",
        "eth0",
        "eth0",
        "10.1.0.2",
    ),
    (
        "several MASTER_ADDR addresses, the second routes",
        {"route": routes({"10.9.9.9": errno.ENETUNREACH, "10.1.0.1": "10.1.0.2"}), "target": ("10.9.9.9", 29500)},
        "GLOO_SOCKET_IFNAME",
        "eth0",
        "eth0",
        "10.1.0.2",
    ),
]


@pytest.mark.parametrize("case,arguments,variable,value,interface,address", CHOSEN, ids=[c[0] for c in CHOSEN])
def test_ddp_lab_chooses(monkeypatch, case, arguments, variable, value, interface, address):
    if case.startswith("several"):  # one name, two addresses: the first has no route
        monkeypatch.setattr(
            network.socket,
            "getaddrinfo",
            lambda host, port, **kw: [(2, 1, 6, "", ("10.9.9.9", port)), (2, 1, 6, "", ("10.1.0.1", port))],
        )
    choice = decide(**arguments)
    assert (choice.variable, choice.value, choice.interface, choice.address, choice.yours) == (
        variable,
        value,
        interface,
        address,
        False,
    )
    environ: dict[str, str] = {}
    network.apply(choice, environ)
    assert environ == {variable: value}
    assert choice.describe().startswith(f"{variable.split('_')[0].lower()} uses {interface} ({address}): ")
    assert variable in choice.describe()  # says how to choose another
    assert ("is this host's address" in choice.describe()) is case.startswith("this host")


@pytest.mark.parametrize(
    "environ,interface",
    [
        ({"GLOO_SOCKET_IFNAME": "eth1"}, "eth1"),
        ({"GLOO_SOCKET_IFNAME": "eth1,eth0"}, "eth1,eth0"),
        ({"GLOO_SOCKET_IFNAME": " eth0 "}, "eth0"),
        ({"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth0"}, "eth1"),  # gloo reads its own variable only
    ],
)
def test_a_variable_you_set_wins_and_is_left_as_it_is(environ, interface):
    choice = decide(environ=environ)
    assert choice.yours and choice.interface == interface and "yours" in choice.describe()
    before = dict(environ)
    network.apply(choice, environ)
    assert environ == before


@pytest.mark.parametrize(
    "value,interface",
    [("^docker,lo", "^docker,lo"), ("eth", "eth0,eth1"), ("=eth1", "eth1"), ("eth1,eth0", "eth0,eth1")],
)  # NCCL: in the host's order
def test_nccl_patterns_you_set(value, interface):
    choice = decide(backend="nccl", environ={"NCCL_SOCKET_IFNAME": value})
    assert choice.yours and choice.interface == interface and choice.value == value


REFUSED = [
    # (case, arguments, error type, words the one line must hold)
    (
        "no route to MASTER_ADDR",
        {"route": routes({"10.1.0.1": errno.EHOSTUNREACH})},
        NoRouteError,
        [
            "no network interface on this host reaches MASTER_ADDR=10.1.0.1 on port 29500",
            "No route to host",
            "ip route get 10.1.0.1",
            "GLOO_SOCKET_IFNAME",
        ],
    ),
    (
        "network unreachable, NCCL",
        {"backend": "nccl", "route": routes({"10.1.0.1": errno.ENETUNREACH})},
        NoRouteError,
        ["Network is unreachable", "NCCL_SOCKET_IFNAME"],
    ),
    (
        "MASTER_ADDR loopback here, two candidates",
        {"target": ("node0", 29500)},
        NodeConfigError,
        [
            "MASTER_ADDR=node0 resolves to 127.0.1.1, a loopback address",
            "eth0 10.1.0.2, eth1 10.2.0.2",
            "GLOO_SOCKET_IFNAME",
        ],
    ),
    (
        "MASTER_ADDR loopback here, no candidate",
        {"target": ("node0", 29500), "interfaces": [LO, DOCKER0, DOWN]},
        NodeConfigError,
        ["no other interface that is up with an address"],
    ),
    (
        "your interface does not exist",
        {"environ": {"GLOO_SOCKET_IFNAME": "eth9"}},
        NodeConfigError,
        [
            "GLOO_SOCKET_IFNAME='eth9'",
            "no interface named eth9",
            "lo 127.0.0.1, eth0 10.1.0.2",
            "unset GLOO_SOCKET_IFNAME",
        ],
    ),
    (
        "your loopback",
        {"environ": {"GLOO_SOCKET_IFNAME": "lo"}},
        NodeConfigError,
        ["GLOO_SOCKET_IFNAME='lo' is the loopback interface", "2-node job"],
    ),
    (
        "your interface is down",
        {"environ": {"GLOO_SOCKET_IFNAME": "eth2"}},
        NodeConfigError,
        ["eth2 is down or has no address", "ip link set eth2 up"],
    ),
    (
        "your interface has no address",
        {"environ": {"GLOO_SOCKET_IFNAME": "eth3"}},
        NodeConfigError,
        ["eth3 is down or has no address"],
    ),
    (
        "your NCCL pattern matches nothing",
        {"backend": "nccl", "environ": {"NCCL_SOCKET_IFNAME": "ib"}},
        NodeConfigError,
        ["NCCL_SOCKET_IFNAME='ib' matches no interface"],
    ),
    (
        "your NCCL exact name is a prefix",
        {"backend": "nccl", "environ": {"NCCL_SOCKET_IFNAME": "=eth"}},
        NodeConfigError,
        ["matches no interface"],
    ),
    (
        "your NCCL pattern matches loopback only",
        {"backend": "nccl", "environ": {"NCCL_SOCKET_IFNAME": "lo"}},
        NodeConfigError,
        ["is the loopback interface"],
    ),
]


@pytest.mark.parametrize("case,arguments,error,words", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_in_one_line(case, arguments, error, words):
    with pytest.raises(error) as raised:
        decide(**arguments)
    message = str(raised.value)
    assert "\n" not in message and isinstance(raised.value, ConfigError)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "arguments",
    [
        {"env": ONE_NODE},  # one node: gloo's loopback is right, and nothing is touched
        {"env": ONE_NODE, "environ": {"GLOO_SOCKET_IFNAME": "eth9"}},  # not even checked: nothing crosses a network
        {"target": None},  # file:// rendezvous: no host to route to
        {"target": ("127.0.0.1", 29500)},  # MASTER_ADDR on loopback: every node is on this host
        {"target": ("localhost", 29500), "environ": {"GLOO_SOCKET_IFNAME": "eth9"}},
        {"target": ("::1", 29500)},
        {"env": DistEnv()},  # a world of one
    ],
)
def test_nothing_to_choose(arguments):
    assert decide(**arguments) is None


def test_this_machine_has_a_loopback_interface_and_routes_to_itself():
    interfaces = {i.name: i for i in network.list_interfaces()}
    loopback = [i for i in interfaces.values() if i.loopback]
    assert loopback and "127.0.0.1" in loopback[0].addresses and loopback[0].up
    assert network.route_source("127.0.0.1", 29500) == "127.0.0.1"


@pytest.mark.parametrize("local_rank,printed", [("0", True), ("1", False)])
def test_a_node_error_is_printed_by_its_local_rank_0_only(monkeypatch, capsys, local_rank, printed):
    monkeypatch.setenv("LOCAL_RANK", local_rank)

    @exits_with_one_line
    def main():
        raise NodeConfigError("GLOO_SOCKET_IFNAME='eth9': no such interface")

    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert (capsys.readouterr().err == "error: GLOO_SOCKET_IFNAME='eth9': no such interface\n") is printed
