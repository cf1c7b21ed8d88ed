"""bench.stress's verdict on one run: exit 0 passes; a failure keeps torchrun's code, the workers' codes and
the cause."""

from __future__ import annotations

import os
import sys

from bench.stress import distinctive_line, run_once

# torchrun's stderr when the plain-torch control aborted at exit (trimmed from a real run)
ABORTED = """terminate called without an active exception
W1123 05:41:41.465000 4095 torch/distributed/elastic/multiprocessing/api.py:1028] \
Sending process 4115 closing signal SIGTERM
E1123 05:41:41.607000 4095 torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: -6) local_rank: 0 (pid: 4114)
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
    assert (
        distinctive_line("W1123 05:41:41.465000 1 api.py] Sending process 2 closing signal SIGTERM\nValueError: x\n")
        == "ValueError: x"
    )
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


REFUSED_LINE = "error: --resume: --lr: 0.2 -> 0.5 (checkpoint -> now, step_00000003.pt): relaunch with the run's values"
CLOSED_AFTER = "W1125 07:13:40.937000 21530 api.py:1028] Sending process 21542 closing signal SIGTERM"


def exits(code: int, stderr: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.stderr.write({stderr!r}); sys.exit({code})"]


def test_a_refusal_passes_only_with_its_code_and_its_one_line_last():
    assert run_once(exits(2, REFUSED_LINE + "\n"), dict(os.environ), timeout=60, expected=2) is None
    late = run_once(exits(2, f"{REFUSED_LINE}\n{CLOSED_AFTER}\n"), dict(os.environ), timeout=60, expected=2)
    assert (
        late is not None
        and "1 error line(s)" in late.first_line
        and late.first_line.endswith("torchrun: Sending process 21542 closing signal SIGTERM")
    )
    silent = run_once(exits(2, ""), dict(os.environ), timeout=60, expected=2)
    assert silent is not None and "0 error line(s)" in silent.first_line
    twice = run_once(exits(2, f"{REFUSED_LINE}\n{REFUSED_LINE}\n"), dict(os.environ), timeout=60, expected=2)
    assert twice is not None and "2 error line(s)" in twice.first_line
    assert run_once(exits(0, ""), dict(os.environ), timeout=60, expected=2) is not None  # not refused at all


def test_the_refusal_launcher_stops_one_run_then_resumes_it_with_another_lr(tmp_path):
    from bench.stress import StressArgs, commands

    stop = commands(StressArgs(launcher="refusal", nproc=3), tmp_path, 0)["stop"]
    refusal = commands(StressArgs(launcher="refusal", nproc=3), tmp_path, 5)["refusal"]
    assert stop[-2:] == ["--stop-at-step", "3"] and refusal[-3:] == ["--lr", "0.5", "--resume"]
    assert stop[:-2] == refusal[:-3] and "--nproc-per-node=3" in refusal and "ddp_core.torchrun" in refusal


DIVERGED_LINE = "error: replicas diverged at step 8: net2.bias: rank(s) 2 differ from rank(s) 0, 1; ..."


def test_a_divergence_passes_only_with_its_line_naming_the_checkpoint(tmp_path):
    from bench.stress import StressArgs, commands

    named = f"{DIVERGED_LINE} --resume continues from /r/checkpoints/last.pt. Causes: ...\n"
    must = "--resume continues from "
    assert run_once(exits(5, named), dict(os.environ), timeout=60, expected=5, must_say=must) is None
    unnamed = run_once(exits(5, f"{DIVERGED_LINE} no checkpoint had been written yet\n"), dict(os.environ), 60, 5, must)
    assert unnamed is not None and unnamed.first_line.startswith(f"the line lacks {must!r}: error: replicas diverged")
    diverged = commands(StressArgs(launcher="diverged", nproc=3), tmp_path, 4)
    assert list(diverged) == ["diverged"]
    command = diverged["diverged"]
    assert command[command.index("bench.perturbed_replica") + 1] == "experiments.toy"
    assert "--nproc-per-node=3" in command and str(tmp_path / "diverged-4") in command
