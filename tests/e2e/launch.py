"""Start experiments the way users do: torchrun (or python -m) in a subprocess, from the repository root.

The interpreter of ``torchrun_command`` and ``torchrun`` is ``tests.prefork``'s by default: the same
commands, whose processes fork from a server that imported torch once (tests/prefork.py says what that
does not reproduce). A test that needs real interpreter starts, or a whole job's processes seen gone, passes
``python=sys.executable``; one that signals a launcher's child finds it through ``prefork.stands_for``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from bench.processes import option_variables
from ddp_core.config import CommonArgs
from ddp_core.distributed.env import TORCHRUN_VARIABLES
from tests import prefork

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARIABLES = (
    *TORCHRUN_VARIABLES,
    *option_variables(CommonArgs),
    "TORCH_FR_DUMP_TEMP_FILE",  # set in this process by a run an earlier test made in-process
)


def clean_env(**overrides: str) -> dict[str, str]:
    """The test runner's environment without any launch or ddp-lab variable, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env


def torchrun_command(
    nproc: int,
    module: str,
    *args: str,
    torchrun_args: tuple[str, ...] = ("--standalone",),
    launcher: str = "torch.distributed.run",
    python: str | None = None,
) -> list[str]:
    """Plain torchrun by default; ``launcher="ddp_core.torchrun"`` for ddp-lab's own (``make train``, the images)."""
    return [
        python or prefork.python(),
        "-m",
        launcher,
        *torchrun_args,
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def run(command: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)
    return result


def torchrun(
    nproc: int, module: str, *args: str, timeout: float = 180, python: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    result = run(torchrun_command(nproc, module, *args, python=python), timeout=timeout, **env)
    assert result.returncode == 0, (
        f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
