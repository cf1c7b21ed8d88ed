"""Start a new experiment: ``python -m ddp_core.new NAME`` (or ``make new-experiment NAME=NAME``).

Writes ``experiments/NAME.py`` from ``ddp_core/templates/experiment.py.template`` (``string.Template``: ``$$`` is a
dollar sign), which passes the contract as written; never overwrites a file (docs/new-experiment.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import sys
from pathlib import Path
from string import Template
from typing import NoReturn

from ddp_core.errors import ConfigError, exits_with_one_line

TEMPLATE = Path(__file__).resolve().parent / "templates" / "experiment.py.template"
MAX_NAME_LENGTH = 40  # a module name, a run folder (runs/NAME/...) and a TensorBoard label: short is readable
DOCS = "docs/new-experiment.md"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a new experiment module (the file's existence aside); None if it can."""
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"is {len(name)} characters long: at most {MAX_NAME_LENGTH}"
    if not name.isascii() or not name.isidentifier():
        return "is not a Python module name: letters, digits and underscores, not starting with a digit (e.g. my_exp)"
    if name != name.lower():
        return f"has upper-case letters: module names are lower case (e.g. {name.lower()})"
    if name.startswith("_"):
        return "starts with an underscore: such modules are not listed as experiments (python -m experiments)"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return "is a Python keyword"
    if name in sys.stdlib_module_names:
        return "is a standard-library module: an experiment of that name would shadow it"
    if name in sys.builtin_module_names or _importable(name):
        return "is already an importable module (installed, or a folder here): choose a name that shadows nothing"
    return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None  # a top-level name: searched for, not imported
    except (ImportError, ValueError):
        return True  # something by that name is there, if broken


def experiments_folder() -> Path:
    """Where ``python -m experiments.NAME`` looks: the ``experiments`` package's own folder."""
    spec = importlib.util.find_spec("experiments")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the experiments package is not importable from here: run from the repository root, or pass --dir"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def render(name: str) -> str:
    """The new experiment's source, ``name`` filled in."""
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(name=name)


def create(name: str, folder: Path) -> Path:
    """Write ``folder/NAME.py``; a ConfigError (nothing written) for a bad name or an existing file."""
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"NAME={name!r} {problem}")
    path = folder / f"{name}.py"
    if path.exists() or (folder / name).exists():
        existing = path if path.exists() else folder / name
        raise ConfigError(
            f"{_shown(existing)} already exists: choose another NAME (python -m experiments lists the experiments); "
            "nothing was overwritten"
        )
    if not folder.is_dir():
        raise ConfigError(f"--dir={folder} is not a directory: create it first")
    with open(path, "x", encoding="utf-8") as handle:  # "x": fails rather than overwrite a file created meanwhile
        handle.write(render(name))
    return path


def next_steps(name: str, path: Path, default_folder: bool) -> str:
    module = f"experiments.{name}" if default_folder else name
    env = "" if default_folder else f"PYTHONPATH={_shown(path.parent)} "
    train = f"{env}python -m ddp_core.torchrun --standalone --nproc-per-node=2 -m {module}"
    steps = [(train, "train it: 2 processes (GPUs, or CPU with gloo)")]
    steps.append((f"{env}python -m tools.contract {module}", "check that it keeps ddp-lab's contract"))
    if default_folder:
        steps.append(("make reference", "its flags into docs/reference.md (make test-quick checks it)"))
    steps.append((f"less {DOCS}", "what each part owes, and why"))
    width = max(len(command) for command, _ in steps)
    wrote = f"wrote {_shown(path)}: a small MLP on synthetic data; put your data, model and loss where it says >>> YOUR"
    return "\n".join([wrote, "next:", *(f"  {command:<{width}}  # {why}" for command, why in steps)])


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")  # one line, exit 2, as every ddp-lab command


def argument_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m ddp_core.new", description=__doc__.splitlines()[0])
    parser.add_argument("name", metavar="NAME", help="the experiment's module name: lower case, e.g. my_exp")
    parser.add_argument("--dir", default="", help="write DIR/NAME.py instead of experiments/NAME.py")
    return parser


@exits_with_one_line
def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    folder = Path(args.dir) if args.dir else experiments_folder()
    path = create(args.name, folder)
    print(next_steps(args.name, path, default_folder=not args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
