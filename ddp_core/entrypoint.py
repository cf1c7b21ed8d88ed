"""The container's entrypoint: turn the environment into one torchrun command, then ``exec`` it.

    docker run ... IMAGE [extra experiment flags]        # ENTRYPOINT ["python3", "-m", "ddp_core.entrypoint"]

EXPERIMENT, NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR/PORT, RDZV_BACKEND/ID, MAX_RESTARTS and DIST_INIT_TIMEOUT_S
become torchrun's flags (docs/reference.md, "Docker"); every other variable reaches the workers unchanged, the
experiments' own checked here once. ``exec``: ``docker stop``'s SIGTERM reaches the launcher. Without NPROC_PER_NODE,
GPUs torch cannot use are refused (unless BACKEND=gloo). EXPERIMENT is read as text: no import of experiments/.
"""

from __future__ import annotations

import math
import os
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Mapping, Sequence

from ddp_core.config import MAX_NPROC, CommonArgs, options_from_environment
from ddp_core.distributed.env import MAX_RANKS, check_resolves, int_var
from ddp_core.distributed.group import DEFAULT_INIT_TIMEOUT_S
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.experiment_files import kind_of

RDZV_BACKENDS = ("static", "c10d")


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int, maximum: int = MAX_RANKS) -> int:
    value = int_var(environ, name, default, minimum, maximum)
    assert value is not None
    return value


def available_experiments() -> list[str]:
    """The names EXPERIMENT accepts: every experiment file in the experiments package, read as text."""
    spec = find_spec("experiments")
    folders = spec.submodule_search_locations if spec is not None else None
    return sorted(
        path.stem
        for folder in folders or ()
        for path in Path(folder).glob("*.py")
        if kind_of(path) is not None  # NAME.py of a kind: not a helper, not _private
    )


def default_nproc(backend: str = "auto") -> int:
    """Every visible GPU, or 2 CPU processes; refuses GPUs that torch cannot use unless BACKEND=gloo asks for CPU."""
    import torch  # only when NPROC_PER_NODE is not given

    from ddp_core.distributed import cuda

    if backend != "gloo":
        if not torch.cuda.is_available():
            cuda.refuse_unusable_driver()  # else a too-old driver would silently give 2 CPU processes
        else:
            cuda.refuse_unsupported_gpus(range(torch.cuda.device_count()))
    return torch.cuda.device_count() or 2


def torchrun_command(environ: Mapping[str, str], extra_args: Sequence[str]) -> list[str]:
    """The torchrun argv for this environment; raises ConfigError on bad values."""
    experiment = environ.get("EXPERIMENT", "").strip() or "toy"
    if experiment not in available_experiments():
        raise ConfigError(
            f"EXPERIMENT={experiment!r} is not a module in experiments/: "
            f"use one of {', '.join(available_experiments())}"
        )
    common = options_from_environment(CommonArgs, environ)  # SEED=-1 and the like: refused once here
    nnodes = _int(environ, "NNODES", 1, 1)
    nproc = _int(environ, "NPROC_PER_NODE", 0, 1, MAX_NPROC) or default_nproc(common.get("backend", "auto"))
    restarts = _int(environ, "MAX_RESTARTS", 0, 0)
    command = [sys.executable, "-m", "ddp_core.torchrun", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}"]
    if nnodes == 1:
        command.append("--standalone")
    else:
        node_rank = _int(environ, "NODE_RANK", 0, 0)
        if node_rank >= nnodes:
            raise ConfigError(f"NODE_RANK={node_rank} must be < NNODES={nnodes}: node ranks run from 0 to {nnodes - 1}")
        master_addr = environ.get("MASTER_ADDR", "").strip()
        if not master_addr:
            raise ConfigError(f"NNODES={nnodes} needs MASTER_ADDR: set it to node 0's address (the same on every node)")
        master_port = _int(environ, "MASTER_PORT", 29500, 1, 65535)
        check_resolves(master_addr, master_port, "MASTER_ADDR")
        backend = environ.get("RDZV_BACKEND", "").strip() or "static"
        if backend not in RDZV_BACKENDS:
            raise ConfigError(f"RDZV_BACKEND={backend!r} is not supported: use static or c10d")
        # the agents meet before any worker starts: they get the workers' set-up deadline, not torch's 10-15 min
        timeout = math.ceil(common.get("dist_init_timeout_s", DEFAULT_INIT_TIMEOUT_S))
        command.append(f"--nnodes={nnodes}")
        if backend == "static":
            command += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
            command.append(f"--rdzv-conf=timeout={timeout}")
        else:
            rdzv_id = environ.get("RDZV_ID", "").strip() or "ddp-lab"
            command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}", f"--rdzv-id={rdzv_id}"]
            command.append(f"--rdzv-conf=join_timeout={timeout}")
    return command + ["-m", f"experiments.{experiment}", *extra_args]


@exits_with_one_line
def main(argv: Sequence[str] | None = None) -> None:
    command = torchrun_command(os.environ, sys.argv[1:] if argv is None else argv)
    print("+ " + " ".join(command), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
