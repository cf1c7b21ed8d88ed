"""ddp_core.experiment.TrainingRun, its Plan and its TrainingLoop in a world of one, in-process: what the loop does
at each step of a plan
(log, evaluate, checkpoint, stop, end), where a resumed loop starts, and that a non-finite loss stops the run
before anything is saved. The same rules at 2 to 4 processes: the contract runs (tests/e2e/test_contract.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from ddp_core.config import option, parse_args
from ddp_core.distributed.group import unwrap
from ddp_core.exit_codes import DIVERGED_EXIT_CODE
from ddp_core.experiment import TrainingArgs, TrainingRun, experiment_main
from ddp_core.lifecycle.loop import TrainingLoop
from ddp_core.lifecycle.plan import Plan
from ddp_core.training.comm import ddp_knobs_set
from tests.e2e.launch import LAUNCH_VARIABLES

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under pytest


@dataclass
class TinyArgs(TrainingArgs):
    steps: int = option(10, "optimizer steps", minimum=1)
    lr: float = option(0.1, "SGD learning rate", above=0)
    per_epoch: bool = option(False, "evaluate and checkpoint at each epoch's end")
    poison_at: int = option(0, "make the loss of this step infinite (0: never)", minimum=0)
    log_every: int = 3  # the shared cadence options, with this test's defaults
    checkpoint_every: int = 5
    eval_every: int = 4


EVENTS: list[tuple] = []


def no_metrics(step: int, writer: Any) -> dict[str, float]:
    return {}


def tiny_train(run: TrainingRun, args: TinyArgs) -> dict[str, float]:
    model = run.wrap(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    def evaluate(step: int, writer: Any) -> dict[str, float]:
        EVENTS.append(("eval", step))
        return {"loss": float(unwrap(model).weight.detach().sum())}

    plan = run.plan(
        total_steps=args.steps,
        steps_per_epoch=4,
        batch_size=1,
        evaluate=evaluate,
        per_epoch=args.per_epoch,
    )
    loop = plan.resume_or_start(model, optimizer)
    data = torch.randn(100, 1, 2, generator=torch.Generator().manual_seed(0))  # the same every epoch and every run
    for epoch, consumed in loop.epochs():
        EVENTS.append(("epoch", epoch, consumed))
        # A sampler's set_epoch(epoch, consumed=...) skips what the stopped run trained on; here a slice does
        # (one process, one sample per micro-batch: the samples consumed are the micro-batches done).
        for micro_batches in loop.steps(data[consumed:] + epoch):
            for inputs in micro_batches:
                loss = (model(inputs) - 1).pow(2).mean()
                loop.backward(loss * math.inf if loop.global_step + 1 == args.poison_at else loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if loop.step():
                break
    return loop.finish({"extra": 1})


main = experiment_main("tiny", TinyArgs, tiny_train, doc="A tiny run for the run object's tests.")


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    EVENTS.clear()


def steps_of(run_dir: Path, tag: str) -> list[int]:
    [events] = run_dir.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return [e.step for e in accumulator.Scalars(tag)]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))


def test_each_step_does_what_the_plan_says(tmp_path: Path):
    metrics = main(["--run-dir", str(tmp_path / "run"), "--keep-checkpoints", "0"])
    run_dir = tmp_path / "run"
    assert [e for e in EVENTS if e[0] == "epoch"] == [("epoch", 0, 0), ("epoch", 1, 0), ("epoch", 2, 0)]
    assert [e[1] for e in EVENTS if e[0] == "eval"] == [4, 8, 10]  # every 4 steps, and the end
    assert checkpoint_steps(run_dir) == [5, 10]  # every 5 steps, and the end
    assert steps_of(run_dir, "train/loss") == [3, 6, 9, 10]  # every 3, and the end: an evaluation or a save adds none
    assert steps_of(run_dir, "eval/loss") == [4, 8, 10]
    written = json.loads((run_dir / "metrics.json").read_text())
    assert written["steps"] == metrics["steps"] == 10 and written["extra"] == 1 and written["world_size"] == 1
    assert written["eval_loss"] == metrics["eval_loss"] and math.isfinite(written["final_loss"])
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 10


def test_a_stopped_run_resumes_mid_epoch_to_the_same_weights(tmp_path: Path):
    main(["--run-dir", str(tmp_path / "whole")])
    stopped = main(["--run-dir", str(tmp_path / "halves"), "--stop-at-step", "6"])
    assert stopped == {"steps": 6, "stopped_early": True} and not (tmp_path / "halves" / "metrics.json").exists()
    EVENTS.clear()
    main(["--run-dir", str(tmp_path / "halves"), "--resume"])
    assert [e for e in EVENTS if e[0] == "epoch"] == [
        ("epoch", 1, 2),
        ("epoch", 2, 0),
    ]  # step 6: epoch 1, its third batch
    whole, halves = (
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]
        for name in ("whole", "halves")
    )
    assert all(torch.equal(whole[key], halves[key]) for key in whole)


def test_per_epoch_with_accumulation_counts_micro_batches(tmp_path: Path):
    main(
        [
            "--run-dir",
            str(tmp_path / "run"),
            "--keep-checkpoints",
            "0",
            "--per-epoch",
            "--grad-accum",
            "3",
            "--steps",
            "8",
        ]
    )
    assert [e for e in EVENTS if e[0] == "epoch"] == [("epoch", 0, 0), ("epoch", 1, 0)]
    assert [e[1] for e in EVENTS if e[0] == "eval"] == [4, 8]  # each epoch's end (and every 4 steps: the same)
    assert checkpoint_steps(tmp_path / "run") == [4, 5, 8]
    assert steps_of(tmp_path / "run", "train/samples_per_s") == [4, 8]  # each epoch's throughput
    EVENTS.clear()
    main(
        [
            "--run-dir",
            str(tmp_path / "stopped"),
            "--per-epoch",
            "--grad-accum",
            "3",
            "--steps",
            "8",
            "--stop-at-step",
            "6",
        ]
    )
    main(["--run-dir", str(tmp_path / "stopped"), "--per-epoch", "--grad-accum", "3", "--steps", "8", "--resume"])
    assert ("epoch", 1, 6) in EVENTS  # step 6 = epoch 1 after 2 steps of 3 micro-batches
    whole, halves = (
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]
        for name in ("run", "stopped")
    )
    assert all(torch.equal(whole[key], halves[key]) for key in whole)  # the accumulation resumes bitwise


def test_a_non_finite_loss_stops_the_run_before_it_is_saved(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--run-dir", str(tmp_path / "run"), "--poison-at", "2"])
    assert stopped.value.code == DIVERGED_EXIT_CODE
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the training loss became") and "at step 2" in line and "stopped at step 3" in line
    assert checkpoint_steps(tmp_path / "run") == [] and not (tmp_path / "run" / "metrics.json").exists()


def test_the_phases_are_types_and_a_run_starts_once(tmp_path: Path):
    """plan() returns the Plan, the Plan's resume_or_start the loop: a loop call before the start does not exist."""
    seen = {}

    def phases(run: TrainingRun, args: TinyArgs) -> dict:
        model = run.wrap(nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        plan = run.plan(total_steps=2, batch_size=1, evaluate=no_metrics)
        seen["before"] = [hasattr(run, name) for name in ("epochs", "steps", "step", "finish", "resume_or_start")]
        loop = plan.resume_or_start(model, optimizer)
        seen["types"] = (type(plan), type(loop), run.loop is loop, loop.optimizer is optimizer)
        with pytest.raises(RuntimeError) as twice:
            plan.resume_or_start(model, optimizer)
        seen["twice"] = str(twice.value)
        return {}

    experiment_main("tiny", TinyArgs, phases, doc="x")(["--run-dir", str(tmp_path / "run")])
    assert seen["before"] == [False] * 5 and seen["types"] == (Plan, TrainingLoop, True, True)
    assert "once" in seen["twice"] and "\n" not in seen["twice"]


@dataclass
class Scored:
    """An evaluation's own result object: the run logs its metrics and keeps the object."""

    score: float

    def as_metrics(self) -> dict[str, float]:
        return {"score": self.score}


def fit_ones(loop: TrainingLoop, model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    """The loop's steps over ``batches``, the model fitted to output 1."""
    for micro_batches in loop.steps(batches):
        for inputs in micro_batches:
            loop.backward((model(inputs) - 1).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if loop.step():
            break


def stream_train(run: TrainingRun, args: TinyArgs) -> dict[str, float]:
    """A run counted in steps: one stream of batches, no epochs (as a language model drawing random windows)."""
    model = run.wrap(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    plan = run.plan(total_steps=args.steps, batch_size=1, evaluate=lambda step, writer: Scored(float(step)))
    loop = plan.resume_or_start(model, optimizer)

    def draws():  # from the global stream the run seeds and checkpoints
        while True:
            yield torch.randn(1, 2)

    fit_ones(loop, model, optimizer, draws())
    assert isinstance(loop.last_evaluation, Scored)
    return loop.finish(lambda: {"last_score": loop.last_evaluation.score})


def test_a_run_counted_in_steps_needs_no_epochs_and_keeps_its_evaluations_result(tmp_path: Path):
    stream = experiment_main("stream", TinyArgs, stream_train, doc="A run without epochs.")  # eval every 4
    metrics = stream(["--run-dir", str(tmp_path / "whole")])
    assert metrics["steps"] == 10 and metrics["eval_score"] == 10.0 and metrics["last_score"] == 10.0
    assert steps_of(tmp_path / "whole", "eval/score") == [4, 8, 10]
    assert checkpoint_steps(tmp_path / "whole")[-1] == 10
    assert stream(["--run-dir", str(tmp_path / "halves"), "--stop-at-step", "5"])["stopped_early"]
    assert stream(["--run-dir", str(tmp_path / "halves"), "--resume"])["steps"] == 10
    whole, halves = (
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)["model"]
        for name in ("whole", "halves")
    )
    assert all(torch.equal(whole[key], halves[key]) for key in whole)  # the stream resumes where it stopped


def test_the_plan_takes_the_epoch_and_the_batch_from_the_loader_or_asks_for_the_batch(tmp_path: Path):
    seen = {}

    def planned(run: TrainingRun, args: TinyArgs) -> dict:
        loader = torch.utils.data.DataLoader(torch.zeros(10, 2), batch_size=3, drop_last=True)
        seen["plan"] = run.plan(loader, total_steps=4, evaluate=no_metrics)
        seen["epochs"] = run.plan(loader, epochs=3, evaluate=no_metrics)
        with pytest.raises(TypeError, match="batch_size="):
            run.plan(total_steps=4)  # a stream of batches: the batch per process must be said
        return {}

    experiment_main("tiny", TinyArgs, planned, doc="x")(["--run-dir", str(tmp_path / "run")])
    assert (seen["plan"].steps_per_epoch, seen["plan"].samples_per_step) == (3, 3)  # 10 // 3 batches of 3
    assert seen["epochs"].total_steps == 9 and seen["epochs"].scaled_lr(0.5, reference_batch=6) == 0.25


def test_eval_every_on_an_experiment_without_evaluation_is_one_line(tmp_path: Path, capsys):
    from experiments import toy

    with pytest.raises(SystemExit) as exited:
        toy.main(["--run-dir", str(tmp_path / "run"), "--eval-every", "5", "--steps", "2"])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == "error: --eval-every=5: this experiment has no evaluation; drop the flag"


@pytest.mark.parametrize(
    "flags, ddp",
    [
        ([], False),
        (["--powersgd-rank", "4", "--zero"], False),  # options of a hook that is not used, and ZeRO: no DDP knob
        (["--comm-hook", "fp16"], True),
        (["--bucket-cap-mb", "10"], True),
        (["--static-graph"], True),
        (["--gradient-as-bucket-view"], True),
    ],
)
def test_a_ddp_knob_away_from_its_default_asks_for_ddp(flags: list[str], ddp: bool):
    assert ddp_knobs_set(parse_args(TinyArgs, flags)) is ddp


@pytest.mark.parametrize(
    "flags, ddp", [(["--grad-accum", "2"], False), (["--bucket-cap-mb", "1", "--grad-accum", "2"], True)]
)
def test_a_world_of_one_trains_without_ddp_unless_a_ddp_knob_asks_for_it(tmp_path: Path, flags: list[str], ddp: bool):
    """DDP at a world of one all-reduces with nobody, and its hooks and the step timer's (a Python call per
    parameter per backward) cost 11% of an eager ResNet-18 step on one GPU: the model trains as it is (and
    --grad-accum needs no no_sync)."""
    seen = {}

    def wrapped(run: TrainingRun, args: TinyArgs) -> dict:
        model = run.wrap(nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        loop = run.plan(total_steps=4, batch_size=1, evaluate=no_metrics).resume_or_start(model, optimizer)
        seen["ddp"] = isinstance(model, nn.parallel.DistributedDataParallel)
        seen["timer hooks"] = len(loop.timer._handles)
        fit_ones(loop, model, optimizer, torch.randn(8, 1, 2))
        return loop.finish()

    metrics = experiment_main("tiny", TinyArgs, wrapped, doc="x")(["--run-dir", str(tmp_path / "run"), *flags])
    assert seen == {"ddp": ddp, "timer hooks": 2 if ddp else 0} and metrics["steps"] == 4
    assert (metrics["comm_bytes_per_step"] > 0) is ddp  # without DDP nothing is sent
