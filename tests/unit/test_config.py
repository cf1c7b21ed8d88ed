"""Configuration precedence: flag > real environment variable > ./.env > default; bad input is a ConfigError.

Every test uses the ``clean_env`` fixture: the working directory is an empty temp dir, and every
variable parse_args may read (or python-dotenv may write into os.environ) is restored afterwards.
"""

from __future__ import annotations

import dataclasses

import pytest

from ddp_core.config import CommonArgs, options, parse_args
from ddp_core.distributed.group import BACKENDS, DistConfig
from ddp_core.errors import ConfigError, exits_with_one_line
from experiments import toy
from experiments.toy import ToyArgs


def default(cls, name):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def write_dotenv(directory, **values) -> None:
    (directory / ".env").write_text("".join(f"{key}={value}\n" for key, value in values.items()))


def expect_exit_2(capsys, fn, *args, mentions: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        exits_with_one_line(fn)(*args)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {captured.err!r}"
    assert lines[0].startswith("error: ")
    assert mentions in lines[0]
    return lines[0]


# (field, flag, variable, value for .env, value for the real environment, value for the flag, converted)
LAYERS = [
    ("seed", "--seed", "SEED", "11", "22", "33", int),
    ("run_dir", "--run-dir", "RUN_DIR", "runs/from-dotenv", "runs/from-env", "runs/from-flag", str),
    ("dist_timeout_s", "--dist-timeout-s", "DIST_TIMEOUT_S", "12.5", "25.0", "50.25", float),
    ("backend", "--backend", "BACKEND", "gloo", "nccl", "auto", str),
    ("init_method", "--init-method", "INIT_METHOD", "file:///tmp/a", "tcp://127.0.0.1:29500", "env://", str),
]


@pytest.mark.parametrize("field, flag, variable, dotenv_value, env_value, flag_value, kind", LAYERS)
@pytest.mark.parametrize("cls", [CommonArgs, ToyArgs])
def test_precedence_flag_over_env_over_dotenv_over_default(
    clean_env, tmp_path, cls, field, flag, variable, dotenv_value, env_value, flag_value, kind
):
    # default only
    assert getattr(parse_args(cls, []), field) == default(cls, field)

    # .env beats the default
    write_dotenv(tmp_path, **{variable: dotenv_value})
    assert getattr(parse_args(cls, []), field) == kind(dotenv_value) != default(cls, field)

    # the real environment beats .env
    clean_env.setenv(variable, env_value)
    assert getattr(parse_args(cls, []), field) == kind(env_value)

    # a flag beats both
    assert getattr(parse_args(cls, [flag, flag_value]), field) == kind(flag_value)
    assert getattr(parse_args(cls, [f"{flag}={flag_value}"]), field) == kind(flag_value)


def test_dotenv_beats_default_but_not_real_environment_in_one_parse(clean_env, tmp_path):
    write_dotenv(tmp_path, SEED="5", RUN_DIR="from-dotenv", BACKEND="gloo")
    clean_env.setenv("RUN_DIR", "from-env")
    args = parse_args(ToyArgs, ["--backend", "auto"])
    assert args.seed == 5  # .env only
    assert args.run_dir == "from-env"  # real environment over .env
    assert args.backend == "auto"  # flag over .env
    assert args.steps == default(ToyArgs, "steps")  # nothing anywhere


def test_dotenv_outside_the_working_directory_is_ignored(clean_env, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    write_dotenv(other, SEED="99")
    (tmp_path / "work").mkdir()
    clean_env.chdir(tmp_path / "work")
    assert parse_args(CommonArgs, []).seed == default(CommonArgs, "seed")


def test_fields_without_env_ignore_the_environment(clean_env, tmp_path):
    # steps, batch_size and lr have no environment variable: STEPS=... must not change them.
    clean_env.setenv("STEPS", "7")
    clean_env.setenv("BATCH_SIZE", "3")
    write_dotenv(tmp_path, LR="0.9")
    args = parse_args(ToyArgs, [])
    assert (args.steps, args.batch_size, args.lr) == tuple(default(ToyArgs, n) for n in ("steps", "batch_size", "lr"))


def test_all_defaults_match_the_dataclass(clean_env):
    args = parse_args(ToyArgs, [])
    assert args == ToyArgs()
    assert isinstance(args, ToyArgs)


def test_flags_for_experiment_options(clean_env):
    args = parse_args(ToyArgs, ["--steps", "7", "--batch-size", "3", "--lr", "0.25", "--resume", "--nproc", "2"])
    assert (args.steps, args.batch_size, args.lr, args.resume, args.nproc) == (7, 3, 0.25, True, 2)
    assert isinstance(args.lr, float) and isinstance(args.steps, int)


def test_dist_config_carries_the_resolved_values(clean_env):
    config = parse_args(
        CommonArgs,
        ["--backend", "gloo", "--dist-timeout-s", "7.5", "--dist-init-timeout-s", "30", "--init-method", "tcp://h:1"],
    ).dist_config()
    assert config == DistConfig(backend="gloo", timeout_s=7.5, init_method="tcp://h:1", init_timeout_s=30.0)
    assert (
        config.setup_timeout_s == 30.0 and DistConfig(timeout_s=7.5).setup_timeout_s == 7.5
    )  # without a set-up timeout, one for all


# ---- booleans ----


@pytest.mark.parametrize(
    "word, expected",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
    ],
)
def test_boolean_environment_variable(clean_env, word, expected):
    clean_env.setenv("DETERMINISTIC", word)
    assert parse_args(CommonArgs, []).deterministic is expected


@pytest.mark.parametrize("word, expected", [("1", True), ("0", False), ("true", True)])
def test_boolean_from_dotenv(clean_env, tmp_path, word, expected):
    write_dotenv(tmp_path, DETERMINISTIC=word)
    assert parse_args(CommonArgs, []).deterministic is expected


def test_boolean_flags_beat_the_environment(clean_env):
    assert default(CommonArgs, "deterministic") is False
    clean_env.setenv("DETERMINISTIC", "1")
    assert parse_args(CommonArgs, []).deterministic is True
    assert parse_args(CommonArgs, ["--no-deterministic"]).deterministic is False
    clean_env.setenv("DETERMINISTIC", "0")
    assert parse_args(CommonArgs, ["--deterministic"]).deterministic is True
    assert parse_args(CommonArgs, []).deterministic is False


def test_bad_boolean_environment_variable(clean_env, capsys):
    clean_env.setenv("DETERMINISTIC", "maybe")
    with pytest.raises(ConfigError, match="DETERMINISTIC='maybe' is not a boolean"):
        parse_args(CommonArgs, [])
    expect_exit_2(capsys, parse_args, CommonArgs, [], mentions="DETERMINISTIC")


# ---- bad values ----


@pytest.mark.parametrize(
    "variable, value, problem",
    [
        ("SEED", "abc", "is not an integer"),
        ("SEED", "1.5", "is not an integer"),
        ("DIST_TIMEOUT_S", "soon", "is not a number"),
    ],
)
def test_bad_typed_environment_variable(clean_env, capsys, variable, value, problem):
    clean_env.setenv(variable, value)
    with pytest.raises(ConfigError, match=rf"{variable}='{value}' {problem}: it must be "):
        parse_args(ToyArgs, [])
    expect_exit_2(capsys, parse_args, ToyArgs, [], mentions=variable)


def test_bad_typed_value_in_dotenv_names_the_variable(clean_env, tmp_path):
    write_dotenv(tmp_path, SEED="abc")
    with pytest.raises(ConfigError, match="SEED='abc'"):
        parse_args(CommonArgs, [])


def test_flag_wins_over_a_bad_environment_value(clean_env):
    # the environment is only consulted when the flag is absent
    clean_env.setenv("SEED", "abc")
    assert parse_args(CommonArgs, ["--seed", "4"]).seed == 4


@pytest.mark.parametrize("source", ["env", "dotenv"])
def test_backend_choices_enforced_for_the_environment(clean_env, tmp_path, capsys, source):
    if source == "env":
        clean_env.setenv("BACKEND", "mpi")
    else:
        write_dotenv(tmp_path, BACKEND="mpi")
    with pytest.raises(ConfigError, match="BACKEND='mpi' is not one of"):
        parse_args(CommonArgs, [])
    line = expect_exit_2(capsys, parse_args, CommonArgs, [], mentions="BACKEND")
    for name in BACKENDS:
        assert name in line


def test_backend_choices_enforced_for_the_flag(clean_env):
    with pytest.raises(ConfigError, match="--backend"):
        parse_args(CommonArgs, ["--backend", "mpi"])


@pytest.mark.parametrize(
    "argv, mentions",
    [
        (["--bogus"], "--bogus"),
        (["--seed", "1", "--no-such-flag", "x"], "--no-such-flag"),
        (["positional"], "positional"),
        (["--se", "3"], "--se"),  # abbreviations are not accepted
        (["--seed"], "--seed"),
    ],
)
def test_bad_command_line(clean_env, capsys, argv, mentions):
    with pytest.raises(ConfigError, match="--help"):
        parse_args(ToyArgs, argv)
    expect_exit_2(capsys, parse_args, ToyArgs, argv, mentions=mentions)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "abc"], "--seed='abc' is not an integer: it must be an integer in 0..2**64-1"),
        (["--steps", "many"], "--steps='many' is not an integer: it must be an integer in 1..2**63-1"),
        (["--lr", "fast"], "--lr='fast' is not a number: it must be a finite number > 0"),
    ],
)
def test_unparsable_flag_value_names_the_flag_the_value_and_the_range(clean_env, capsys, argv, message):
    with pytest.raises(ConfigError) as info:
        parse_args(ToyArgs, argv)
    assert str(info.value).startswith(message)
    expect_exit_2(capsys, parse_args, ToyArgs, argv, mentions=message)


# @record tries faulthandler.enable(sys.stderr), which capsys's stand-in cannot provide: harmless here.
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
@pytest.mark.parametrize(
    "argv, mentions",
    [
        (["--bogus"], "--bogus"),
        (["--steps", "0"], "--steps=0"),
        (["--batch-size", "0"], "--batch-size=0"),
        (["--lr", "0"], "--lr=0"),
        (["--nproc", "0"], "--nproc=0"),
    ],
)
def test_toy_entry_point_exits_2_before_any_process_group(clean_env, capsys, argv, mentions):
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        toy.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and mentions in lines[0], captured.err


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_toy_entry_point_exits_2_on_bad_environment(clean_env, capsys):
    clean_env.setenv("SEED", "abc")
    with pytest.raises(SystemExit) as info:
        toy.main([])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "SEED" in lines[0]


# ---- a resume continues the same run: which options may differ from the checkpoint's ----


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        ({}, []),
        ({"batch_size": 8}, ["--batch-size: 32 -> 8"]),
        ({"lr": 0.5, "steps": 300}, ["--steps: 200 -> 300", "--lr: 0.2 -> 0.5"]),  # in declaration order
        ({"seed": 7, "deterministic": True}, ["--seed: 0 -> 7", "--deterministic: False -> True"]),
        # where it writes, how often it logs or saves, how long it waits, how it was launched: free
        (
            {
                "run_dir": "elsewhere",
                "log_every": 3,
                "checkpoint_every": 7,
                "keep_checkpoints": 5,
                "dist_timeout_s": 60.0,
                "resume": True,
                "resume_from": "x.pt",
                "stop_at_step": 9,
                "allow_config_change": True,
                "nproc": 4,
            },
            [],
        ),
    ],
)
def test_the_options_a_resume_may_not_change(changed, expected):
    from dataclasses import asdict, replace

    from ddp_core.config import config_changes

    written = asdict(ToyArgs())
    assert config_changes(written, replace(ToyArgs(), **changed)) == expected
    assert config_changes({}, replace(ToyArgs(), **changed)) == []  # a checkpoint from before configs were recorded


def test_every_option_declares_whether_it_changes_the_computation():
    """A new option changes the computation unless declared otherwise: the safe default for a resume."""

    from experiments import charlm, cifar10

    free = {
        cls.__name__: sorted(f.name for f in options(cls) if not f.metadata["computation"])
        for cls in (ToyArgs, cifar10.Cifar10Args, charlm.CharLMArgs)
    }
    shared = [
        "allow_config_change",
        "check_replicas_every",
        "checkpoint_async",
        "checkpoint_every",
        "checkpoint_writer",
        "dist_init_timeout_s",
        "dist_timeout_s",
        "eval_every",
        "gradient_as_bucket_view",
        "init_method",
        "keep_checkpoints",
        "log_every",
        "log_reads",
        "nproc",
        "profile",
        "resume",
        "resume_from",
        "run_dir",
        "stop_at_step",
        "zero",
    ]
    assert free["ToyArgs"] == sorted(shared)
    assert free["Cifar10Args"] == sorted([*shared, "data_dir", "download", "eval_batch_size", "verify"])
    assert free["CharLMArgs"] == sorted(shared)


def test_a_long_path_is_named_whole_and_a_pasted_blob_is_cut(clean_env, tmp_path):
    """A user must see which path was refused, however deep it is; a value of thousands of characters stays
    one short line."""
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 10)
    deep.mkdir(parents=True)
    (deep / "notes.txt").write_text("")
    for value, shown in ((str(deep / "notes.txt"), str(deep / "notes.txt") + "'"), ("x" * 5000, "x" * 400 + "...")):
        with pytest.raises(ConfigError) as refused:
            parse_args(ToyArgs, ["--run-dir", value])
        line = str(refused.value)
        assert shown in line and len(line) < 700 and "\n" not in line, line


def test_each_part_is_handed_its_own_options_and_the_length_in_steps_is_checked_before_launch():
    from ddp_core.config import own
    from ddp_core.experiment import StepsArgs, TrainingArgs, experiment_main
    from ddp_core.lifecycle.metrics_log import MetricsLogArgs
    from ddp_core.lifecycle.stop_policy import StopPolicyArgs

    @dataclasses.dataclass
    class Mine(StepsArgs, TrainingArgs):
        steps: int = 12  # the shared option, with this experiment's default
        log_every: int = 3

    args = parse_args(Mine, ["--stop-at-step", "13", "--eval-every", "4"])
    assert own(MetricsLogArgs, args) == MetricsLogArgs(eval_every=4, log_every=3)
    assert own(StopPolicyArgs, args) == StopPolicyArgs(stop_at_step=13)  # and nothing else of the run's options
    main = experiment_main("mine", Mine, lambda run, args: {}, doc="mine")
    with pytest.raises(ConfigError, match=r"--stop-at-step=13 is beyond --steps=12: it must be at most --steps"):
        main.check(args)
    main.check(parse_args(Mine, ["--stop-at-step", "12"]))
    in_epochs = experiment_main("epochs", TrainingArgs, lambda run, args: {}, doc="epochs")
    in_epochs.check(parse_args(TrainingArgs, ["--stop-at-step", "13"]))  # checked by plan(), once the loader is known
