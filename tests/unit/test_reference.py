"""docs/reference.md is what ``python -m tools.reference`` writes from the code today."""

from __future__ import annotations

import dataclasses

from ddp_core.config import option
from ddp_core.experiment import TrainingArgs
from tools import reference


def test_docs_reference_is_what_the_command_writes_today():
    written = reference.OUTPUT.read_text()
    assert written == reference.render(), f"docs/reference.md is out of date: run {reference.COMMAND} (make reference)"


def test_it_holds_every_training_experiment_variable_and_make_target_and_points_at_the_exit_codes():
    text = reference.render()
    for name in ("toy", "cifar10", "charlm"):
        assert f"\n### {name}\n" in text
    for needle in ("| `--dist-timeout-s` | `120.0` |", "| `DIST_TIMEOUT_S` | 120 | `--dist-timeout-s` |"):
        assert needle in text
    assert "(../README.md#exit-codes)" in text and "| 143 |" not in text  # listed once, in the README
    assert "| `make reference` |" in text and "| `make train` | The experiment" in text
    assert "| `--steps` | `200` |" in text.split("### toy", 1)[1]  # an experiment's own flag
    assert "Shared flags with a default of its own: `--checkpoint-every` `50`, `--log-every` `20`." in text


def test_a_changed_default_or_resume_rule_changes_the_reference():
    """Negative control: the rows come from the options themselves, so an edit in the code shows up."""

    @dataclasses.dataclass
    class Changed(TrainingArgs):
        seed: int = option(7, "seed", env="SEED", minimum=0, maximum=9, computation=False)

    rows = reference._flag_rows(Changed, {"seed"})
    assert rows == ["| `--seed` | `7` | an integer in 0..9 | `SEED` | yes | seed |"]


def test_it_holds_every_other_command_a_user_runs_with_each_option():
    text = reference.render().split("## Other commands", 1)[1].split("\n## ", 1)[0]
    for command in (
        "tools.study",
        "tools.contract",
        "ddp_core.runs",
        "ddp_core.new",
        "experiments.preflight",
        "experiments.commbench",
        "experiments.collectives",
    ):
        assert f"| `python -m {command}` |" in text, command
    for row in (
        "|  | `--seeds SEEDS` | required |  | seeds 0..N-1 for every combination |",
        "|  | `--same RUN RUN` |",
        "|  | `--keep KEEP` | (empty) |",
        "| `python -m ddp_core.new` | `NAME` |",
        "|  | `--dtype` | `float32` | one of float32,",
        "| `--data-dir` (`DATA_DIR`) | `data` |",
    ):
        assert row in text, row
    assert "`--seed`" not in text.split("| command |", 1)[1]  # the shared flags are named once, above the table


def test_a_new_option_of_a_command_shows_up_in_the_reference(monkeypatch):
    """Negative control: the rows come from the commands' own parsers and option dataclasses."""
    made = reference.PARSED["python -m ddp_core.runs"]

    def with_one_more():
        parser = made()
        parser.add_argument("--since", default="1d", help="runs started since then")
        return parser

    monkeypatch.setitem(reference.PARSED, "python -m ddp_core.runs", with_one_more)
    assert "|  | `--since SINCE` | `1d` |  | runs started since then |" in reference.commands_section()
