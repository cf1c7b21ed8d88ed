"""The one entry point of every ddp-lab program: an experiment, a demo, a tool, a benchmark.

    main = entry_main(MyArgs, work, doc=__doc__, validate=validate)      # runs in every process of the job
    main = command_main(MyArgs, work, doc=__doc__)                      # runs in this process only
    if __name__ == "__main__":
        main.run_and_exit()

``main(argv)`` (tests call it in-process) parses the flags into ``MyArgs``, checks them (``validate``: what spans
several options; every process of a node finds the same problem, so the node says it once), then runs
``work(args)``: under ``launch`` (torchrun's processes, a world of one, or ``--nproc`` local ones), or as it is for a
command. A ConfigError is one line and exit 2 (``exits_with_one_line``); any other exception reaches torchrun's
error summary (``@record``). An experiment's entry point is one of these (``ddp_core.experiment.experiment_main``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

from torch.distributed.elastic.multiprocessing.errors import record

from ddp_core import observers
from ddp_core.config import parse_args
from ddp_core.errors import alike_on_the_node, exits_with_one_line
from ddp_core.process.exit import run_and_exit
from ddp_core.process.launch import launch

A = TypeVar("A")
R = TypeVar("R")


@dataclass(frozen=True)
class EntryMain(Generic[A, R]):
    """``main(argv)`` in tests, ``main.run_and_exit()`` under ``__main__``."""

    args_type: type[A]
    work: Callable[[A], R]
    description: str
    validate: Callable[[A], None] | None = None
    answer: Callable[[A], bool] | None = None  # True: it answered without any process (a --list), nothing to run
    resolve: Callable[[A], A] | None = None  # the arguments the work runs with (a resume: the checkpoint's options)
    launched: bool = True  # False: a command, run in this process only

    def __call__(self, argv: list[str] | None = None) -> R | None:
        return (_worker_main if self.launched else _main)(self, argv)

    def check(self, args: A) -> None:
        """What is checked before any process starts (a ConfigError, exit 2)."""
        if self.validate is not None:
            self.validate(args)

    def run_and_exit(self) -> NoReturn:
        if self.launched:
            run_and_exit(self)  # a finished worker leaves before gloo's teardown can abort it (docs/design.md)
        result = self()
        raise SystemExit(result if isinstance(result, int) else 0)  # a command's own code, where it returns one


@exits_with_one_line  # a ConfigError is one line and exit code 2
def _main(main: EntryMain[A, R], argv: list[str] | None) -> R | None:
    observers.mark("imported")  # the interpreter is up, torch and the program imported (bench.recovery)
    args = parse_args(main.args_type, argv, description=main.description)
    if main.resolve is not None:
        with alike_on_the_node():  # every process of a node reads the same run directory
            args = main.resolve(args)
    if main.answer is not None and main.answer(args):
        return None
    with alike_on_the_node():  # every process of a node checks the same flags: a bad one is one line per node
        main.check(args)
    return launch(main.work, args) if main.launched else main.work(args)  # type: ignore[arg-type]


_worker_main = record(_main)  # a worker's traceback reaches torchrun's error summary


def entry_main(
    args_type: type[A],
    work: Callable[[A], R],
    *,
    doc: str | None,
    validate: Callable[[A], None] | None = None,
    answer: Callable[[A], bool] | None = None,
    resolve: Callable[[A], A] | None = None,
) -> EntryMain[A, R]:
    """The entry point that runs ``work(args)`` in every process; ``doc``'s first line is ``--help``'s."""
    return EntryMain(args_type, work, _first_line(doc, args_type), validate, answer, resolve)


def command_main(
    args_type: type[A], work: Callable[[A], R], *, doc: str | None, validate: Callable[[A], None] | None = None
) -> EntryMain[A, R]:
    """The entry point of a command that runs ``work(args)`` in this process only (a benchmark, a report); its
    ``run_and_exit`` exits with what ``work`` returns where that is an int, else 0."""
    return EntryMain(args_type, work, _first_line(doc, args_type), validate, launched=False)


def _first_line(doc: str | None, args_type: type) -> str:
    return (doc or args_type.__name__).strip().splitlines()[0]
