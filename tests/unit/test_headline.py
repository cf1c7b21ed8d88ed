"""The experiment's headline metrics (manifest.json's "headline", from experiment_main) first in the runs table and
as a study's default outcome, never a throughput unless asked for; and ``runs --same``'s comparison of two
checkpoints' states, on made-up states (tests/e2e/test_same_runs.py compares real runs)."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_core.output.checkpoint_diff import first_difference
from ddp_core.runs import default_outcome, headline_metrics, main, read_run
from tests.unit.test_runs_table import CIFAR_METRICS, TOY_METRICS, make_run, manifest, rows, table_of

MSE_METRICS = {**TOY_METRICS, "eval_mse": 0.0123, "eval_samples": 1001}


def test_the_declared_headline_comes_first_in_the_runs_table(tmp_path, capsys):
    make_run(tmp_path, "mine/a", manifest("mine") | {"headline": ["eval_mse"]}, MSE_METRICS, steps=[20])
    make_run(tmp_path, "cifar10/b", manifest("cifar10") | {"headline": ["eval_accuracy", "eval_loss"]}, CIFAR_METRICS)
    table = rows(table_of(capsys, str(tmp_path)))
    assert table["mine/a"].split()[-3:] == ["eval_mse=0.0123", "final_loss=0.2999", "samples_per_s=11081"]
    assert "eval_accuracy=0.8123 eval_loss=0.61" in table["cifar10/b"]


def test_a_declared_metric_the_run_did_not_write_is_left_out():
    assert list(headline_metrics(TOY_METRICS, ["eval_mse"])) == ["final_loss", "samples_per_s"]
    assert list(headline_metrics(MSE_METRICS, ["eval_samples", "eval_mse", "final_loss", "wall_time_s"])) == [
        "eval_samples",
        "eval_mse",
        "final_loss",
        "wall_time_s",
    ]  # every declared one shown, even past the usual three


@pytest.mark.parametrize(
    "declared, metrics, outcome",
    [
        (["eval_mse"], MSE_METRICS, "eval_mse"),
        (["samples_per_s", "final_loss"], TOY_METRICS, "final_loss"),  # a throughput: never the default outcome
        (None, CIFAR_METRICS, "eval_accuracy"),  # a run from before headlines were declared
        (None, {"images_per_s": 3.0, "samples_per_s": 2.0}, None),
    ],
)
def test_a_studys_default_outcome_is_the_first_headline_metric_that_is_not_a_throughput(
    tmp_path, declared, metrics, outcome
):
    recorded = manifest() | ({"headline": declared} if declared is not None else {})
    run_dir = make_run(tmp_path, "toy/a", recorded, metrics)
    assert default_outcome(read_run(run_dir, "toy/a")) == outcome


def test_first_difference_names_the_path_and_the_largest_difference():
    a = {"net.weight": torch.zeros(2, 3), "net.bias": torch.ones(3)}
    b = {"net.weight": torch.zeros(2, 3), "net.bias": torch.tensor([1.0, 1.5, 0.75])}
    found = first_difference(a, b)
    assert found is not None and found.where == "net.bias"
    assert "2 of 3 elements differ, the largest by 0.5 (at [1]: 1 in A, 1.5 in B)" in found.what
    assert first_difference(a, {k: v.clone() for k, v in a.items()}) is None


@pytest.mark.parametrize(
    "a, b, where, what",
    [
        ({"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])}, "x", "1 of 1 elements differ"),  # equal, not bitwise
        ({"x": torch.tensor([math.nan])}, {"x": torch.tensor([1.0])}, "x", "the largest by inf"),
        ({"x": torch.zeros(2)}, {"x": torch.zeros(3)}, "x", "torch.float32 [2] in A, torch.float32 [3] in B"),
        ([{"step": 3}, {"step": 4}], [{"step": 3}, {"step": 5}], "[1].step", "4 in A, 5 in B"),
        ({"a": 1}, {"a": 1, "b": 2}, "b", "only in B"),
        ({"a": 1.0}, {"a": 1}, "a", "1.0 in A, 1 in B"),
    ],
)
def test_what_counts_as_a_difference(a, b, where, what):
    found = first_difference(a, b)
    assert found is not None and found.where == where and what in found.what


def test_nans_with_the_same_bits_are_the_same():
    assert first_difference({"x": torch.tensor([math.nan, 1.0])}, {"x": torch.tensor([math.nan, 1.0])}) is None
    assert first_difference({"x": math.nan}, {"x": math.nan}) is None


def test_same_refuses_a_run_without_a_checkpoint_in_one_line(tmp_path, capsys):
    make_run(tmp_path, "toy/a", manifest(), TOY_METRICS)
    make_run(tmp_path, "toy/b", manifest(), TOY_METRICS)
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--same", "toy/a", "toy/b"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "--same toy/a: the run has no checkpoint to compare" in err
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--same", "toy/a", "toy/nope"])
    assert stop.value.code == 2 and "--same toy/nope: no such run" in capsys.readouterr().err
