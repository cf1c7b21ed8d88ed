"""bench.study_kill's reading of a killed study: the runs whose rank-0 process is still here read "running"; one
whose process is gone, or that ended with an exit code, does not."""

from __future__ import annotations

import subprocess
import sys

from bench.study_kill import running
from ddp_core.output import process_identity
from tests.unit.test_runs_table import make_run, manifest


def test_only_the_runs_whose_process_is_here_read_running(tmp_path):
    me = process_identity.this_process()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    make_run(tmp_path, "lr=0.05/seed-0", manifest() | {"rank0_process": me})
    make_run(tmp_path, "lr=0.05/seed-1", manifest() | {"rank0_process": {**me, "pid": int(gone.stdout)}})
    make_run(tmp_path, "lr=0.2/seed-0", manifest() | {"rank0_process": me, "exit_code": 0}, {"final_loss": 0.1})
    make_run(tmp_path, "lr=0.2/notarun", manifest() | {"rank0_process": me})  # not a seed folder: not the study's
    assert running(tmp_path) == [tmp_path / "lr=0.05" / "seed-0"]
