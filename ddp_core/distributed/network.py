"""The interface gloo and NCCL use between nodes: on several nodes, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
is set (then only checked), the one the kernel routes MASTER_ADDR through (docs/decisions.md, "Several hosts")."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddp_core.distributed.env import DistEnv
from ddp_core.errors import NodeConfigError

VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
# What NCCL skips when it chooses by itself; a host's only "other" interface is never one of these.
VIRTUAL_PREFIXES = ("docker", "virbr", "veth", "br-", "cni", "flannel", "cali", "kube-")


class NoRouteError(NodeConfigError):
    """No route from this host to MASTER_ADDR: the rendezvous store is out of reach as well."""


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]
    up: bool
    loopback: bool


@dataclass(frozen=True)
class NetworkChoice:
    """The interface a backend uses on this node, and why."""

    variable: str  # GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME
    value: str  # what the variable holds (NCCL's exact-match form "=eth0" when ddp-lab set it)
    interface: str
    address: str  # "" when the user's value is a pattern ddp-lab cannot resolve (NCCL's "^docker")
    reason: str  # how it was chosen, in words
    yours: bool  # the user set the variable: ddp-lab changed nothing

    def describe(self) -> str:
        where = f"{self.interface} ({self.address})" if self.address else self.interface
        return f"{self.variable.split('_')[0].lower()} uses {where}: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# What the host has: interfaces (getifaddrs) and the route to an address


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_ubyte * 4)]


class _SockAddrIn6(ctypes.Structure):  # up to the address, all that is read (scope_id follows)
    _fields_ = [*_SockAddrIn._fields_[:2], ("flowinfo", ctypes.c_uint32), ("addr", ctypes.c_ubyte * 16)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [  # up to the address, all that is read (libc allocates the entries; netmask and more follow)
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
]

_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def _address(pointer: Any) -> str | None:
    family = pointer.contents.family if pointer else None
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None  # AF_PACKET and the like: no IP address
    shape = _SockAddrIn if family == socket.AF_INET else _SockAddrIn6
    return socket.inet_ntop(family, bytes(ctypes.cast(pointer, ctypes.POINTER(shape)).contents.addr))


def list_interfaces() -> list[Interface]:
    """Every interface with its IPv4 and IPv6 addresses (libc's getifaddrs: secondary addresses too)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, tuple[list[str], int]] = {}
    try:
        entry = head
        while entry:
            item = entry.contents
            name = item.name.decode(errors="replace")
            addresses, flags = found.setdefault(name, ([], item.flags))
            address = _address(item.addr)
            if address is not None and address not in addresses:
                addresses.append(address)
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return [
        Interface(name, tuple(addresses), bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK))
        for name, (addresses, flags) in found.items()
    ]


def route_source(ip: str, port: int) -> str:
    """The local address the kernel would send from to reach ip:port (raises OSError without a route)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port))  # UDP: picks the route and source address, sends nothing
        return probe.getsockname()[0]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _owner(address: str, interfaces: Sequence[Interface]) -> Interface | None:
    bare = address.split("%")[0]
    return next((i for i in interfaces if bare in (a.split("%")[0] for a in i.addresses)), None)


def _listing(interfaces: Sequence[Interface]) -> str:
    shown = [f"{i.name} {i.addresses[0]}" if i.addresses else f"{i.name} (no address)" for i in interfaces]
    return ", ".join(shown) or "none"


def is_local_address(host: str) -> bool:
    """``host`` resolves to an address of one of this host's interfaces (whatever this host's name says)."""
    try:
        ips = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return False
    return any(_owner(ip, list_interfaces()) is not None for ip in ips)


# The choice


def _fix(variable: str) -> str:
    return f"set {variable} to the interface the other nodes reach (see `ip -brief address`)"


def _check_yours(variable: str, value: str, interfaces: Sequence[Interface], nodes: int) -> NetworkChoice:
    """A value the user set: used as it is, refused only where it cannot work."""
    by_name = {i.name: i for i in interfaces}
    if variable == "NCCL_SOCKET_IFNAME":
        if value.startswith("^"):  # an exclusion list: NCCL chooses among the rest
            why = f"NCCL chooses, excluding {value[1:]} ({variable}, yours)"
            return NetworkChoice(variable, value, value, "", why, True)
        exact = value.startswith("=")
        patterns = [p.strip() for p in value.lstrip("=").split(",") if p.strip()]
        matched = [i for i in interfaces if any(i.name == p if exact else i.name.startswith(p) for p in patterns)]
    else:
        patterns = [p.strip() for p in value.split(",") if p.strip()]
        missing = [p for p in patterns if p not in by_name]
        if missing:
            raise NodeConfigError(
                f"{variable}={value!r}: this host has no interface named {', '.join(missing)} "
                f"(it has {_listing(interfaces)}): "
                f"name one of those, or unset {variable} to let ddp-lab choose the one that reaches MASTER_ADDR"
            )
        matched = [by_name[p] for p in patterns]
    if not matched:
        raise NodeConfigError(
            f"{variable}={value!r} matches no interface on this host (it has {_listing(interfaces)}): "
            f"name one of those, or unset {variable}"
        )
    usable = [i for i in matched if i.up and i.addresses]
    if not usable:
        raise NodeConfigError(
            f"{variable}={value!r}: {', '.join(i.name for i in matched)} is down or has no address: "
            f"bring it up (`ip link set {matched[0].name} up`) or name another interface"
        )
    if nodes > 1 and all(i.loopback for i in usable):
        raise NodeConfigError(
            f"{variable}={value!r} is the loopback interface, which the other nodes of this {nodes}-node job "
            f"cannot reach: unset it (ddp-lab then chooses the interface that reaches MASTER_ADDR) or {_fix(variable)}"
        )
    first = next(i for i in usable if not i.loopback) if nodes > 1 else usable[0]
    names = ",".join(i.name for i in usable)
    return NetworkChoice(variable, value, names, first.addresses[0], f"{variable}, yours", True)


def _ours(variable: str, interface: Interface, address: str, why: str) -> NetworkChoice:
    """ddp-lab's choice of ``interface`` (NCCL's value "=NAME": an exact name, not a prefix)."""
    value = f"={interface.name}" if variable == "NCCL_SOCKET_IFNAME" else interface.name
    return NetworkChoice(variable, value, interface.name, address, f"{why}; set {variable} to choose another", False)


def _choose(
    variable: str,
    host: str,
    port: int,
    interfaces: Sequence[Interface],
    route: Callable[[str, int], str],
    target: str = "MASTER_ADDR",
) -> NetworkChoice:
    """The interface holding the address this host sends from to reach host:port."""
    try:
        ips = list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))
    except (socket.gaierror, UnicodeError) as error:
        raise NodeConfigError(f"MASTER_ADDR={host!r} does not resolve ({error}): use rank 0's IP address") from None
    failure, no_route = "", False
    for ip in ips:
        try:
            source = route(ip, port)
        except OSError as error:
            failure, no_route = error.strerror or str(error), True
            continue
        if is_loopback(source):  # MASTER_ADDR is this host, by a name mapped to 127.x here
            return _only_other_interface(variable, host, ip, interfaces, target)
        owner = _owner(source, interfaces)
        if owner is not None:
            shown = host if host == ip else f"{host} ({ip})"
            how = f"{target} {shown} is this host's address" if source == ip else f"the route to {target} {shown}"
            return _ours(variable, owner, source, how)
        failure, no_route = f"the route's source address {source} is on no interface", False
    resolved = "" if ips == [host] else f" ({', '.join(ips)})"
    raise (NoRouteError if no_route else NodeConfigError)(
        f"no network interface on this host reaches MASTER_ADDR={host}{resolved} on port {port}: {failure}: "
        "check MASTER_ADDR (node 0's address as the other nodes see it) and this host's routes "
        f"(`ip route get {ips[0]}`), or {_fix(variable)}"
    )


def _only_other_interface(
    variable: str, host: str, ip: str, interfaces: Sequence[Interface], target: str
) -> NetworkChoice:
    candidates = [
        i for i in interfaces if i.up and not i.loopback and i.addresses and not i.name.startswith(VIRTUAL_PREFIXES)
    ]
    if len(candidates) == 1:
        only = candidates[0]
        why = f"{target} {host} is {ip} (loopback) here, and {only.name} is this host's only other interface"
        return _ours(variable, only, only.addresses[0], why)
    found = "it has no other interface that is up with an address"
    if candidates:
        found = f"it has {len(candidates)} that could be ({_listing(candidates)})"
    raise NodeConfigError(
        f"{target}={host} resolves to {ip}, a loopback address, on this host, and {found}: set {target} to this host's "
        f"address that the other nodes reach, or {_fix(variable)}"
    )


def reachable_address(host: str, port: int) -> NetworkChoice:
    """This host's address on the interface that reaches host:port: what it should tell the other nodes."""
    return _choose("GLOO_SOCKET_IFNAME", host, port, list_interfaces(), route_source, target="the rendezvous endpoint")


def _names_loopback(host: str) -> bool:
    """127.0.0.1, ::1 or localhost: every node is on this host (unlike a name that resolves to loopback here)."""
    if host.lower() == "localhost":
        return True
    try:
        return is_loopback(host)
    except ValueError:
        return False


def choose(
    env: DistEnv,
    backend: str,
    environ: Mapping[str, str],
    target: tuple[str, int] | None,
    interfaces: Callable[[], list[Interface]] = list_interfaces,
    route: Callable[[str, int], str] = route_source,
) -> NetworkChoice | None:
    """This node's choice for ``backend`` to reach ``target`` (the address every node connects to first); None on
    one node, on loopback or without a target (file://). Raises NodeConfigError."""
    if env.num_nodes <= 1 or target is None or backend not in VARIABLE or _names_loopback(target[0]):
        return None
    variable = VARIABLE[backend]
    value = environ.get(variable, "").strip()
    if value:
        return _check_yours(variable, value, interfaces(), env.num_nodes)
    return _choose(variable, target[0], target[1], interfaces(), route)


def apply(choice: NetworkChoice | None, environ: Any) -> None:
    """Put ddp-lab's choice into the environment the backend reads (os.environ: getenv sees it)."""
    if choice is not None and not choice.yours:
        environ[choice.variable] = choice.value


def node_of(env: DistEnv, environ: Mapping[str, str]) -> int:
    """torchrun's node rank (GROUP_RANK); without torchrun, one node per LOCAL_WORLD_SIZE ranks."""
    raw = environ.get("GROUP_RANK", "").strip()
    return int(raw) if raw.isdigit() else env.rank // env.local_world_size
