"""``python -m experiments`` lists every experiment with its description and launch command, by declared kind."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.entrypoint import available_experiments
from ddp_core.experiment_files import declared_kind
from experiments import __main__ as listing

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["charlm", "cifar10", "collectives", "commbench", "preflight", "toy"]
TRAINING = ["charlm", "cifar10", "toy"]
DEMOS = ["collectives"]
TOOLS = ["commbench", "preflight"]  # aliases of tools/: the code lives there
HELPERS = ["cifar10_data", "cifar10_models"]
DEFAULT_LAUNCH = "python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.{}"


@pytest.fixture(scope="module")
def printed() -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "experiments"], cwd=REPO, capture_output=True, text=True, timeout=60)
    return result, time.perf_counter() - started


def test_every_experiment_and_no_helper_is_listed():
    assert [e.name for e in listing.experiments()] == EXPERIMENTS
    assert [e.name for e in listing.experiments() if e.trains] == TRAINING  # listed apart from the tools
    kinds = {e.name: e.kind for e in listing.experiments()}
    assert [name for name in EXPERIMENTS if kinds[name] == "demo"] == DEMOS
    assert [name for name in EXPERIMENTS if kinds[name] == "tool"] == TOOLS


@pytest.mark.parametrize(
    "source, kind",
    [
        ('KIND = "tool"\nfrom tools.commbench import main\n', "tool"),
        ('KIND = "demo"\n\ndef main():\n    pass\n', "demo"),
        ('main = experiment_main("x", Args, train)\n', "training"),
        ('KIND = "training"\n', "training"),
        ("def main():\n    pass\n", None),  # a main alone declares nothing
        ("# KIND = 'tool'\nmain = experiment_main\n", None),  # a comment, and no call: no regex is fooled
        ('def f():\n    KIND = "tool"\n', None),  # only the module's top level counts
        ('KIND = "trainer"\n', None),  # not a kind
        ("def (:\n", None),  # not Python
    ],
)
def test_the_kind_is_declared_at_the_top_level(source: str, kind: str | None):
    assert declared_kind(source) == kind


def test_the_tool_aliases_run_the_tools_own_main():
    import importlib

    import experiments.commbench
    import experiments.preflight
    import tools.commbench
    import tools.preflight.main

    assert importlib.import_module(experiments.preflight.TOOL).main is tools.preflight.main.main
    assert importlib.import_module(experiments.commbench.TOOL).main is tools.commbench.main


def test_the_same_rule_as_the_container_entrypoint():
    """EXPERIMENT=NAME works exactly for the listed names."""
    modules = sorted(path.stem for path in (REPO / "experiments").glob("*.py"))
    assert [name for name in modules if name in available_experiments()] == EXPERIMENTS
    assert set(HELPERS) <= set(modules)


def test_description_and_launch_come_from_the_docstring():
    """The tools' aliases have a one-line docstring (where the tool lives): the plain launch line."""
    for experiment in listing.experiments():
        source = (REPO / "experiments" / f"{experiment.name}.py").read_text()
        docstring = ast.get_docstring(ast.parse(source))
        assert experiment.description == docstring.splitlines()[0].strip()
        assert experiment.launch.startswith("python -m ddp_core.torchrun "), experiment.launch
        assert f"-m experiments.{experiment.name}" in experiment.launch, experiment.launch
        assert "#" not in experiment.launch
        if experiment.name in TOOLS:
            assert experiment.launch == DEFAULT_LAUNCH.format(experiment.name) and "tools/" in docstring
        else:
            assert experiment.launch in docstring


def test_output_format(printed):
    result, _ = printed
    assert result.returncode == 0 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert "python -m experiments.NAME --help" in lines[0] and lines[1] == ""
    titles = [index for index, line in enumerate(lines) if line and not line.startswith(" ")][1:]
    assert [lines[i].split(" (")[0] for i in titles] == ["Training experiments", "Demos", "Tools"]
    assert [lines[i - 1] for i in titles[1:]] == ["", ""]  # a blank line before each group but the first
    body = [line for line in lines[3:] if line.startswith(" ")]
    assert titles[0] == 2 and len(body) == 2 * len(EXPERIMENTS) == len(lines) - 3 - 2 * 2
    width = max(map(len, EXPERIMENTS))
    for index, name in enumerate(TRAINING + DEMOS + TOOLS):
        described, launched = body[2 * index], body[2 * index + 1]
        assert described.startswith(f"  {name:<{width}}  ") and len(described) > width + 4
        assert launched == " " * (width + 4) + launched.strip()
        assert launched.strip().startswith("python -m ddp_core.torchrun ") and f"-m experiments.{name}" in launched
    for helper in HELPERS:
        assert helper not in result.stdout
    assert (
        "toy  " in result.stdout
        and "python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.toy"
        in body[2 * len(TRAINING) - 1]
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


# Imports flow one way: bench -> experiments -> tools -> ddp_core. The one exception, inside a function:
# preflight's --dataset cifar10 check reads the data with the experiment's own reader.
LAYERS = ["ddp_core", "tools", "experiments", "bench"]
ALLOWED_UPWARD = {("tools/preflight/probes.py", "experiments")}


def test_imports_flow_one_way():
    upward = set()
    for lower, package in enumerate(LAYERS[:-1]):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in LAYERS and LAYERS.index(top) > lower:
                        upward.add((path.relative_to(REPO).as_posix(), top))
    assert upward == ALLOWED_UPWARD
