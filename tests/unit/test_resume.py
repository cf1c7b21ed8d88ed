"""A resume's options: the checkpoint's, but those a flag or a variable set (ddp_core/output/resume.py), and a
finished run answered without running. The checkpoints here are headers alone, as written_by reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddp_core.config import config_changes, given_options, parse_args
from ddp_core.output.resume import answered_finished, resumed_args
from experiments.toy import ToyArgs

WRITTEN = {**ToyArgs(steps=120, lr=0.1, nproc=2, stop_at_step=50, log_every=5).__dict__}


def stopped_run(run_dir: Path, config: dict = WRITTEN, world_size: int = 2, experiment: str = "toy") -> Path:
    path = run_dir / "checkpoints" / "step_00000050.pt"
    path.parent.mkdir(parents=True)
    torch.save(
        {"format": "ddp-lab/3", "step": 50, "world_size": world_size, "experiment": experiment, "config": config}, path
    )
    return path


def test_parse_args_records_what_a_flag_or_a_variable_set_and_a_change_names_it(clean_env):
    clean_env.setenv("SEED", "3")
    args = parse_args(ToyArgs, ["--steps", "7", "--no-deterministic"])
    assert given_options(args) == {"steps": "--steps", "deterministic": "--deterministic", "seed": "SEED"}
    assert given_options(ToyArgs()) is None  # built in code: every option counts
    assert set(config_changes({"steps": 5, "seed": 0, "lr": 0.2}, args)) == {"--steps: 5 -> 7", "SEED: 0 -> 3"}


def test_a_resume_takes_the_checkpoints_options_but_those_set_and_its_world_as_nproc(clean_env, tmp_path):
    stopped_run(tmp_path / "run")
    args = parse_args(ToyArgs, ["--resume", "--run-dir", str(tmp_path / "run"), "--lr", "0.5"])
    resumed = resumed_args("toy", args)
    assert (resumed.steps, resumed.lr, resumed.nproc) == (120, 0.5, 2)  # the lr set: start_run compares it
    assert (resumed.stop_at_step, resumed.log_every) == (0, ToyArgs().log_every)  # this launch's: no computation
    assert config_changes(WRITTEN, resumed) == ["--lr: 0.1 -> 0.5"]
    assert resumed_args("cifar10", args) is args  # another experiment's: start_run refuses it
    clean_env.setenv("RANK", "0")  # under a launcher, which makes the world
    assert resumed_args("toy", args).nproc == 1
    assert resumed_args("toy", parse_args(ToyArgs, ["--run-dir", str(tmp_path / "run")])).steps == ToyArgs().steps


def test_a_finished_run_is_answered_unless_an_option_changes_it(clean_env, tmp_path, capsys):
    stopped_run(tmp_path / "run")
    args = parse_args(ToyArgs, ["--resume", "--run-dir", str(tmp_path / "run")])
    assert not answered_finished(resumed_args("toy", args))  # stopped: it continues
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"steps": 120}))
    assert answered_finished(resumed_args("toy", args))
    assert capsys.readouterr().out.count("has finished") == 1
    longer = parse_args(ToyArgs, ["--resume", "--run-dir", str(tmp_path / "run"), "--steps", "200"])
    assert not answered_finished(resumed_args("toy", longer))  # refused, or trained longer with --allow-config-change


@pytest.mark.parametrize("config", [None, {}])
def test_a_checkpoint_without_a_config_leaves_the_options_as_given(clean_env, tmp_path, config):
    stopped_run(tmp_path / "run", config=config)
    args = parse_args(ToyArgs, ["--resume", "--run-dir", str(tmp_path / "run")])
    assert resumed_args("toy", args) is args


def test_a_finished_run_on_several_nodes_is_left_to_rank_0(clean_env, tmp_path, capsys):
    """A node without the run directory would not answer and wait for the others: the job decides together."""
    stopped_run(tmp_path / "run")
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"steps": 120}))
    args = resumed_args("toy", parse_args(ToyArgs, ["--resume", "--run-dir", str(tmp_path / "run")]))
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_WORLD_SIZE", "1")
    assert not answered_finished(args) and capsys.readouterr().out == ""
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")  # one node of two processes
    assert answered_finished(args)
