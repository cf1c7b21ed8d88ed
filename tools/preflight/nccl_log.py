"""NCCL's own INFO log, for preflight's transport row: where to read it, and what it says NCCL uses.

Before NCCL starts, ``enable_nccl_log`` makes sure its INFO log lands in a file preflight can read (the
user's own NCCL_DEBUG_FILE, or one of preflight's); after the checks, ``read_nccl_log`` parses it (and
prints the lines the user's own NCCL_DEBUG level asked for). ``tools.preflight.verdicts.check_transport``
judges the result.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

NCCL_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")  # NCCL_DEBUG's levels, each printing those before it too


@dataclass(frozen=True)
class NcclLogPlan:
    """Where preflight reads NCCL's INFO log from, and what it owes the user afterwards.

    ``path``: the file NCCL writes (``own``: preflight's, deleted after reading). ``echo_level``: the
    NCCL_DEBUG the user set without a file of their own, so the lines at that level are printed to stdout
    afterwards (where NCCL would have printed them). ``set``: the variables to set before NCCL starts.
    """

    path: str
    own: bool
    echo_level: str | None = None
    set: tuple[tuple[str, str], ...] = ()


def plan_nccl_log(environ: Mapping[str, str], pid: int, hostname: str, temp_dir: str) -> NcclLogPlan:
    """Read the user's own NCCL_DEBUG_FILE when it gets INFO lines; otherwise have NCCL write INFO
    (INIT and NET: the network and every channel's transport) to a file of preflight's for its run."""
    level = environ.get("NCCL_DEBUG", "").strip().upper()
    user_file = environ.get("NCCL_DEBUG_FILE", "").strip()
    if user_file and level in ("INFO", "TRACE"):  # NCCL expands %h (host name up to its first dot) and %p (pid)
        return NcclLogPlan(path=user_file.replace("%h", hostname.split(".")[0]).replace("%p", str(pid)), own=False)
    path = str(Path(temp_dir) / f"ddp-lab-preflight-nccl-{pid}.log")
    return NcclLogPlan(
        path=path,
        own=True,
        echo_level=level if level in NCCL_LEVELS else None,
        set=(("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET"), ("NCCL_DEBUG_FILE", path)),
    )


def lines_at_level(text: str, level: str) -> list[str]:
    """The lines of an INFO log that NCCL_DEBUG=``level`` would have printed."""
    shown = set(NCCL_LEVELS[1 : NCCL_LEVELS.index(level) + 1]) if level in NCCL_LEVELS else set()
    out = []
    for line in text.splitlines():
        kind = re.search(r" NCCL (WARN|INFO|TRACE) ", line)
        if (kind and kind.group(1) in shown) or (not kind and "NCCL version" in line):
            out.append(line)
    return out


_VIA = re.compile(r"via (NET/[^/\n]+(?=/)|P2P|SHM|COLLNET|direct shared memory)")  # a plugin's name may hold a space
_NET_USING = re.compile(r"NET/(\S+) ?: Using (.+)")
_USING_NETWORK = re.compile(r"Using network (.+)")


def parse_nccl_log(text: str) -> dict[str, Any]:
    """What NCCL's own INFO log says it uses: the network plugin ('IB', 'Socket', ...), the link layer of
    IB adapters (IB or RoCE: the '/IB' or '/RoCE' suffix of each '[0]mlx5_0:1/RoCE'), and the transports
    of its channels ('via NET/IB', 'via P2P', 'via SHM')."""
    network = None
    link_layers: set[str] = set()
    transports: set[str] = set()
    for line in text.splitlines():
        match = _USING_NETWORK.search(line)
        if match:
            network = match.group(1).strip()
        match = _NET_USING.search(line)
        if match and match.group(1).startswith("IB"):
            link_layers.update(re.findall(r"/(IB|RoCE)\b", match.group(2)))
        transports.update("SHM" if found == "direct shared memory" else found for found in _VIA.findall(line))
    return {"network": network, "link_layers": sorted(link_layers), "transports": sorted(transports)}


def enable_nccl_log(environ: dict[str, str] | os._Environ = os.environ) -> NcclLogPlan:
    """Before NCCL starts: make sure its INFO log lands in a file preflight can read (see plan_nccl_log)."""
    plan = plan_nccl_log(environ, os.getpid(), socket.gethostname(), tempfile.gettempdir())
    for name, value in plan.set:
        environ[name] = value
    return plan


def read_nccl_log(plan: NcclLogPlan | None) -> dict[str, Any] | None:
    """What NCCL's log says about the transport; the lines the user's own NCCL_DEBUG asked for are printed now."""
    if plan is None:
        return None
    path = Path(plan.path)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    finally:
        if plan.own:
            path.unlink(missing_ok=True)
    if plan.echo_level:
        lines = lines_at_level(text, plan.echo_level)
        if lines:
            print("\n".join(lines), flush=True)
    return parse_nccl_log(text)
