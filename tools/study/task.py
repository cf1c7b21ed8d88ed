"""One run of a study's Indexed Job, each pod's command: line N+1 of ``STUDY_TASKS`` (N: ``JOB_COMPLETION_INDEX``)
as ``RUN_DIR`` and flags (``--resume`` where it holds a checkpoint), handed to the image's entrypoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from ddp_core.errors import ConfigError, exits_with_one_line


def read_task(environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """This pod's run directory and flags (``--resume`` added where it holds a checkpoint)."""
    from ddp_core.output.checkpoint import CheckpointDir

    tasks, index = environ.get("STUDY_TASKS", ""), environ.get("JOB_COMPLETION_INDEX", "")
    if not tasks or not index.isdigit():
        raise ConfigError(
            f"STUDY_TASKS={tasks!r}, JOB_COMPLETION_INDEX={index!r}: a study's pod needs both (its Job sets them)"
        )
    try:
        lines = Path(tasks).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"STUDY_TASKS={tasks}: {error.strerror} (the Job mounts it from its ConfigMap)") from None
    if int(index) >= len(lines):
        raise ConfigError(f"JOB_COMPLETION_INDEX={index}: {tasks} has {len(lines)} line(s), one per pod")
    run_dir, *flags = lines[int(index)].split("\t")
    if CheckpointDir.of_run(run_dir).exists():
        flags.append("--resume")
    return run_dir, flags


@exits_with_one_line
def main() -> None:
    from ddp_core import entrypoint

    run_dir, flags = read_task(os.environ)
    os.environ["RUN_DIR"] = run_dir
    entrypoint.main(flags)


if __name__ == "__main__":
    main()
