"""List the experiments: ``python -m experiments`` prints each one's name, one-line description and launch command.

An experiment is what ``ddp_core.experiment_files`` accepts, as EXPERIMENT=NAME in the container does:
a module experiments/NAME.py that declares its kind, so helpers such as cifar10_data are not listed.
Training experiments (``main = experiment_main(...)``, or ``KIND = "training"``: they train, checkpoint
and resume) are listed apart from the demos (``KIND = "demo"``: the collectives) and the tools
(``KIND = "tool"``: preflight and commbench, aliases of tools/). Both train nothing. The modules are read as
text and parsed, never imported: listing them needs no torch, and takes milliseconds. The description is
the first line of the module's docstring; the launch command is the docstring's first torchrun line
(without its trailing comment), else the plain two-process one.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_core.experiment_files import DEMO, TOOL, TRAINING, kind_of

LAUNCHER = "python -m ddp_core.torchrun"  # the project's launcher, in every command it shows
FOLDER = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    launch: str
    kind: str  # ddp_core.experiment_files.KINDS: training, demo or tool

    @property
    def trains(self) -> bool:
        """A training experiment (ddp_core.experiment), not a demo or a tool."""
        return self.kind == TRAINING


def describe(path: Path, kind: str) -> Experiment:
    source = path.read_text(encoding="utf-8")
    docstring = ast.get_docstring(ast.parse(source, filename=str(path))) or ""
    lines = [line.strip() for line in docstring.splitlines()]
    description = lines[0] if lines else ""
    launch = next(
        (line.split(" #", 1)[0].rstrip() for line in lines if line.startswith(LAUNCHER)),
        f"{LAUNCHER} --standalone --nproc-per-node=2 -m experiments.{path.stem}",
    )
    return Experiment(path.stem, description, launch, kind)


def experiments(folder: Path = FOLDER) -> list[Experiment]:
    kinds = {path: kind_of(path) for path in sorted(folder.glob("*.py"))}
    return [describe(path, kind) for path, kind in kinds.items() if kind is not None]


def listing(found: list[Experiment]) -> str:
    width = max((len(e.name) for e in found), default=0)
    out = ["Launch from the repository root; every option: python -m experiments.NAME --help", ""]
    for title, kind in (
        ("Training experiments (checkpoint, resume, metrics.json):", TRAINING),
        ("Demos (train nothing):", DEMO),
        ("Tools (train nothing):", TOOL),
    ):
        out.append(title)
        for e in (e for e in found if e.kind == kind):
            out.append(f"  {e.name:<{width}}  {e.description}")
            out.append(f"  {'':<{width}}  {e.launch}")
        out.append("")
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__.splitlines()[0])
        return 0
    if args:
        print(
            f"error: python -m experiments takes no arguments (got {' '.join(args)}): run python -m experiments.NAME",
            file=sys.stderr,
        )
        return 2
    print(listing(experiments()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
