"""Several checkpoints, the fallback from a corrupt one, --resume-from, and a disk that fills or turns
unwritable mid-run, with torchrun and two processes as users run them."""

from __future__ import annotations

import contextlib
import errno
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddp_core.exit_codes import STORAGE_EXIT_CODE
from tests import prefork
from tests.e2e.launch import REPO, clean_env, final_weights, run, torchrun

FLAGS = ("--dataset-size", "256", "--checkpoint-every", "10", "--log-every", "10")


def step_file(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}.pt"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """40 steps without interruption: what every continuation below must end with, bitwise."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--steps", "40", *FLAGS)
    return final_weights(run_dir)


def assert_bitwise(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys() and all(torch.equal(expected[key], actual[key]) for key in expected)


def test_the_last_k_are_kept_and_a_corrupt_newest_one_falls_back_to_the_one_before(tmp_path: Path, reference):
    run_dir = tmp_path / "run"
    by_a_process = ("--checkpoint-writer", "process")  # as on a GPU; the resume below writes by a thread
    stop_at_30 = ("--steps", "40", "--stop-at-step", "30", *FLAGS, *by_a_process)
    torchrun(2, "experiments.toy", "--run-dir", str(run_dir), *stop_at_30)  # --keep-checkpoints 2 (default)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.pt", "step_00000020.pt", "step_00000030.pt"]
    assert (run_dir / "checkpoints" / "last.pt").samefile(step_file(run_dir, 30))

    newest = step_file(run_dir, 30)
    with open(newest, "r+b") as handle:  # cut in place: last.pt, the same file, is cut too
        handle.truncate(newest.stat().st_size // 2)
    result = torchrun(2, "experiments.toy", "--run-dir", str(run_dir), "--steps", "40", "--resume", *FLAGS)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, output[-3000:]
    assert (
        str(newest) in warnings[0]
        and "truncated or corrupt" in warnings[0]
        and str(step_file(run_dir, 20)) in warnings[0]
    )
    assert "Traceback" not in output
    assert f"resumed {step_file(run_dir, 20)} at step 20" in output
    assert_bitwise(reference, final_weights(run_dir))  # resumed from step 20: the same end, bitwise
    names = sorted(
        p.name for p in (run_dir / "checkpoints").iterdir()
    )  # the bad file is kept aside, never loaded again
    assert names == ["last.pt", "step_00000030.pt", "step_00000030.pt.corrupt", "step_00000040.pt"]


def test_resume_from_loads_exactly_that_file_and_sets_the_later_ones_aside(tmp_path: Path, reference):
    run_dir = tmp_path / "run"
    torchrun(
        2,
        "experiments.toy",
        "--run-dir",
        str(run_dir),
        "--steps",
        "40",
        "--stop-at-step",
        "30",
        "--keep-checkpoints",
        "0",
        *FLAGS,
    )  # keep all
    assert [step_file(run_dir, s).is_file() for s in (10, 20, 30)] == [True, True, True]

    result = torchrun(
        2,
        "experiments.toy",
        "--resume-from",
        str(step_file(run_dir, 10)),
        "--steps",
        "40",
        "--keep-checkpoints",
        "0",
        *FLAGS,
    )
    output = result.stdout + result.stderr
    assert f"resumed {step_file(run_dir, 10)} at step 10" in output, output[-3000:]  # the run directory: the file's run
    assert_bitwise(reference, final_weights(run_dir))
    assert (run_dir / "checkpoints" / "step_00000030.pt.superseded").is_file()  # kept, but never resumed from
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 40


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_resume_from_a_missing_or_corrupt_file_exits_2_with_one_line(tmp_path: Path, damage: str):
    path = tmp_path / "run" / "checkpoints" / "step_00000010.pt"
    if damage == "corrupt":
        path.parent.mkdir(parents=True)
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    result = run([prefork.python(), "-m", "experiments.toy", "--resume-from", str(path), "--steps", "20"], timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume-from=") and str(path) in lines[0], result.stderr
    assert ("no checkpoint at" if damage == "missing" else "truncated or corrupt") in lines[0]


# ------------------------------------------------------------------------------- the disk fills up

LONG = ("--steps", "3000", "--dataset-size", "512", "--checkpoint-every", "100", "--log-every", "1000")


def job(module_args: tuple[str, ...]) -> list[str]:
    return [prefork.python(), "-m", "ddp_core.torchrun", "--standalone", "--nproc-per-node=2", "-m", *module_args]


def assert_stopped_with_one_line(returncode: int, stdout: str, stderr: str, run_dir: Path, error_name: str) -> int:
    """Exit 74; one error line naming the file it could not write, the error and the intact checkpoint, which
    loads and holds the step the line says; no temp file and no metrics.json left. Returns that step."""
    output = stdout + stderr
    assert returncode == STORAGE_EXIT_CODE, output[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    match = re.fullmatch(
        r"error: cannot write (\S+): .*\(("
        + error_name
        + r")[;)].*; the last checkpoint, step (\d+), is intact: (\S+); .*--resume",
        errors[0],
    )
    assert match, errors[0]
    failed, _, step, intact = match.groups()
    assert Path(failed).parent == run_dir / "checkpoints" and not Path(failed).exists()
    assert Path(intact) == step_file(run_dir, int(step))
    assert torch.load(intact, weights_only=True)["step"] == int(step)
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == int(step)
    assert not list(run_dir.rglob("*.tmp-*")), list(run_dir.rglob("*"))
    assert not (run_dir / "metrics.json").exists()
    return int(step)


@contextlib.contextmanager
def small_tmpfs(where: Path):
    """A real 1 MB filesystem (tmpfs), or a skip where this process may not mount one."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'}):"
            " the injected disk_full test covers this"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    """Write zeros until the filesystem says ENOSPC."""
    with open(disk / "filler", "wb", buffering=0) as handle:
        block = b"\x00" * 4096
        while True:
            try:
                handle.write(block)
            except OSError as error:
                assert error.errno == errno.ENOSPC
                return


def test_a_disk_that_fills_during_a_checkpoint_write_stops_both_ranks_with_one_line(tmp_path: Path):
    """A real full disk: a 1 MB tmpfs, filled while the toy trains, right after its first checkpoint."""
    with small_tmpfs(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        agent = subprocess.Popen(
            job(("experiments.toy", "--run-dir", str(run_dir), *LONG)),
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not step_file(run_dir, 100).exists() and agent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)  # waiting for a condition: the first checkpoint
            assert agent.poll() is None, "the run ended before the disk filled"
            fill(disk)
            stdout, stderr = agent.communicate(timeout=120)
        finally:
            if agent.poll() is None:
                agent.kill()
        step = assert_stopped_with_one_line(agent.returncode, stdout, stderr, run_dir, "ENOSPC")
        assert 100 <= step < 3000
        (disk / "filler").unlink()  # space again: the run continues from the intact checkpoint
        resumed = run(
            job(
                (
                    "experiments.toy",
                    "--run-dir",
                    str(run_dir),
                    "--resume",
                    "--allow-config-change",
                    "--steps",
                    str(step + 100),
                    *LONG[2:],
                )
            ),
            timeout=180,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed {step_file(run_dir, step)} at step {step}" in resumed.stdout


@pytest.mark.parametrize(("fault", "error_name"), [("disk_full", "ENOSPC"), ("unwritable", "EACCES")])
def test_a_write_failure_during_the_third_checkpoint_stops_both_ranks_with_one_line(
    tmp_path: Path, fault: str, error_name: str
):
    """Injected on rank 0 (tests/e2e/faulty.py): every write under the run directory fails from the third
    checkpoint on, ENOSPC (a full disk, where mount is not allowed) or EACCES (a run directory made read-only)."""
    run_dir = tmp_path / "run"
    result = run(
        job(("tests.e2e.faulty", "experiments.toy", "--run-dir", str(run_dir), "--steps", "60", *FLAGS)),
        timeout=180,
        FAULT=fault,
        FAULT_RANK="0",
        FAULT_STEP="3",
        FAULT_DIR=str(run_dir),
    )
    step = assert_stopped_with_one_line(result.returncode, result.stdout, result.stderr, run_dir, error_name)
    assert step == 20 and not step_file(run_dir, 30).exists() and step_file(run_dir, 10).is_file()
    assert f"cannot write {step_file(run_dir, 30)}" in result.stderr
