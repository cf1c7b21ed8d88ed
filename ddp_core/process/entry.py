"""The entry point of a module that runs in every process but is not a training run (a demo, a tool):
``main = entry_main(MyArgs, work, doc=__doc__)``; ``main(argv)`` in tests, ``main.run_and_exit()`` under __main__.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

from torch.distributed.elastic.multiprocessing.errors import record

from ddp_core.config import CommonArgs, parse_args
from ddp_core.errors import exits_with_one_line
from ddp_core.process.exit import run_and_exit
from ddp_core.process.launch import launch

A = TypeVar("A", bound=CommonArgs)
R = TypeVar("R")


@dataclass(frozen=True)
class EntryMain(Generic[A, R]):
    """``main(argv)`` in tests, ``main.run_and_exit()`` under ``__main__``."""

    args_type: type[A]
    work: Callable[[A], R]
    description: str
    validate: Callable[[A], None] | None = None
    answer: Callable[[A], bool] | None = None  # True: it answered without any process (a --list), nothing to run

    def __call__(self, argv: list[str] | None = None) -> R | None:
        return _main(self, argv)

    def run_and_exit(self) -> NoReturn:
        run_and_exit(self)  # a finished worker leaves before gloo's teardown can abort it (docs/design.md)


@record  # a worker's traceback reaches torchrun's error summary
@exits_with_one_line  # a ConfigError is one line and exit code 2
def _main(main: EntryMain[A, R], argv: list[str] | None) -> R | None:
    args = parse_args(main.args_type, argv, description=main.description)
    if main.answer is not None and main.answer(args):
        return None
    if main.validate is not None:
        main.validate(args)
    return launch(main.work, args)


def entry_main(
    args_type: type[A],
    work: Callable[[A], R],
    *,
    doc: str | None,
    validate: Callable[[A], None] | None = None,
    answer: Callable[[A], bool] | None = None,
) -> EntryMain[A, R]:
    """The entry point that runs ``work(args)`` in every process; ``doc``'s first line is ``--help``'s."""
    return EntryMain(args_type, work, (doc or args_type.__name__).strip().splitlines()[0], validate, answer)
