"""``make train`` starts NPROC processes per node from make's command line, the environment or .env.

The real Makefile runs in a copy of the repository's top level with a stand-in venv: its ``python`` runs
tests/prefork.py's stand-in (a process forked with torch imported), except for ``-m ddp_core.torchrun``, whose
arguments it writes to a file instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import prefork

REPO = Path(__file__).resolve().parents[2]
STAND_IN = """#!/bin/bash
if [[ "$1 $2" == "-m ddp_core.torchrun" ]]; then
  printf '%s\\n' "$@" > "$LAUNCHED"
  exit 0
fi
exec {python} "$@"
"""


@pytest.fixture
def make_train(tmp_path: Path):
    """``make_train(*make_args, env_file=..., **environment)``: the launched torchrun's arguments (or None)
    and make's result."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "requirements.txt", "requirements-dev.txt", "requirements-heal.txt", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
        os.utime(tmp_path / name, (0, 0))  # older than the venv: `setup` has nothing to do
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN.format(python=prefork.python()))
    python.chmod(0o755)
    (tmp_path / "venv" / ".installed").touch()
    launched = tmp_path / "launched"

    def run(*make_args: str, env_file: str | None = None, **environment: str):
        launched.unlink(missing_ok=True)
        (tmp_path / ".env").unlink(missing_ok=True)
        if env_file is not None:
            (tmp_path / ".env").write_text(env_file)
        env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        env.update(LAUNCHED=str(launched), PYTHONPATH=str(REPO), **environment)
        result = subprocess.run(
            ["make", "--no-print-directory", "train", "VENV=venv", *make_args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return (launched.read_text().splitlines() if launched.exists() else None), result

    return run


def nproc_of(arguments: list[str] | None) -> int:
    assert arguments is not None, "torchrun was not launched"
    [flag] = [a for a in arguments if a.startswith("--nproc-per-node=")]
    assert arguments[-2:] == ["-m", "experiments.toy"]
    return int(flag.split("=", 1)[1])


def test_nproc_in_env_file_is_the_count(make_train):
    launched, result = make_train(env_file="# mine\nSEED=1\nNPROC=3\n")
    assert result.returncode == 0, result.stderr
    assert nproc_of(launched) == 3


def test_the_environment_wins_over_env_file_and_make_s_command_line_over_both(make_train):
    launched, result = make_train(env_file="NPROC=3\n", NPROC="4")
    assert result.returncode == 0, result.stderr
    assert nproc_of(launched) == 4
    launched, result = make_train("NPROC=5", env_file="NPROC=3\n", NPROC="4")
    assert result.returncode == 0, result.stderr
    assert nproc_of(launched) == 5


@pytest.mark.parametrize("env_file", [None, "NPROC=\n"], ids=["no .env", "empty"])
def test_without_nproc_every_gpu_or_two_cpu_processes(make_train, env_file: str | None):
    launched, result = make_train(env_file=env_file)  # tests/conftest.py hides the GPUs
    assert result.returncode == 0, result.stderr
    assert nproc_of(launched) == 2


def test_a_bad_nproc_in_env_file_is_one_line_and_nothing_starts(make_train):
    launched, result = make_train(env_file="NPROC=four\n")
    assert launched is None and result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if not line.startswith("make")]
    assert errors == ["error: NPROC='four' is not an integer: it must be an integer in 1..1024"], result.stderr
