"""``python -m experiments`` lists every experiment with its description and launch command."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.entrypoint import _is_experiment
from experiments import __main__ as listing

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["charlm", "cifar10", "collectives", "commbench", "preflight", "toy"]
TRAINING = ["charlm", "cifar10", "toy"]
HELPERS = ["cifar10_data", "cifar10_models", "preflight_checks"]


@pytest.fixture(scope="module")
def printed() -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "experiments"], cwd=REPO, capture_output=True, text=True, timeout=60)
    return result, time.perf_counter() - started


def test_every_experiment_and_no_helper_is_listed():
    assert [e.name for e in listing.experiments()] == EXPERIMENTS
    assert [e.name for e in listing.experiments() if e.trains] == TRAINING  # listed apart from the tools


def test_the_same_rule_as_the_container_entrypoint():
    """EXPERIMENT=NAME works exactly for the listed names."""
    modules = sorted(path.stem for path in (REPO / "experiments").glob("*.py"))
    assert [name for name in modules if _is_experiment(name)] == EXPERIMENTS
    assert set(HELPERS) <= set(modules)


def test_description_and_launch_come_from_the_docstring():
    for experiment in listing.experiments():
        source = (REPO / "experiments" / f"{experiment.name}.py").read_text()
        docstring = ast.get_docstring(ast.parse(source))
        assert experiment.description == docstring.splitlines()[0].strip()
        assert experiment.launch.startswith("torchrun "), experiment.launch
        assert f"-m experiments.{experiment.name}" in experiment.launch, experiment.launch
        assert "#" not in experiment.launch and experiment.launch in docstring


def test_output_format(printed):
    result, _ = printed
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert "python -m experiments.NAME --help" in lines[0] and lines[1] == ""
    tools = [name for name in EXPERIMENTS if name not in TRAINING]
    assert lines[2].startswith("Training experiments") and lines[3 + 2 * len(TRAINING) + 1].startswith("Tools")
    body = lines[3 : 3 + 2 * len(TRAINING)] + lines[3 + 2 * len(TRAINING) + 2 :]
    assert len(body) == 2 * len(EXPERIMENTS)
    width = max(map(len, EXPERIMENTS))
    for index, name in enumerate(TRAINING + tools):
        described, launched = body[2 * index], body[2 * index + 1]
        assert described.startswith(f"  {name:<{width}}  ") and len(described) > width + 4
        assert launched == " " * (width + 4) + launched.strip()
        assert launched.strip().startswith("torchrun ") and f"-m experiments.{name}" in launched
    for helper in HELPERS:
        assert helper not in result.stdout
    assert (
        "toy  " in result.stdout
        and "torchrun --standalone --nproc-per-node=2 -m experiments.toy" in body[2 * len(TRAINING) - 1]
    )


def test_runs_fast_without_importing_torch(printed):
    result, elapsed = printed
    assert elapsed < 5, f"{elapsed:.1f} s"  # import torch alone takes about 2 s
    code = "import sys; from experiments.__main__ import experiments; experiments(); print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr


def test_arguments_are_refused_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "experiments", "toy"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
