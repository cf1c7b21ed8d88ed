"""The code that ran, kept with the run: a copy of the experiment's file and the working tree's ``git diff HEAD``.

A commit and a "dirty" flag do not say what ran: a new experiment file is untracked, so every run of it is dirty
and its code would be nowhere. Rank 0 writes both as the run directory is made (``RunDir.create``); the manifest
names them (docs/configuration.md, "The run directory").
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from ddp_core.layout import CODE, GIT_DIFF

DIFF_LIMIT = 1 << 20  # bytes of the diff kept: a few thousand changed lines; past it the file is cut and says so
GIT_TIMEOUT_S = 10.0


def file_of(fn: Callable[..., Any] | None) -> Path | None:
    """The source file of the module that defines ``fn`` (an experiment's ``train``), else ``__main__``'s."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = sys.modules.get(getattr(fn, "__module__", None) or "__main__")
    path = getattr(module, "__file__", None)
    return Path(path) if path else None


def keep_code(run_dir: Path, experiment: Path | None, repository: Path) -> dict[str, Any]:
    """Rank 0: ``CODE/<experiment's file name>`` and ``CODE/GIT_DIFF`` written; what the manifest records of them."""
    folder = run_dir / CODE
    folder.mkdir(parents=True, exist_ok=True)
    kept: dict[str, Any] = {"experiment": None, "experiment_source": str(experiment) if experiment else None}
    if experiment is not None and experiment.is_file():
        (folder / experiment.name).write_bytes(experiment.read_bytes())
        kept["experiment"] = f"{CODE}/{experiment.name}"
    diff, problem = _diff(repository)
    if diff is None:
        return {**kept, "diff": None, "diff_note": problem}
    truncated = len(diff) > DIFF_LIMIT
    if truncated:
        diff = diff[:DIFF_LIMIT] + f"\n[cut at {DIFF_LIMIT} bytes: git diff HEAD in {repository} has more]\n".encode()
    (folder / GIT_DIFF).write_bytes(diff)
    return {**kept, "diff": f"{CODE}/{GIT_DIFF}", "diff_truncated": truncated}


def _diff(repository: Path) -> tuple[bytes | None, str]:
    """The tracked files' changes against HEAD (at most DIFF_LIMIT + 1 bytes read), or None and why there is none."""
    command = ["git", "-C", str(repository), "diff", "HEAD", "--no-color", "--no-ext-diff"]
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as git:
            assert git.stdout is not None
            diff = git.stdout.read(DIFF_LIMIT + 1)
            if len(diff) > DIFF_LIMIT:
                git.kill()  # the rest is not kept: never wait for a diff of a large tree
            try:
                code = git.wait(timeout=GIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                git.kill()  # else leaving the block would wait for it without a limit
                raise
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"git could not run ({error}): no diff kept"
    if code != 0 and len(diff) <= DIFF_LIMIT:
        return None, f"{repository} is not a git working tree (or has no commit): no diff kept"
    return diff, ""
