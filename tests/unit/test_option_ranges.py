"""Every flag and every environment variable works or is refused with one line, in-process.

``SPECS`` writes out what each option of each experiment accepts, independently of the declarations in
the code; ``test_every_option_has_a_spec`` makes a new option need an entry. Each option is fed the bad
values a user types (empty, negative, zero, huge 2**70, non-numeric, nan, inf, 1e400, a file where a
directory is expected, a path under a file, a missing path, a read-only directory) as a flag and, where
it has one, as its environment variable, through ``parse_args`` and the experiment's ``validate``: a
value is accepted exactly when the spec says so, and a refusal is a ConfigError of one line naming the
flag or variable, the value, and what it accepts. Nothing else may escape. Hypothesis then checks the
boundaries of every numeric option with arbitrary integers, floats and text. The launch variables
(ddp_core/distributed/env.py) and the container entrypoint's (ddp_core/entrypoint.py) get the same treatment.

The real processes (exit code 2, one stderr line, no traceback, time) are in tests/e2e/test_bad_input_exits.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_core.config import CommonArgs, options, parse_args
from ddp_core.distributed.env import DistEnv
from ddp_core.entrypoint import torchrun_command
from ddp_core.errors import ConfigError
from experiments import cifar10, collectives, toy
from experiments.collectives import DEMOS

I64 = 2**63 - 1
HUGE = str(2**70)
# What a user may type for any option; each spec decides which of these it accepts.
TYPED = [
    "",
    " ",
    "abc",
    "-1",
    "-5",
    "0",
    "1",
    "1.5",
    "0.5",
    "-0.5",
    HUGE,
    "-" + HUGE,
    "nan",
    "inf",
    "-inf",
    "1e400",
    "1e3",
    "0x10",
    "1_000",
    "+7",
]
FAST = settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------------------------------ the specs


@dataclass(frozen=True)
class Int:
    lo: int
    hi: int = I64
    words: str = "an integer in"

    def accepts(self, raw: str) -> bool:
        try:
            value = int(raw)
        except ValueError:
            return False
        return self.lo <= value <= self.hi

    def range_words(self) -> str:
        return self.words


@dataclass(frozen=True)
class Float:
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    words: str = "number"

    def accepts(self, raw: str) -> bool:
        try:
            value = float(raw)
        except ValueError:
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return math.isfinite(value) and above and below

    def range_words(self) -> str:
        return self.words


@dataclass(frozen=True)
class Choice:
    names: tuple[str, ...]

    def accepts(self, raw: str) -> bool:
        return raw in self.names

    def range_words(self) -> str:
        return self.names[-1]  # the message lists them all


@dataclass(frozen=True)
class Flag:
    """A boolean: a flag without a value; as a variable 1/0, true/false, yes/no, on/off."""

    def accepts(self, raw: str) -> bool:
        return raw.strip().lower() in {"1", "true", "yes", "on", "0", "false", "no", "off", ""}

    def range_words(self) -> str:
        return "boolean"


@dataclass(frozen=True)
class Text:
    """A string checked by ``good``; paths are tested separately with real files and directories."""

    good: Callable[[str], bool]
    words: str
    path: bool = False

    def accepts(self, raw: str) -> bool:
        return self.good(raw)

    def range_words(self) -> str:
        return self.words


def _init_method(raw: str) -> bool:
    if raw == "env://" or (raw.startswith("file://") and len(raw) > len("file://")):
        return True
    host, _, port = raw.removeprefix("tcp://").rpartition(":")
    return raw.startswith("tcp://") and bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def _window(raw: str) -> bool:
    first, colon, steps = raw.partition(":")
    return raw == "" or (
        colon == ":" and all(part.isascii() and part.isdigit() and int(part) >= 1 for part in (first, steps))
    )


COMMON = {
    "run_dir": Text(lambda raw: True, "directory", path=True),  # any name is a directory rank 0 can create
    "seed": Int(0, 2**64 - 1),
    "deterministic": Flag(),
    "backend": Choice(("auto", "nccl", "gloo")),
    "dist_timeout_s": Float(0, 365 * 24 * 3600, lo_open=True),
    "dist_init_timeout_s": Float(0, 365 * 24 * 3600, lo_open=True),
    "init_method": Text(_init_method, "tcp://HOST:PORT"),
    "nproc": Int(1, 1024),
}
CHECKPOINTS = {  # ddp_core.experiment.TrainingArgs (several checkpoints)
    "keep_checkpoints": Int(0, words="must be"),
    "resume_from": Text(lambda raw: raw == "", "", path=True),  # only real checkpoint files load
    "allow_config_change": Flag(),
    "checkpoint_async": Flag(),
    "checkpoint_writer": Choice(("auto", "thread", "process")),
    "check_replicas_every": Int(0),
    "checkpoint_every": Int(0),
    "eval_every": Int(0),
    "log_every": Int(0),
    "log_reads": Choice(("auto", "late", "now")),
    "comm_hook": Choice(("none", "fp16", "bf16", "powersgd")),
    "powersgd_rank": Int(1, 1024),
    "powersgd_start_step": Int(2, 2**31),
    "zero": Flag(),
    "bucket_cap_mb": Float(0, 2**20, lo_open=True),
    "static_graph": Flag(),
    "gradient_as_bucket_view": Flag(),
    "grad_accum": Int(1),
    "profile": Text(_window, "START:STEPS"),
}
SPECS: dict[type, dict[str, Any]] = {
    toy.ToyArgs: {
        **COMMON,
        **CHECKPOINTS,
        "steps": Int(1),
        "batch_size": Int(1, 4096),  # at most --dataset-size (4096 by default)
        "lr": Float(0, lo_open=True),
        "resume": Flag(),
        "stop_at_step": Int(0, 200, words="must be"),  # at most --steps (200 by default)
        "dataset_size": Int(32, 10**7, words="must be"),  # at least --batch-size (32 by default)
    },
    cifar10.Cifar10Args: {
        **COMMON,
        **CHECKPOINTS,
        "model": Choice(("resnet18", "small")),
        "epochs": Int(1),
        "batch_size": Int(1),
        "lr": Float(0, lo_open=True),
        "momentum": Float(0, 1, lo_open=True, hi_open=True),
        "weight_decay": Float(0),
        "label_smoothing": Float(0, 1, hi_open=True),
        "schedule": Choice(("onecycle", "cosine")),
        "warmup_epochs": Float(0, 10, words="must be"),  # at most --epochs (10)
        "sync_bn": Flag(),
        "sync_bn_impl": Choice(("auto", "global", "torch")),
        "amp": Flag(),
        "amp_dtype": Choice(("auto", "bf16", "fp16")),
        "compile": Flag(),
        "cuda_graphs": Flag(),
        "data_dir": Text(lambda raw: True, "directory", path=True),
        "download": Flag(),
        "verify": Flag(),
        "loader": Choice(("tensor", "torchvision")),
        "num_workers": Int(0, 256),
        "eval_batch_size": Int(1),
        "ema": Float(0, 1, hi_open=True),
        "resume": Flag(),
        "stop_at_step": Int(0),
    },
    collectives.CollectivesArgs: {**COMMON, "demo": Choice(("all", *DEMOS)), "list": Flag()},
}
VALIDATE: dict[type, Callable[[Any], None]] = {
    toy.ToyArgs: toy.main.check,
    cifar10.Cifar10Args: cifar10.main.check,
    collectives.CollectivesArgs: lambda args: None,  # its main checks nothing beyond the declarations
}
CASES = [pytest.param(cls, f.name, id=f"{cls.__name__}-{f.name}") for cls in SPECS for f in dataclasses.fields(cls)]


# paths (--run-dir, --data-dir, --resume-from) get real files and directories below, not TYPED
TYPED_CASES = [case for case in CASES if not getattr(SPECS[case.values[0]][case.values[1]], "path", False)]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(cls: type, name: str) -> str | None:
    return {f.name: f.metadata.get("env") for f in options(cls)}[name]


@pytest.fixture
def env(clean_env, tmp_path):
    """clean_env, plus a DATA_DIR that holds an (empty) cifar-10-batches-py/: enough for cifar10.validate."""
    data = tmp_path / "data"
    (data / "cifar-10-batches-py").mkdir(parents=True)
    clean_env.setenv("DATA_DIR", str(data))
    return clean_env


def outcome(cls: type, argv: list[str]) -> ConfigError | None:
    """None when ``argv`` (and the environment) is accepted by parse_args and validate; else the ConfigError.

    Anything but a ConfigError fails the test: that would be a traceback for the user.
    """
    try:
        args = parse_args(cls, argv)
        VALIDATE[cls](args)
    except ConfigError as error:
        return error
    return None


def _parsed_forms(raw: str) -> list[str]:
    forms = []
    for kind in (int, float):
        try:
            forms.append(str(kind(raw)))
        except ValueError:
            pass
    return forms


def assert_one_line(error: ConfigError, name: str, raw: str, range_words: str = "") -> None:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    assert name in message, f"{name} not named in {message!r}"
    shown = raw if len(raw) <= 80 else raw[:80]
    forms = {shown, repr(shown), *_parsed_forms(raw)}  # a cross-field message shows the parsed value (+7 as 7)
    assert any(form in message for form in forms), f"value {raw!r} not shown in {message!r}"
    assert range_words in message, f"the range ({range_words!r}) not said in {message!r}"


# ------------------------------------------------------------------------------------------- the table


def test_every_option_has_a_spec():
    for cls, spec in SPECS.items():
        assert {f.name for f in dataclasses.fields(cls)} == set(spec), f"{cls.__name__}: add the new options to SPECS"


@pytest.mark.parametrize("cls, name", TYPED_CASES)
def test_typed_values_as_a_flag(env, cls, name):
    spec = SPECS[cls][name]
    if isinstance(spec, Flag):  # a boolean flag takes no value: --resume=yes is refused, naming it
        error = outcome(cls, [f"{flag(name)}=yes"])
        assert error is not None and flag(name) in str(error) and "\n" not in str(error)
        return
    for raw in TYPED:
        error = outcome(cls, [f"{flag(name)}={raw}"])
        if spec.accepts(raw):
            assert error is None, f"{flag(name)}={raw!r} refused: {error}"
        else:
            assert error is not None, f"{flag(name)}={raw!r} accepted; it must be refused"
            assert_one_line(error, flag(name), raw, spec.range_words())


@pytest.mark.parametrize("cls, name", [case for case in TYPED_CASES if env_name(*case.values)])
def test_typed_values_as_a_variable(env, cls, name):
    spec, variable = SPECS[cls][name], env_name(cls, name)
    for raw in TYPED:
        env.setenv(variable, raw)
        error = outcome(cls, [])
        if raw.strip() == "" or spec.accepts(raw):  # an empty variable is an unset one: the default
            assert error is None, f"{variable}={raw!r} refused: {error}"
        else:
            assert error is not None, f"{variable}={raw!r} accepted; it must be refused"
            assert_one_line(error, variable, raw, spec.range_words())


# ------------------------------------------------------------------------------------------ the paths


@pytest.fixture
def places(tmp_path) -> dict[str, Path]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    (tmp_path / "a-dir").mkdir()
    return {
        "file": a_file,
        "under a file": a_file / "run",
        "missing": tmp_path / "missing" / "deeper",
        "dir": tmp_path / "a-dir",
    }


@pytest.mark.parametrize("source", ["flag", "variable"])
@pytest.mark.parametrize("cls", list(SPECS))
def test_run_dir(env, places, cls, source):
    """A file, or a path through one, is refused before anything starts; a missing or existing directory is fine."""
    for place, expected in [
        ("file", "is a file"),
        ("under a file", "which is a file"),
        ("missing", None),
        ("dir", None),
    ]:
        raw = str(places[place])
        if source == "flag":
            error, name = outcome(cls, ["--run-dir", raw]), "--run-dir"
        else:
            env.setenv("RUN_DIR", raw)
            error, name = outcome(cls, []), "RUN_DIR"
        if expected is None:
            assert error is None, f"{place}: {error}"
        else:
            assert error is not None and expected in str(error), f"{place}: {error}"
            assert_one_line(error, name, raw, "a directory path that rank 0 can create or write into")
    assert not places["missing"].exists()  # checking creates nothing


def test_a_read_only_run_dir_is_refused_on_rank_0_only(env, places, monkeypatch):
    """The kernel's answer (os.access with the effective ids) is what counts; faked here for any user.

    A real read-only directory, for root too, is in tests/e2e/test_bad_input_exits.py.
    """
    read_only = places["dir"]
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: False if Path(path) == read_only else real_access(path, mode, **kw)
    )
    for raw in (read_only, read_only / "run"):
        error = outcome(toy.ToyArgs, ["--run-dir", str(raw)])
        assert error is not None and "is not writable by this user" in str(error), error
        assert_one_line(error, "--run-dir", str(raw), "a directory path that rank 0 can create or write into")
    env.setenv("RANK", "1")  # another rank (another node, maybe) does not write there: not its call
    env.setenv("WORLD_SIZE", "2")
    assert outcome(toy.ToyArgs, ["--run-dir", str(read_only)]) is None
    assert "is a file" in str(outcome(toy.ToyArgs, ["--run-dir", str(places["file"])]))  # a file is a file anywhere


@pytest.mark.parametrize("source", ["flag", "variable"])
def test_cifar10_data_dir(env, places, source):
    with_data = places["dir"]
    (with_data / "cifar-10-batches-py").mkdir()
    for place, expected in [
        ("file", "is a file"),
        ("under a file", "which is a file"),
        ("missing", "--download"),
        ("dir", None),
    ]:
        raw = str(places[place] if place != "dir" else with_data)
        if source == "flag":
            error, name = outcome(cifar10.Cifar10Args, ["--data-dir", raw]), "--data-dir"
        else:
            env.setenv("DATA_DIR", raw)
            error, name = outcome(cifar10.Cifar10Args, []), "DATA_DIR"
        if expected is None:
            assert error is None, f"{place}: {error}"
        else:
            assert error is not None and expected in str(error), f"{place}: {error}"
            assert_one_line(error, name, raw)
    # --download writes into it: a file is still refused; a missing directory is fine (rank 0 creates it)
    assert outcome(cifar10.Cifar10Args, ["--download", "--data-dir", str(places["missing"])]) is None
    assert "is a file" in str(outcome(cifar10.Cifar10Args, ["--download", "--data-dir", str(places["file"])]))
    assert "is empty" in str(outcome(cifar10.Cifar10Args, ["--data-dir="]))


@pytest.mark.parametrize("raw", ["missing.pt", "a-dir", "a-file"])
def test_resume_from_names_the_flag(env, tmp_path, raw):
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("not a checkpoint")
    error = outcome(toy.ToyArgs, ["--resume-from", str(tmp_path / raw)])
    assert error is not None and "--resume-from" in str(error) and "\n" not in str(error), error


# ----------------------------------------------------------------------------------------- cross-field


@pytest.mark.parametrize(
    "cls, argv, message",
    [
        (
            toy.ToyArgs,
            ["--batch-size", "64", "--dataset-size", "32"],
            "--batch-size=64 is larger than --dataset-size=32",
        ),
        (
            cifar10.Cifar10Args,
            ["--warmup-epochs", "3", "--epochs", "2"],
            "--warmup-epochs=3.0 is longer than --epochs=2",
        ),
        *(  # torch's reducer asserts on a static graph's no_sync passes: refused before any process starts
            (cls, ["--static-graph", "--grad-accum", "2"], "--static-graph with --grad-accum=2: DDP's static graph")
            for cls in (toy.ToyArgs, cifar10.Cifar10Args)
        ),
    ],
)
def test_cross_field_checks(env, cls, argv, message):
    error = outcome(cls, argv)
    assert error is not None and str(error).startswith(message) and "\n" not in str(error)


def test_a_static_graph_without_accumulation_and_accumulation_without_it_are_accepted(env):
    assert outcome(toy.ToyArgs, ["--static-graph", "--grad-accum", "1"]) is None
    assert outcome(toy.ToyArgs, ["--grad-accum", "2"]) is None


def test_validate_checks_arguments_built_in_code(env):
    with pytest.raises(ConfigError, match=r"^--lr=inf is not finite: it must be a finite number > 0$"):
        toy.main.check(toy.ToyArgs(lr=math.inf))
    with pytest.raises(ConfigError, match=r"^--seed=-1 is out of range: it must be an integer in 0\.\.2\*\*64-1"):
        toy.main.check(toy.ToyArgs(seed=-1))


# -------------------------------------------------------------------------- examples of one-line errors


@pytest.mark.parametrize(
    "argv, variables, message",
    [
        (
            ["--seed", "-5"],
            {},
            "--seed=-5 is out of range: it must be an integer in 0..2**64-1"
            " (the range torch.manual_seed and numpy's SeedSequence both accept)",
        ),
        ([], {"SEED": "-1"}, "SEED=-1 is out of range: it must be an integer in 0..2**64-1"),
        (
            [],
            {"SEED": "1180591620717411303424"},
            "SEED=1180591620717411303424 is out of range: it must be an integer in 0..2**64-1",
        ),
        (["--lr", "inf"], {}, "--lr=inf is not finite: it must be a finite number > 0"),
        (
            ["--lr", "-1e3"],
            {},
            "--lr=-1e3 is out of range: it must be a finite number > 0",
        ),  # argparse alone: "expected one argument"
        (["--lr", "-inf"], {}, "--lr=-inf is not finite: it must be a finite number > 0"),
        (
            ["--run-dir", "--seed", "3"],
            {},
            "argument --run-dir: expected one argument",
        ),  # a flag after a flag: its value is missing
        (
            ["--dist-timeout-s", "nan"],
            {},
            "--dist-timeout-s=nan is not finite: it must be a number in (0, 31536000] (seconds; at most 365 days)",
        ),
    ],
)
def test_the_issues_examples(env, argv, variables, message):
    for name, value in variables.items():
        env.setenv(name, value)
    error = outcome(toy.ToyArgs, argv)
    assert error is not None and str(error).startswith(message), error


@pytest.mark.parametrize("seed", ["0", "4294967295", "4294967296", str(2**63), str(2**64 - 1)])
def test_seeds_other_tools_use_are_accepted(env, seed):
    assert parse_args(toy.ToyArgs, ["--seed", seed]).seed == int(seed)


# -------------------------------------------------------------------------------------------- hypothesis

# parse_args alone: without validate's cross-field checks (--batch-size <= --dataset-size, --warmup-epochs <= --epochs,
# the toy's --stop-at-step <= --steps)
DECLARED = {
    (toy.ToyArgs, "batch_size"): Int(1, 10**7),
    (toy.ToyArgs, "dataset_size"): Int(1, 10**7),
    (cifar10.Cifar10Args, "warmup_epochs"): Float(0),
    (toy.ToyArgs, "stop_at_step"): Int(0),
}
NUMERIC = [case for case in CASES if isinstance(SPECS[case.values[0]][case.values[1]], (Int, Float))]


@pytest.mark.parametrize("cls, name", NUMERIC)
@FAST
@given(
    value=st.one_of(
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(),
        st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64]),
    )
)
def test_any_number_is_accepted_exactly_when_in_range(clean_env, cls, name, value):
    spec, raw = DECLARED.get((cls, name), SPECS[cls][name]), repr(value) if isinstance(value, float) else str(value)
    try:
        parsed = getattr(parse_args(cls, [f"{flag(name)}={raw}"]), name)
    except ConfigError as error:
        assert not spec.accepts(raw), f"{flag(name)}={raw} refused: {error}"
        assert_one_line(error, flag(name), raw, spec.range_words())
    else:
        assert spec.accepts(raw), f"{flag(name)}={raw} accepted"
        assert parsed == (int(raw) if isinstance(spec, Int) else float(raw))


@pytest.mark.parametrize(
    "cls, name", [case for case in CASES if not isinstance(SPECS[case.values[0]][case.values[1]], Flag)]
)
@FAST
@given(raw=st.text(max_size=24))
def test_any_text_is_accepted_or_refused_with_one_line(clean_env, cls, name, raw):
    try:
        parse_args(cls, [f"{flag(name)}={raw}"])
    except ConfigError as error:
        assert "\n" not in str(error) and flag(name) in str(error)


# ---------------------------------------------------------------------- launch and container variables

TWO_RANKS = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
LAUNCH_VARIABLES = {  # variable: values that must be refused (with TWO_RANKS otherwise)
    "RANK": ["abc", "-1", "2", HUGE, "nan", "inf", "1.5"],
    "WORLD_SIZE": ["abc", "-1", "0", HUGE, "nan", "inf", "1.5"],
    "LOCAL_RANK": ["abc", "-1", "2", HUGE, "nan", "1.5"],
    "LOCAL_WORLD_SIZE": ["abc", "-1", "0", "3", HUGE, "nan", "1.5"],
    "MASTER_PORT": ["abc", "-1", "0", "65536", HUGE, "nan", "inf", "1.5"],
    "TORCHELASTIC_RESTART_COUNT": ["abc", "-1", HUGE, "nan", "1.5"],
}


@pytest.mark.parametrize("variable, values", LAUNCH_VARIABLES.items(), ids=list(LAUNCH_VARIABLES))
def test_launch_variables(variable, values):
    for raw in values:
        with pytest.raises(ConfigError) as info:
            DistEnv.from_environ({**TWO_RANKS, variable: raw})
        assert_one_line(info.value, variable, raw)
        assert any(word in str(info.value) for word in ("it must be", "must be <", "must be <=")), info.value


CONTAINER_BASE = {
    "NNODES": "2",
    "NODE_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "NPROC_PER_NODE": "1",
}  # every variable is read
CONTAINER_VARIABLES = {
    "EXPERIMENT": ["abc", "../toy", "cifar10_data", "cifar10_models", "__init__", "toy.py"],
    "NPROC_PER_NODE": ["abc", "-1", "0", HUGE, "nan", "inf", "1.5", "1025"],
    "NNODES": ["abc", "-1", "0", HUGE, "nan", "1.5"],
    "NODE_RANK": ["abc", "-1", "2", HUGE, "nan", "1.5"],
    "MASTER_PORT": ["abc", "-1", "0", "65536", HUGE, "nan"],
    "RDZV_BACKEND": ["abc", "etcd", "0"],
    "MAX_RESTARTS": ["abc", "-1", HUGE, "nan", "1.5"],
    "DIST_TIMEOUT_S": ["abc", "-1", "0", HUGE, "nan", "inf", "1e400"],
    "DIST_INIT_TIMEOUT_S": ["abc", "-1", "0", HUGE, "nan", "inf", "1e400"],
    # passed through to every worker: refused once here instead of once per worker
    "SEED": ["abc", "-1", HUGE, "1.5", "nan"],
    "DETERMINISTIC": ["maybe", "2"],
    "BACKEND": ["mpi", "abc"],
    "INIT_METHOD": ["abc", "tcp://host", "tcp://host:0", "http://x:1"],
}


@pytest.mark.parametrize("variable, values", CONTAINER_VARIABLES.items(), ids=list(CONTAINER_VARIABLES))
def test_container_variables(variable, values):
    for raw in values:
        with pytest.raises(ConfigError) as info:
            torchrun_command({**CONTAINER_BASE, variable: raw}, [])
        message = str(info.value)
        assert "\n" not in message and variable in message and (raw in message or repr(raw) in message), message


@pytest.mark.parametrize(
    "variable, raw",
    [
        ("DIST_INIT_TIMEOUT_S", "12.5"),
        ("DIST_TIMEOUT_S", "12.5"),
        ("RDZV_ID", "a b"),
        ("SEED", str(2**64 - 1)),
        ("EXPERIMENT", "cifar10"),
    ],
)
def test_container_variables_that_work(variable, raw):
    command = torchrun_command({**CONTAINER_BASE, variable: raw}, [])
    if variable == "DIST_INIT_TIMEOUT_S":  # the rendezvous is set-up: the long timeout
        assert "--rdzv-conf=timeout=13" in command  # torchrun takes whole seconds: rounded up, never to 0


def test_common_args_spec_matches_the_container_check():
    assert {f.metadata.get("env") for f in dataclasses.fields(CommonArgs)} - {None} <= set(CONTAINER_VARIABLES) | {
        "RUN_DIR"
    }
