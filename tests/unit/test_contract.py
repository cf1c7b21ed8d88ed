"""tools.contract's own input and its comparison of weights; the runs themselves are tests/e2e/test_contract.py."""

from __future__ import annotations

import json

import pytest
import torch

import experiments.toy as toy
from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.process.preemption import STOPPED_BY_SIGNAL
from tools.contract import RTOL, Contract, Launch, PropertyFailed, compare, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["experiments.collectives"], "experiments.collectives declares no CONTRACT = ContractSpec(...)"),
        (["experiments.no_such_experiment"], "no module 'experiments.no_such_experiment'"),
        (["experiments.toy", "--only", "resume,speed"], "--only: no property speed; choose from bad-flag, run-dir,"),
        (["experiments.toy", "--timeout", "0"], "--timeout=0 must be above 0 seconds"),
        (["experiments.toy", "--timeout", "nan"], "--timeout=nan must be above 0 seconds"),
    ],
)
def test_what_it_cannot_check_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_keep_refuses_a_folder_with_files(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("someone's")
    with pytest.raises(SystemExit) as stop:
        main(["experiments.toy", "--keep", str(tmp_path)])
    assert stop.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert (tmp_path / "old.txt").read_text() == "someone's"


def test_compare_is_bitwise_or_within_float32_rounding():
    a = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor([3])}
    nudged = {"w": torch.tensor([1.0, 2.0 * (1 + RTOL / 4)]), "steps": torch.tensor([3])}
    assert compare(a, dict(a), exact=True) is None
    assert compare(a, nudged, exact=False) is None
    assert "w differs" in compare(a, nudged, exact=True)
    assert "w differs" in compare(a, {"w": torch.tensor([1.0, 2.1]), "steps": torch.tensor([3])}, exact=False)
    assert "steps differs" in compare(
        a, {"w": a["w"], "steps": torch.tensor([4])}, exact=False
    )  # integers: exact always
    assert "different parameter names" in compare(a, {"w": a["w"]}, exact=True)
    assert "(2,) torch.float32 vs (3,)" in compare(a, {"w": torch.zeros(3), "steps": a["steps"]}, exact=True)


def sigterm_evidence(tmp_path, last_steps: dict[int, int], rank0_said: int | None, checkpoint_step: int) -> str:
    """check_sigterm on a launch made up here: each rank's trace ending at its step, rank 0's stop line (or none),
    and a newest checkpoint; returns its verdict (PASS, or FAIL: why)."""
    contract = Contract("experiments.toy", toy.CONTRACT, (), tmp_path, timeout_s=60)
    run_dir = tmp_path / "runs" / "sigterm"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"step": checkpoint_step}, run_dir / "checkpoints" / "last.pt")
    for rank, last in last_steps.items():
        lines = [json.dumps({"step": step, "batch": [0.0], "streams": "s"}) for step in range(1, last + 1)]
        (contract.traces / "sigterm").mkdir(parents=True, exist_ok=True)
        (contract.traces / "sigterm" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    said = (
        STOPPED_BY_SIGNAL.format(step=rank0_said, command=f"--resume --run-dir {run_dir}")
        if rank0_said is not None
        else "training"
    )
    contract.launches["sigterm"] = Launch(
        "sigterm", 3, STOPPED_EXIT_CODE, f"12:00:00 [rank 0/3] WARNING {said}\n", run_dir
    )
    try:
        return "PASS: " + contract.check_sigterm()
    except PropertyFailed as why:
        return f"FAIL: {why}"


@pytest.mark.parametrize(
    ("last_steps", "rank0_said", "checkpoint_step", "verdict"),
    [
        ({0: 7, 1: 7, 2: 7}, 7, 7, "PASS: every rank stopped after step 7"),
        ({0: 7, 1: 8, 2: 7}, 7, 7, "FAIL: the ranks stopped after different steps: {0: 7, 1: 8, 2: 7}"),
        ({0: 7, 2: 7}, 7, 7, "FAIL: ranks [1] recorded no step"),
        ({0: 7, 1: 7, 2: 7}, None, 7, "FAIL: every rank stopped after step 7, but rank 0 did not log"),
        ({0: 7, 1: 7, 2: 7}, 6, 7, "FAIL: every rank stopped after step 7, but rank 0 did not log"),
        ({0: 7, 1: 7, 2: 7}, 7, 5, "FAIL: every rank stopped after step 7, but the newest checkpoint holds step 5"),
    ],
    ids=[
        "agreed",
        "a-rank-went-on",
        "a-rank-traced-nothing",
        "no-stop-line",
        "line-names-another-step",
        "old-checkpoint",
    ],
)
def test_sigterm_reads_each_ranks_step_from_its_trace(tmp_path, last_steps, rank0_said, checkpoint_step, verdict):
    """The stop line is printed once (rank 0), so every rank's step comes from its own trace: each way the ranks
    can disagree still fails the property."""
    assert sigterm_evidence(tmp_path, last_steps, rank0_said, checkpoint_step).startswith(verdict)
