"""python -m tools.contract on the toy (it keeps it) and on two experiments broken on purpose (it must
catch and name what each does wrong). CIFAR10 and charlm: test_contract_domains.py, a module of its own so
that a pytest worker can run it beside this one."""

from __future__ import annotations

from pathlib import Path

from tests import prefork
from tests.e2e.launch import run
from tools.contract import PROPERTIES


def contract(module: str, *args: str, extra: tuple[str, ...] = ()):
    command = [prefork.python(), "-m", "tools.contract", module, *args, *(("--", *extra) if extra else ())]
    return run(command, timeout=1200)


def verdicts(output: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in output.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}


def test_the_toy_keeps_every_property():
    result = contract("experiments.toy")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert verdicts(result.stdout) == {name: "PASS" for name in PROPERTIES}, result.stdout


def test_writes_from_every_rank_are_caught_and_named(tmp_path: Path):
    result = contract(
        "tests.e2e.contract_every_rank_writes", "--only", "run-dir,rank-zero-writes", "--keep", str(tmp_path / "kept")
    )
    assert result.returncode == 1, result.stdout
    assert verdicts(result.stdout) == {"run-dir": "PASS", "rank-zero-writes": "FAIL"}, result.stdout
    failure = next(line for line in result.stdout.splitlines() if line.startswith("FAIL"))
    assert "rank 1 wrote log_rank1.txt" in failure, failure
    assert "log_rank0.txt" not in failure  # rank 0 may write
    assert str(tmp_path / "kept") in result.stdout.splitlines()[-1]  # where to look


def test_a_resume_that_forgets_the_random_state_is_caught(tmp_path: Path):
    # --keep: a failed contract keeps its runs for the user to read; here in the test's folder, not /tmp's
    result = contract("tests.e2e.contract_forgets_rng", "--only", "resume", "--keep", str(tmp_path / "kept"))
    assert result.returncode == 1, result.stdout
    failure = next(line for line in result.stdout.splitlines() if line.startswith("FAIL"))
    assert "--stop-at-step 5 then --resume at 2 processes differs from the uninterrupted run" in failure, failure
    assert "likely cause: after the resume, rank 0's random streams at step 6 differ" in failure, failure


def test_a_resume_that_restarts_its_epoch_is_caught_and_the_sampler_named(tmp_path: Path):
    result = contract("tests.e2e.contract_restarts_epoch", "--only", "resume", "--keep", str(tmp_path / "kept"))
    assert result.returncode == 1, result.stdout
    failure = next(line for line in result.stdout.splitlines() if line.startswith("FAIL"))
    assert "likely cause: after the resume, rank 0 trained step 6 on other samples" in failure, failure
    assert "sampler.set_epoch(epoch, consumed=consumed)" in failure, failure


def test_the_toy_keeps_its_contract_with_powersgd_and_zero():
    """DDP's knobs keep the contract: the resume (PowerSGD's per-rank state, ZeRO's shards) and a SIGTERM stop;
    world-size invariance is skipped, with the reason, since compression changes the sum."""
    knobs = ("--comm-hook", "powersgd", "--powersgd-start-step", "2", "--zero")
    result = contract("experiments.toy", "--only", "resume,world-size,sigterm", extra=knobs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert verdicts(result.stdout) == {"resume": "PASS", "world-size": "SKIP", "sigterm": "PASS"}, result.stdout
    assert "--comm-hook powersgd compresses the all-reduce" in result.stdout
