"""Write docs/reference.md from the code: ``python -m tools.reference`` (or ``make reference``).

Every training experiment's flags, every other command's, every environment variable, where the exit codes are, and
the make targets; ``--check`` exits 1 if the file differs (tests/unit/test_reference.py).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import typing
from pathlib import Path

from ddp_core import new, runs
from ddp_core.config import CommonArgs, accepted, options, plain_type
from ddp_core.experiment import TrainingArgs
from ddp_core.experiment_files import TRAINING, kind_of
from tools import contract, study

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "reference.md"
COMMAND = "python -m tools.reference"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: typing.Any) -> str:
    if value is None:
        return "auto"
    if value == "":
        return "(empty)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _flag_rows(args_type: type, names: set[str] | None = None) -> list[str]:
    hints = {name: plain_type(kind) for name, kind in typing.get_type_hints(args_type).items()}
    rows = []
    for f in options(args_type):
        if names is not None and f.name not in names:
            continue
        meta, kind = f.metadata, hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        shown = f"`{flag}`, `--no-{flag[2:]}`" if kind is bool else f"`{flag}`"
        accepts = "on or off" if kind is bool else accepted(kind, meta, with_note=False)
        env = f"`{meta['env']}`" if meta.get("env") else ""
        resume = "no" if meta.get("computation", True) else "yes"
        rows.append(
            f"| {shown} | {_default(f.default)} | {_cell(accepts)} | {env} | {resume} | {_cell(meta['help'])} |"
        )
    return rows


FLAG_HEADER = [
    "| flag | default | accepts | variable | a resume may change it | what |",
    "|---|---|---|---|---|---|",
]


def training_experiments() -> dict[str, type]:
    """``{name: its options' dataclass}`` for every training experiment under experiments/, by name."""
    found = {}
    for path in sorted((REPO / "experiments").glob("*.py")):
        if kind_of(path) == TRAINING:
            found[path.stem] = importlib.import_module(f"experiments.{path.stem}").main.args_type
    return found


def flags_section() -> list[str]:
    shared = {f.name: f.default for f in options(TrainingArgs)}
    out = [
        "## Flags",
        "",
        "Each flag is also read from its variable, where it has one (flag > variable > `.env` > default). A resume "
        "takes the checkpoint's value of every flag not marked *a resume may change it*, and refuses another one set "
        "by the flag or its variable unless `--allow-config-change`.",
        "",
        "### Every training experiment",
        "",
        *FLAG_HEADER,
        *_flag_rows(TrainingArgs),
    ]
    for name, args_type in training_experiments().items():
        own = {f.name for f in options(args_type) if f.name not in shared}
        redeclared = [
            f"`--{f.name.replace('_', '-')}` {_default(f.default)}"
            for f in options(args_type)
            if f.name in shared and f.default != shared[f.name]
        ]
        out += ["", f"### {name}", ""]
        if redeclared:
            out += [f"Shared flags with a default of its own: {', '.join(redeclared)}.", ""]
        out += [*FLAG_HEADER, *_flag_rows(args_type, own)]
    return out


PARSED = {  # the commands that are not launched: their argparse parsers
    "python -m tools.study": study.argument_parser,
    "python -m tools.contract": contract.argument_parser,
    "python -m ddp_core.runs": runs.argument_parser,
    "python -m ddp_core.new": new.argument_parser,
}
LAUNCHED = ("preflight", "commbench", "collectives")  # launched as experiments are: their options' dataclasses


def _parsed_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """``(option, default, accepts, what)`` of each argument but --help."""
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        metavar = action.metavar or (action.dest.upper() if action.nargs != 0 else "")
        shown = " ".join([metavar] * (action.nargs if isinstance(action.nargs, int) else 1)) if metavar else ""
        option = f"{action.option_strings[0]} {shown}".strip() if action.option_strings else shown
        default = "required" if action.required and action.option_strings else _default(action.default)
        accepts = f"one of {', '.join(action.choices)}" if action.choices else ""
        repeat = (
            " (repeatable)" if isinstance(action, argparse._AppendAction) and "repeatable" not in action.help else ""
        )
        rows.append((f"`{option}`", "" if default in ("auto", "`[]`") else default, accepts, action.help + repeat))
    return rows


def _option_rows(args_type: type) -> list[tuple[str, str, str, str]]:
    """``(option, default, accepts, what)`` of each option a launched command adds to the shared ones."""
    hints = {name: plain_type(kind) for name, kind in typing.get_type_hints(args_type).items()}
    shared, rows = {f.name for f in options(CommonArgs)}, []
    for f in options(args_type):
        if f.name in shared:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        shown = f"`{flag}`, `--no-{flag[2:]}`" if kind is bool else f"`{flag}`"
        shown += f" (`{f.metadata['env']}`)" if f.metadata.get("env") else ""
        accepts = "on or off" if kind is bool else accepted(kind, f.metadata, with_note=False)
        rows.append((shown, _default(f.default), accepts, f.metadata["help"]))
    return rows


def commands_section() -> list[str]:
    shared = ", ".join(f"`--{f.name.replace('_', '-')}`" for f in options(CommonArgs))
    tables = {command: _parsed_rows(parser()) for command, parser in PARSED.items()}
    for name in LAUNCHED:
        module = importlib.import_module(f"experiments.{name}")
        module = importlib.import_module(module.TOOL) if hasattr(module, "TOOL") else module
        tables[f"python -m experiments.{name}"] = _option_rows(module.main.args_type)
    out = [
        "## Other commands",
        "",
        f"Each also takes `--help`. {', '.join(f'`{name}`' for name in LAUNCHED)} are launched as an experiment is "
        f"(`python -m experiments.NAME`, or under `ddp_core.torchrun`) and take its shared flags {shared} too.",
        "",
        "| command | option | default | accepts | what |",
        "|---|---|---|---|---|",
    ]
    for command, rows in tables.items():
        for index, row in enumerate(rows):
            out.append("| " + " | ".join([f"`{command}`" if index == 0 else "", *map(_cell, row)]) + " |")
    return out


def env_variables() -> dict[str, tuple[str, list[str]]]:
    """``{name: (default, its groups)}`` for each variable of .env.example, in its order; a ``# NAME=`` line
    only: unset by default."""
    found: dict[str, tuple[str, list[str]]] = {}
    section = ""
    for line in (REPO / ".env.example").read_text().splitlines():
        heading = re.match(r"# --- (.+?) -+$", line)
        variable = re.match(r"^(#? ?)([A-Z][A-Z0-9_]+)=(\S*)(\s|$)", line)
        if heading:
            section = re.split(r" \(|;", heading[1])[0]
        elif variable:
            name, commented = variable[2], bool(variable[1])
            default, groups = found.get(name, ("(unset)", []))
            if not commented:
                default = variable[3] or "(empty)"
            found[name] = (default, groups if section in groups else [*groups, section])
    return found


def variables_section() -> list[str]:
    flags = {}
    for args_type in [TrainingArgs, *training_experiments().values()]:
        for f in options(args_type):
            if f.metadata.get("env"):
                flags[f.metadata["env"]] = "--" + f.name.replace("_", "-")
    rows = env_variables()
    missing = sorted(set(flags) - set(rows))
    assert not missing, f"option variables not in .env.example: {missing}"
    out = [
        "## Environment variables",
        "",
        "From `.env.example` (copy it to `.env`), which explains each; (unset): only a commented-out line there.",
        "",
        "| variable | default | flag | group |",
        "|---|---|---|---|",
    ]
    for name, (default, groups) in rows.items():
        flag = f"`{flags[name]}`" if name in flags else ""
        out.append(f"| `{name}` | {_cell(default)} | {flag} | {_cell(', '.join(groups))} |")
    return out


def exit_codes_section() -> list[str]:
    """A pointer: the codes are listed once, in the README (tests/unit/test_docs.py checks it against the code)."""
    return [
        "## Exit codes",
        "",
        "Of every experiment, `ddp_core.torchrun` and the Docker entrypoint: "
        "[the README's table](../README.md#exit-codes), from `ddp_core/exit_codes.py`.",
    ]


def make_targets() -> list[tuple[str, str]]:
    """``(target, its comment)`` for each rule of the Makefile, the comment being the block just above it."""
    lines = (REPO / "Makefile").read_text().splitlines()
    targets = []
    for index, line in enumerate(lines):
        rule = re.match(r"^([a-z][\w-]*):", line)
        if not rule:
            continue
        comment: list[str] = []
        for above in reversed(lines[:index]):
            if above.startswith("#"):
                comment.insert(0, above.lstrip("# ").strip())
            elif re.match(r"^(\.PHONY|ifn?eq|endif|\$\(error|[A-Z_]+ \?=)", above):
                if comment:
                    break
            else:
                break
        targets.append((rule[1], " ".join(comment)))
    return targets


def make_section() -> list[str]:
    out = ["## Make targets", "", "| target | what |", "|---|---|"]
    out += [f"| `make {name}` | {_cell(comment)} |" for name, comment in make_targets()]
    return out


def render() -> str:
    sections = [flags_section(), commands_section(), variables_section(), exit_codes_section(), make_section()]
    head = [
        "# Reference",
        "",
        f"Written by `{COMMAND}` (`make reference`) from the code; do not edit it by hand.",
    ]
    return "\n".join(head + [line for section in sections for line in ["", *section]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args == ["--check"]:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if args:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
