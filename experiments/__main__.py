"""List the experiments: ``python -m experiments`` prints each one's name, its one-line description and how to launch it.

An experiment is what ``ddp_core.experiment_files`` accepts, as EXPERIMENT=NAME in the container does:
a module experiments/NAME.py with a ``def main(``, so helpers such as cifar10_data are not listed. The
modules are read as text and parsed, never imported: listing them needs no torch, and takes milliseconds.
The description is the first line of the module's docstring; the launch command is the docstring's first
torchrun line (without its trailing comment).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_core.experiment_files import is_experiment_file

FOLDER = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    launch: str


def describe(path: Path) -> Experiment:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) or ""
    lines = [line.strip() for line in docstring.splitlines()]
    description = lines[0] if lines else ""
    launch = next((line.split(" #", 1)[0].rstrip() for line in lines if line.startswith("torchrun ")),
                  f"torchrun --standalone --nproc-per-node=2 -m experiments.{path.stem}")
    return Experiment(path.stem, description, launch)


def experiments(folder: Path = FOLDER) -> list[Experiment]:
    return [describe(path) for path in sorted(folder.glob("*.py")) if is_experiment_file(path)]


def listing(found: list[Experiment]) -> str:
    width = max((len(e.name) for e in found), default=0)
    out = ["Experiments (launch from the repository root; every option: python -m experiments.NAME --help):", ""]
    for e in found:
        out.append(f"  {e.name:<{width}}  {e.description}")
        out.append(f"  {'':<{width}}  {e.launch}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__.splitlines()[0])
        return 0
    if args:
        print(f"error: python -m experiments takes no arguments (got {' '.join(args)}): run python -m experiments.NAME", file=sys.stderr)
        return 2
    print(listing(experiments()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
