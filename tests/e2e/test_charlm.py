"""experiments.charlm, the run object's second domain: 300 steps at 2 CPU processes learn clearly, and
TensorBoard holds the curves and a sample of generated text. (Resume, SIGTERM and rank-0 writing:
test_contract.py runs the contract on it.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.launch import torchrun


def test_300_steps_at_two_processes_learn_clearly(tmp_path: Path):
    run_dir = tmp_path / "run"
    torchrun(2, "experiments.charlm", "--run-dir", str(run_dir), "--steps", "300", timeout=600)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 300 and metrics["world_size"] == 2 and metrics["global_batch_size"] == 32
    assert metrics["uniform_loss"] == math.log(metrics["vocabulary"])  # what an untrained model scores
    assert metrics["eval_loss"] < 0.5 * metrics["uniform_loss"], metrics  # nats per held-out character

    [events] = run_dir.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("eval/loss")] == [100, 200, 300]
    assert (
        accumulator.Scalars("eval/loss")[-1].value == metrics["eval_loss"]
        or abs(accumulator.Scalars("eval/loss")[-1].value - metrics["eval_loss"]) < 1e-6
    )
    assert [e.step for e in accumulator.Scalars("train/loss")] == list(range(20, 301, 20))
    samples = [tag for tag in accumulator.Tags()["tensors"] if tag.startswith("eval/sample")]
    assert samples, accumulator.Tags()
    last = accumulator.Tensors(samples[0])[-1]
    text = last.tensor_proto.string_val[0].decode()
    assert last.step == 300 and len(text) >= 100 and " the " in text  # it writes the corpus's words
