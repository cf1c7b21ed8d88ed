"""A resume is one command: ``--resume --run-dir DIR`` continues the run with the options its checkpoint recorded.

The options that change the computation come from the checkpoint, but for those the command line or the environment
set (``given_options``): ``start_run`` compares these with the checkpoint's and refuses a difference unless
--allow-config-change. The other options (where the run writes, how often it logs, where it stops) are this launch's;
a run started with --nproc N resumes with N processes. A finished run is said to be one and left as it is."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, TypeVar

from ddp_core.config import config_changes, given_options, options
from ddp_core.errors import RunStoppedError
from ddp_core.layout import CHECKPOINTS, METRICS
from ddp_core.output.checkpoint import CheckpointDir, CheckpointFileArgs, Written, written_by
from ddp_core.ranks import is_local_rank0

A = TypeVar("A")


def resumed_args(experiment: str, args: A) -> A:
    """``args`` with the checkpoint's values of the options that change the computation and were not set, and its
    world size as --nproc where it was started so; ``args`` as they are without a resume, without parse_args' record
    of what was set, or without a checkpoint of ``experiment`` that loads (start_run then says why)."""
    given = given_options(args)
    found = _checkpoint(args)
    if given is None or found is None or found[1].experiment not in (None, experiment) or not found[1].config:
        return args
    written = found[1]
    config: dict[str, Any] = written.config  # type: ignore[assignment]
    resumed = copy.copy(args)  # keeps parse_args' record: start_run names the options that were set
    for f in options(args):
        if f.metadata.get("computation", True) and f.name not in given and f.name in config:
            setattr(resumed, f.name, config[f.name])
    started_with_nproc = config.get("nproc") == written.world_size > 1
    under_a_launcher = "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if "nproc" not in given and started_with_nproc and not under_a_launcher and hasattr(resumed, "nproc"):
        resumed.nproc = written.world_size  # type: ignore[attr-defined]
    return resumed


def answered_finished(args: Any) -> bool:
    """A --resume of a run that has ended (its metrics.json), from its newest checkpoint and with no option changed:
    one line (each node's first process), and nothing to run, so that no file of the run changes. Not on several
    nodes, where one without the run directory would wait for the others: rank 0 says it then (lifecycle/parts.py)."""
    found = _checkpoint(args)
    several_nodes = os.environ.get("WORLD_SIZE", "") != os.environ.get("LOCAL_WORLD_SIZE", "")  # torchrun's
    if found is None or not isinstance(args, CheckpointFileArgs) or several_nodes:
        return False
    path, written = found
    holder = path.parent.parent if path.parent.name == CHECKPOINTS else None  # RUN/checkpoints/FILE's run, if any
    run_dir = Path(args.run_dir) if getattr(args, "run_dir", "") else holder
    newest = CheckpointDir.of_run(run_dir).newest() if run_dir is not None else None
    if run_dir is None or newest is None or not (run_dir / METRICS).is_file() or path.resolve() != newest.resolve():
        return False  # --resume-from an earlier file goes on from there (the later ones are set aside)
    if config_changes(written.config or {}, args):
        return False  # a changed run (a longer --steps) continues, or is refused naming the change
    if is_local_rank0():
        print(AlreadyFinished(run_dir), flush=True)
    return True


class AlreadyFinished(RunStoppedError):
    """A resume of an ended run with no step left (a changed option that does not lengthen it): one line, exit 0."""

    exit_code = 0

    def __init__(self, run_dir: Path) -> None:
        super().__init__(
            f"{run_dir} has finished ({METRICS} holds its end): nothing to continue, every file left as it was; to "
            "train it longer, resume with a longer run (--steps, --epochs) and --allow-config-change"
        )


def _checkpoint(args: Any) -> tuple[Path, Written] | None:
    """The checkpoint a resume continues from (--resume-from's file, else the run's newest that loads) and what it
    recorded; None without a resume or a checkpoint that loads."""
    if not isinstance(args, CheckpointFileArgs) or not (args.resume or args.resume_from):
        return None
    if args.resume_from:
        candidates = [Path(args.resume_from)]
    elif getattr(args, "run_dir", ""):
        checkpoints = CheckpointDir.of_run(args.run_dir)  # type: ignore[attr-defined]
        candidates = [path for _, path in checkpoints.complete()] + [checkpoints.last]
    else:
        return None
    for path in candidates:
        written = written_by(path) if path.is_file() else None
        if written is not None:
            return path, written
    return None
