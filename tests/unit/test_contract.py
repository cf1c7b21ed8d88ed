"""ddp_core.contract's own input and its comparison of weights; the runs themselves are tests/e2e/test_contract.py."""

from __future__ import annotations

import pytest
import torch

from ddp_core.contract import RTOL, compare, main


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
