"""bench.stress's verdict on one run: exit 0 passes; a failure keeps torchrun's code, the workers' codes and the cause."""

from __future__ import annotations

import os
import sys

from bench.stress import distinctive_line, run_once

# torchrun's stderr when the plain-torch control aborted at exit (trimmed from a real run)
ABORTED = """terminate called without an active exception
W1123 05:41:41.465000 4095 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 4115 closing signal SIGTERM
E1123 05:41:41.607000 4095 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 0 (pid: 4114)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  exitcode  : -15 (pid: 4115)  (SIGTERM)
[2]:
  exitcode  : -15 (pid: 4116)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  exitcode  : -6 (pid: 4114)  (SIGABRT)
"""


def test_the_distinctive_line_skips_torchruns_own_logging():
    assert distinctive_line(ABORTED) == "terminate called without an active exception"
    assert distinctive_line("W1123 05:41:41.465000 1 api.py] Sending process 2 closing signal SIGTERM\nValueError: x\n") == "ValueError: x"
    assert distinctive_line("") == "(nothing on stderr)"


def test_a_failed_run_reports_its_codes_root_cause_first_and_its_first_line():
    script = f"import sys; sys.stderr.write({ABORTED!r}); sys.exit(1)"
    failure = run_once([sys.executable, "-c", script], dict(os.environ), timeout=60)
    assert failure is not None
    assert failure.exit_code == 1 and failure.worker_codes == (-6, -15, -15)
    assert failure.first_line == "terminate called without an active exception"


def test_a_clean_run_is_no_failure_and_a_hung_one_is_killed():
    assert run_once([sys.executable, "-c", "pass"], dict(os.environ), timeout=60) is None
    hung = run_once([sys.executable, "-c", "import threading; threading.Event().wait()"], dict(os.environ), timeout=1)
    assert hung is not None and hung.exit_code == -9 and hung.first_line.startswith("timed out after 1 s")


def test_each_launcher_runs_ddp_labs_side_first_then_its_control(tmp_path):
    from bench.stress import StressArgs, commands

    spawn = commands(StressArgs(launcher="spawn", nproc=3), tmp_path, 1)
    assert list(spawn) == ["leave", "return"]
    assert spawn["leave"][1:] == ["-m", "bench.spawn_teardown", "--nproc", "3", "--exit", "leave"]
    assert spawn["return"][-1] == "return"
    torchrun = commands(StressArgs(nproc=4, steps=5), tmp_path, 7)
    assert list(torchrun) == ["toy", "control"]
    assert "--nproc-per-node=4" in torchrun["toy"] and str(tmp_path / "toy-7") in torchrun["toy"]
    assert torchrun["control"][-2:] == ["-m", "bench.teardown_control"]
