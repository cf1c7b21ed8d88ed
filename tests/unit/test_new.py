"""``python -m ddp_core.new NAME``: names it refuses, files it never overwrites, and what it writes.

Running the generated experiment (and the contract on it) is in tests/e2e/test_new_experiment.py.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_core import new
from ddp_core.config import parse_args
from ddp_core.contract_spec import ContractSpec
from ddp_core.errors import ConfigError
from ddp_core.experiment import TrainingArgs
from experiments import __main__ as listing

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name, why",
    [
        ("", "is empty"),
        ("1abc", "not a Python module name"),
        ("my-exp", "not a Python module name"),
        ("my exp", "not a Python module name"),
        ("café", "not a Python module name"),  # an identifier, but not ASCII: a file name that travels badly
        ("a" * (new.MAX_NAME_LENGTH + 1), f"at most {new.MAX_NAME_LENGTH}"),
        ("Mine", "lower case (e.g. mine)"),  # PEP 8; and Toy.py would collide with toy.py on macOS
        ("_helper", "starts with an underscore"),
        ("class", "keyword"),
        ("match", "keyword"),  # a soft keyword
        ("json", "standard-library module"),
        ("torch", "already an importable module"),
        ("ddp_core", "already an importable module"),
    ],
)
def test_bad_names_are_refused_with_one_line_and_nothing_written(tmp_path: Path, name: str, why: str):
    with pytest.raises(ConfigError) as error:
        new.create(name, tmp_path)
    message = str(error.value)
    assert why in message and f"NAME={name!r}" in message and "\n" not in message, message
    assert list(tmp_path.iterdir()) == []


def test_good_names(tmp_path: Path):
    for name in ("mine", "my_exp2", "a" * new.MAX_NAME_LENGTH):
        assert new.name_problem(name) is None, name
        assert new.create(name, tmp_path) == tmp_path / f"{name}.py"


@pytest.mark.parametrize("existing", ["toy", "cifar10_data"])  # an experiment, and a helper module
def test_an_existing_module_of_experiments_is_never_overwritten(existing: str):
    path = REPO / "experiments" / f"{existing}.py"
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=rf"experiments/{existing}\.py already exists: choose another NAME"):
        new.create(existing, new.experiments_folder())
    assert path.read_bytes() == before


def test_an_existing_file_or_package_in_dir_is_never_overwritten(tmp_path: Path):
    (tmp_path / "mine.py").write_text("# mine\n")
    (tmp_path / "pkg").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        new.create("mine", tmp_path)
    with pytest.raises(ConfigError, match="already exists"):
        new.create("pkg", tmp_path)
    assert (tmp_path / "mine.py").read_text() == "# mine\n" and not (tmp_path / "pkg.py").exists()


def test_the_default_folder_is_the_experiments_package():
    assert new.experiments_folder() == REPO / "experiments"


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_core.new", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("args", [("toy",), ("my-exp",), (), ("mine", "--no-such-flag")])
def test_the_command_line_refuses_with_one_line_and_exit_2(args: tuple[str, ...]):
    result = run_cli(*args)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr


def test_the_command_line_writes_the_file_and_prints_the_next_steps(tmp_path: Path):
    result = run_cli("mine", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "mine.py").read_text() == new.render("mine")
    out = result.stdout
    assert f"wrote {tmp_path / 'mine.py'}" in out and ">>> YOUR" in out
    assert f"PYTHONPATH={tmp_path} python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m mine" in out
    assert f"PYTHONPATH={tmp_path} python -m tools.contract mine" in out
    assert "make reference" not in out  # an experiment outside experiments/ is not in the reference
    assert new.DOCS in out and (REPO / new.DOCS).is_file()


def test_the_next_steps_for_the_experiments_folder():
    text = new.next_steps("mine", REPO / "experiments" / "mine.py", default_folder=True)
    assert "python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.mine " in text
    assert "python -m tools.contract experiments.mine " in text and "PYTHONPATH" not in text
    assert "make reference " in text  # the new experiment's flags in docs/reference.md, which test-quick checks


def test_make_without_name_is_one_line_and_exit_2():
    result = subprocess.run(
        ["make", "--no-print-directory", "new-experiment"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert "NAME is missing: make new-experiment NAME=mine" in result.stderr


# --------------------------------------------------------------------------------- the generated file


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("generated")
    return new.create("mine", folder)


def test_the_output_is_python_with_the_name_filled_in(generated: Path):
    source = generated.read_text()
    compile(source, str(generated), "exec")
    assert "$" not in source  # every placeholder filled, no $$ left half-escaped
    assert "-m experiments.mine" in source and 'main = experiment_main(\n    "mine",\n' in source
    for marker in (">>> YOUR DATA", ">>> YOUR MODEL", ">>> YOUR LOSS"):
        assert source.count(marker) == 1, marker


def test_it_is_listed_as_an_experiment(generated: Path):
    """python -m experiments (and the container's EXPERIMENT=NAME) take it: a main(), a description, a launch line."""
    found = listing.experiments(generated.parent)
    assert [e.name for e in found] == ["mine"]
    experiment = found[0]
    docstring = ast.get_docstring(ast.parse(generated.read_text()))
    assert experiment.description == docstring.splitlines()[0] and len(experiment.description) < 110
    assert experiment.launch == "python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m experiments.mine"
    for command in ("--stop-at-step 120", "--resume", "python -m tools.contract experiments.mine"):
        assert command in docstring


@pytest.fixture(scope="module")
def module(generated: Path):
    spec = importlib.util.spec_from_file_location("mine", generated)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules["mine"] = loaded  # dataclasses look their module up there
    try:
        spec.loader.exec_module(loaded)
        yield loaded
    finally:
        del sys.modules["mine"]


def test_what_it_declares(module, clean_env):
    args = parse_args(module.Args, [])
    assert isinstance(args, TrainingArgs) and not args.resume and args.stop_at_step == 0
    module.main.check(args)
    spec = module.CONTRACT
    assert isinstance(spec, ContractSpec) and spec.world_size_invariant and spec.batch_flag == "--batch-size"
    brief = parse_args(module.Args, [*spec.brief, "--stop-at-step", str(spec.stop_at_step)])
    module.main.check(brief)
    assert 0 < spec.stop_at_step < brief.steps
    assert brief.checkpoint_every and spec.stop_at_step % brief.checkpoint_every, "stop between two checkpoints"
    for world in (1, 2, 3):  # the stop falls mid-epoch at every world size the contract runs
        batch = spec.batch_size * (2 if world == 1 else 1)
        steps_per_epoch = -(-brief.dataset_size // world) // batch
        assert steps_per_epoch > 0 and spec.stop_at_step % steps_per_epoch, world
    long = parse_args(module.Args, list(spec.long))
    assert long.steps >= 10**5 and 0 < long.checkpoint_every <= 10
    for flags, match in (
        (["--warmup-steps", "400"], "--warmup-steps=400"),
        (["--stop-at-step", "301"], "--stop-at-step=301"),
    ):
        with pytest.raises(ConfigError, match=match):
            module.main.check(parse_args(module.Args, flags))


def test_its_contract_model_holds_the_trained_weights(module):
    """CONTRACT.model(config) is the plain model train() builds: the same state-dict keys and shapes."""
    config = {"hidden": 7}
    plain, built = module.CONTRACT.model(config), module.build_model(7)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in built.state_dict().items()}
    torch.manual_seed(0)
    assert module.CONTRACT.model(config)(torch.randn(3, module.FEATURES)).shape == (3, module.CLASSES)


def test_its_data_is_the_same_every_time_and_the_evaluation_set_does_not_depend_on_the_training_size(module):
    train_a, eval_a = module.make_data(64)
    train_b, eval_b = module.make_data(128)
    assert len(eval_a) == module.EVAL_SIZE and module.EVAL_SIZE % 2 and module.EVAL_SIZE % 3
    assert all(torch.equal(a, b) for a, b in zip(eval_a.tensors, eval_b.tensors))
    assert all(torch.equal(a, b) for a, b in zip(train_a.tensors, module.make_data(64)[0].tensors))
    labels = train_b.tensors[1]
    assert labels.min() >= 0 and labels.max() < module.CLASSES and len(labels.unique()) > module.CLASSES // 2


@pytest.mark.parametrize("name", ["lint_probe", "l" * new.MAX_NAME_LENGTH])
def test_the_generated_file_passes_the_repositorys_formatter_and_linter(tmp_path: Path, name: str):
    """A user's own experiment lands in experiments/, which `make lint` checks: it must pass as generated."""
    source = new.create(name, tmp_path)
    ruff = [sys.executable, "-m", "ruff", "--config", str(Path(new.__file__).parents[1] / "pyproject.toml")]
    for check in (["format", "--check", "--diff"], ["check"]):
        result = subprocess.run(
            [*ruff[:3], check[0], *ruff[3:], *check[1:], str(source)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
