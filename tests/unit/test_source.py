"""The code kept with a run (ddp_core/output/source.py): the experiment's file, the working tree's diff, cut at
its limit, and a note where there is no repository. A toy run's code/ folder: tests/e2e/test_toy.py."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from ddp_core.layout import CODE, GIT_DIFF
from ddp_core.output import source


def git(repository: Path, *args: str) -> None:
    identity = ("-c", "user.name=t", "-c", "user.email=t@t")
    subprocess.run(["git", "-C", str(repository), *identity, *args], check=True, capture_output=True)


def repository_with_a_change(tmp_path: Path, lines: int) -> Path:
    repository = tmp_path / "repository"
    repository.mkdir()
    git(repository, "init", "-q")
    (repository / "tracked.py").write_text("x = 1\n")
    git(repository, "add", "tracked.py")
    git(repository, "commit", "-q", "-m", "first")
    (repository / "tracked.py").write_text("".join(f"x = {i}\n" for i in range(lines)))
    return repository


def test_the_experiment_file_and_the_diff_are_kept_and_named(tmp_path: Path):
    repository = repository_with_a_change(tmp_path, 3)
    experiment = tmp_path / "mine.py"  # untracked, as a new experiment is
    experiment.write_text("print('mine')\n")
    kept = source.keep_code(tmp_path / "run", experiment, repository)
    assert kept == {
        "experiment": f"{CODE}/mine.py",
        "experiment_source": str(experiment),
        "diff": f"{CODE}/{GIT_DIFF}",
        "diff_truncated": False,
    }
    assert (tmp_path / "run" / CODE / "mine.py").read_text() == "print('mine')\n"
    diff = (tmp_path / "run" / CODE / GIT_DIFF).read_text()
    assert diff.startswith("diff --git a/tracked.py") and "+x = 2\n" in diff


def test_a_large_diff_is_cut_and_says_so(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(source, "DIFF_LIMIT", 100)
    repository = repository_with_a_change(tmp_path, 10_000)
    kept = source.keep_code(tmp_path / "run", None, repository)
    assert kept["diff_truncated"] is True and kept["experiment"] is None
    diff = (tmp_path / "run" / CODE / GIT_DIFF).read_bytes()
    kept_part, _, note = diff.partition(b"\n[cut at 100 bytes: git diff HEAD in ")
    assert kept_part.startswith(b"diff --git") and len(kept_part) == 100 and note.endswith(b"has more]\n")


def test_without_a_repository_the_manifest_says_why_there_is_no_diff(tmp_path: Path):
    kept = source.keep_code(tmp_path / "run", None, tmp_path)
    assert kept["diff"] is None and "not a git working tree" in kept["diff_note"]
    assert not (tmp_path / "run" / CODE / GIT_DIFF).exists()


def train(run, args) -> None: ...


def test_the_experiment_file_is_the_train_function_s_module():
    assert source.file_of(functools.partial(train, None)) == Path(__file__)
