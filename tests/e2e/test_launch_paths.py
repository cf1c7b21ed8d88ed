"""Launch paths agree: ddp_core.torchrun and ``--nproc`` give their workers the same threads.

Real interpreters (``sys.executable``), not tests.prefork's: the threads are read by torch when it loads
OpenMP.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.launch import REPO, clean_env

TORCHRUN = (sys.executable, "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=2")
LAUNCHERS = {
    "ddp_core.torchrun": lambda module, *args: [*TORCHRUN, "-m", module, *args],
    "--nproc": lambda module, *args: [sys.executable, "-m", module, "--nproc", "2", *args],
}


def environment(omp_num_threads: str | None) -> dict[str, str]:
    env = clean_env()  # sets OMP_NUM_THREADS=1 for every other test launch: here it is what is tested
    del env["OMP_NUM_THREADS"]
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = omp_num_threads
    return env


def threads_of_one_process(omp_num_threads: str) -> int:
    """torch's intra-op threads in a process started with this OMP_NUM_THREADS (torch caps it at the cores)."""
    command = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.check_output(command, env=environment(omp_num_threads), text=True, timeout=60))


@pytest.mark.parametrize("omp_num_threads", [None, "2"], ids=["unset", "the user's 2"])
def test_both_launchers_give_each_worker_the_threads_torchrun_gives(tmp_path: Path, omp_num_threads: str | None):
    """torchrun's rule (torch.distributed.run): with several processes on the node and no OMP_NUM_THREADS,
    each worker gets OMP_NUM_THREADS=1; a value the user set is kept. The --nproc workers got every core."""
    seen = {}
    for name, command in LAUNCHERS.items():
        out = tmp_path / name
        out.mkdir()
        result = subprocess.run(
            command("tests.e2e.threads_probe", "--out", str(out)),
            cwd=REPO,
            env=environment(omp_num_threads),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{name}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        seen[name] = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))}
    expected = omp_num_threads or "1"
    each = {"OMP_NUM_THREADS": expected, "threads": threads_of_one_process(expected)}
    assert seen == {name: {"rank0": each, "rank1": each} for name in LAUNCHERS}
    if omp_num_threads is None:
        assert each["threads"] == 1
