"""DistEnv: torchrun's environment variables, read and validated before any process group exists."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

from ddp_core.errors import ConfigError

# What a launcher sets for each worker: a command started from inside a worker (a child torchrun) must not inherit them.
TORCHRUN_VARIABLES = tuple(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK TORCHELASTIC_RESTART_COUNT "
    "TORCHELASTIC_USE_AGENT_STORE TORCHELASTIC_RUN_ID DDP_LAB_NNODES_RANGE DDP_LAB_RDZV_ROUND".split()
)
# Set by ddp_core.torchrun under c10d: the node range "MIN:MAX" of an elastic job (MIN < MAX), and the round.
NNODES_RANGE_VARIABLE = "DDP_LAB_NNODES_RANGE"
RDZV_ROUND_VARIABLE = "DDP_LAB_RDZV_ROUND"
HEAL_VARIABLE = "DDP_LAB_HEAL"  # 1: ddp_core.torchrun --heal (ddp_core/lifecycle/heal.py)
HEAL_REPLACEMENT_VARIABLE = "DDP_LAB_HEAL_REPLACEMENT"  # n >= 1: this worker replaces a dead one, the n-th time
LAUNCH_HINT = "launch with torchrun, which sets it, or set it by hand"
MAX_RANKS = 2**31 - 1  # torch.distributed keeps ranks and world sizes in a C int


def _bound(value: int) -> str:
    return "2**31-1" if value == MAX_RANKS else str(value)


def int_var(
    environ: Mapping[str, str], name: str, default: int | None, minimum: int, maximum: int = MAX_RANKS, hint: str = ""
) -> int | None:
    """An integer environment variable within [minimum, maximum]; empty or unset gives ``default``."""
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    accepts = f"an integer in {_bound(minimum)}..{_bound(maximum)}"
    shown = raw if len(raw) <= 80 else raw[:80] + "..."
    try:
        value = int(raw)
    except ValueError:  # also a number of more than 4300 digits
        raise ConfigError(
            f"{name}={shown!r} is not an integer: it must be {accepts}" + (f" ({hint})" if hint else "")
        ) from None
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name}={value if len(raw) <= 80 else shown} is out of range: it must be {accepts}")
    return value


def _int_var(
    environ: Mapping[str, str], name: str, default: int | None, minimum: int, maximum: int = MAX_RANKS
) -> int | None:
    return int_var(environ, name, default, minimum, maximum, hint=LAUNCH_HINT)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job; no variables: a world of one. Launched by hand, LOCAL_RANK defaults to
    RANK and LOCAL_WORLD_SIZE to WORLD_SIZE (one node)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    # torchrun's agent serves the TCPStore at MASTER_ADDR:MASTER_PORT; otherwise rank 0 hosts it.
    agent_store: bool = False

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        env = os.environ if environ is None else environ
        world_size = _int_var(env, "WORLD_SIZE", None, 1)
        rank = _int_var(env, "RANK", None, 0)
        if rank is not None and world_size is None:
            raise ConfigError(f"RANK={rank} is set but WORLD_SIZE is not: set WORLD_SIZE to the number of processes")
        if world_size is not None and rank is None:
            raise ConfigError(
                f"WORLD_SIZE={world_size} is set but RANK is not: set RANK (0..{world_size - 1}) for each process"
            )
        world_size = world_size or 1
        rank = rank or 0
        if rank >= world_size:
            raise ConfigError(f"RANK={rank} must be < WORLD_SIZE={world_size}: ranks run from 0 to {world_size - 1}")

        local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", world_size, 1)
        local_rank = _int_var(env, "LOCAL_RANK", rank if local_world_size == world_size else None, 0)
        if local_rank is None:
            raise ConfigError(
                f"LOCAL_RANK is not set: set it to this process's index on its node (0..{local_world_size - 1})"
            )
        if local_world_size > world_size:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local_world_size} must be <= WORLD_SIZE={world_size}")
        if local_rank >= local_world_size:
            raise ConfigError(
                f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size}: "
                f"local ranks run from 0 to {local_world_size - 1} on each node"
            )

        master_addr = env.get("MASTER_ADDR", "").strip() or None
        master_port = _int_var(env, "MASTER_PORT", None, 1, 65535)

        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            master_addr=master_addr,
            master_port=master_port,
            restart_count=_int_var(env, "TORCHELASTIC_RESTART_COUNT", 0, 0) or 0,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )

    def require_master(self) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for a multi-process env:// launch, checked to resolve."""
        pairs = (("MASTER_ADDR", self.master_addr), ("MASTER_PORT", self.master_port))
        missing = [name for name, value in pairs if value is None]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={self.world_size} needs {' and '.join(missing)}: set them to rank 0's host and a free "
                "port (torchrun sets both), or use INIT_METHOD=tcp://HOST:PORT"
            )
        assert self.master_addr is not None and self.master_port is not None
        check_resolves(self.master_addr, self.master_port, "MASTER_ADDR")
        return self.master_addr, self.master_port


def check_resolves(host: str, port: int, name: str) -> None:
    """Fail with one line instead of torch's stream of resolver warnings, which torch repeats until its timeout."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(
            f"{name}={host!r} does not resolve ({error}): use rank 0's IP address or a host name every node can resolve"
        ) from None


def nnodes_range(environ: Mapping[str, str] | None = None) -> str | None:
    """ "MIN:MAX" under an elastic node range (a restart at another world size is then asked for), else None."""
    value = (os.environ if environ is None else environ).get(NNODES_RANGE_VARIABLE, "").strip()
    return value or None


def rendezvous_round(environ: Mapping[str, str] | None = None) -> int | None:
    """The c10d rendezvous round this worker was started for (ddp_core.torchrun sets it), or None."""
    value = (os.environ if environ is None else environ).get(RDZV_ROUND_VARIABLE, "").strip()
    return int(value) if value.isdigit() else None


def healing(environ: Mapping[str, str] | None = None) -> bool:
    """Under ``ddp_core.torchrun --heal``."""
    return (os.environ if environ is None else environ).get(HEAL_VARIABLE) == "1"


def joining(environ: Mapping[str, str] | None = None) -> bool:
    """A --heal replacement: its peers hold the run's state and train on; its set-up decides alone."""
    environ = os.environ if environ is None else environ
    return healing(environ) and environ.get(HEAL_REPLACEMENT_VARIABLE, "0").strip() not in ("", "0")
