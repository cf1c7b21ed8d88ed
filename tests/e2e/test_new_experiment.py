"""The experiment ``python -m ddp_core.new`` writes passes ``python -m tools.contract`` as written.

The file is generated into a temporary folder (``--dir``) and run from there (``PYTHONPATH``, module
``mine``), so experiments/ stays as it is. The contract's own runs (kept with ``--keep``) are also what
the run-directory test reads: its 2-process torchrun run, rather than one more launch of the same run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_core import new
from tests import prefork
from tests.e2e.launch import REPO, clean_env
from tools.contract import PROPERTIES

NAME = "mine"


@pytest.fixture(scope="module")
def contract(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    folder = tmp_path_factory.mktemp("new_experiment")
    source = new.create(NAME, folder)
    keep = folder / "contract"
    result = subprocess.run(
        [prefork.python(), "-m", "tools.contract", NAME, "--keep", str(keep)],
        cwd=REPO,
        env=clean_env(PYTHONPATH=str(folder)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return result, source, keep


def test_the_generated_experiment_passes_the_whole_contract(contract):
    result, _, _ = contract
    verdicts = {
        line.split()[1]: line.split()[0]
        for line in result.stdout.splitlines()
        if line.startswith(("PASS", "FAIL", "SKIP"))
    }
    assert verdicts == {name: "PASS" for name in PROPERTIES}, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0


def test_two_processes_write_the_run_directory(contract):
    """The contract's 2-process run: what the template adds beyond the contract (exact evaluation, its
    TensorBoard tags)."""
    _, source, keep = contract
    run_dir = keep / "runs" / "two"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["experiment"] == NAME and manifest["world"]["world_size"] == 2
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["eval_samples"] == 1001  # every evaluation sample once: no padded duplicate, none dropped
    assert metrics["steps"] == 14 and 0 < metrics["eval_accuracy"] <= 1
    assert metrics["eval_ema_samples"] == 1001 and 0 < metrics["eval_ema_accuracy"] <= 1  # the tracked average's

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/loss", "eval/accuracy", "eval/ema_accuracy"} <= tags, tags
    assert [e.step for e in events.Scalars("eval/accuracy")] == [7, 14]  # --eval-every 7, and the end
    losses = [e.value for e in events.Scalars("eval/loss")]  # 7 and 14 (train/loss: every 20 steps, and the end)
    assert losses[-1] < losses[0], losses  # it learns

    spec = importlib.util.spec_from_file_location(NAME, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        model = module.CONTRACT.model(manifest["config"])
    finally:
        del sys.modules[NAME]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    assert checkpoint["step"] == 14 and checkpoint["world_size"] == 2
    assert checkpoint["ema"]["updates"] == 14 and checkpoint["ema"]["weights"].keys() == checkpoint["model"].keys()
