"""``--launcher slurm``'s two halves agree without a cluster: the task lines tools.study.slurm writes are
read back by each batch script's own STUDY_TASKS block (run by bash as written in the script) into the same
run directory and flags; the scripts' default exports are what the study parses its runs' flags with."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ddp_core.errors import ConfigError
from tools.study import Combination, Study, Task
from tools.study.slurm import script_defaults, submit, task_lines

SCRIPTS = ["docker/slurm.sbatch", "docker/slurm-cpu.sbatch"]
ODD_VALUES = ["a b", "it's", '"quoted"', "$HOME", "*", "--x=1;echo no", "é"]


def _study(tmp_path: Path, flags: list[str], values: list[str]) -> tuple[Study, list[Task]]:
    study = Study("toy", "odd", tmp_path / "odd", 2, {"tag": values}, 2, flags, "slurm")
    tasks = [
        Task(combination, seed, tmp_path / "odd" / combination.folder / f"seed-{seed}", tmp_path / "log", None)
        for combination in (Combination((("tag", value),)) for value in values)
        for seed in range(2)
    ]
    return study, tasks


def _task_block(script: str) -> str:
    """The script's own lines that read a task: from `if [[ -n "${STUDY_TASKS` to its `fi`."""
    text = Path(script).read_text()
    block = re.search(r'^if \[\[ -n "\$\{STUDY_TASKS.*?^fi$', text, re.S | re.M)
    assert block, f"{script}: no STUDY_TASKS block"
    return block.group(0)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_task_reads_back_its_run_directory_and_flags(script, tmp_path):
    study, tasks = _study(tmp_path, ["--steps", "150", "--note=x y"], ODD_VALUES)
    lines = task_lines(study, tasks)
    file = tmp_path / "tasks.tsv"
    file.write_text("\n".join(lines) + "\n")
    # What the script then does with them: RUN_DIR, and "$@" handed to the experiment (here printed one per line,
    # NUL-separated, with the script's own arguments after the task's flags).
    program = f'{_task_block(script)}\nprintf "%s\\0" "$RUN_DIR" "$@"'
    for index, task in enumerate(tasks):
        shown = subprocess.run(
            ["bash", "-c", program, "script", "--own-flag"],
            env={"STUDY_TASKS": str(file), "SLURM_ARRAY_TASK_ID": str(index), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            check=True,
        )
        run_dir, *argv = shown.stdout.decode().split("\0")[:-1]
        assert run_dir == str(task.run_dir.resolve())
        assert argv == [*study.flags, *task.combination.argv, "--seed", str(task.seed), "--own-flag"]


@pytest.mark.parametrize(("flags", "values"), [(["--note", ""], ["1"]), ([], ["a\tb"]), ([], ["a\nb"])])
def test_a_flag_a_task_line_cannot_carry_is_refused(flags, values, tmp_path):
    study, tasks = _study(tmp_path, flags, values)
    with pytest.raises(ConfigError, match="empty or holds a tab or a newline"):
        task_lines(study, tasks)


def test_the_cpu_script_exports_gloo_and_no_run_directory(tmp_path):
    assert script_defaults("docker/slurm-cpu.sbatch")["BACKEND"] == "gloo"
    assert all("RUN_DIR" not in script_defaults(script) for script in SCRIPTS)
    lines = tmp_path / "s.sbatch"
    lines.write_text("export A=${A:-1}\nexport B=${B:-$HOME}\n  export C=${C:-x y}\nexport D=${E:-2}\n")
    # A plain default is read; one built from another variable is not (its value is the node's), nor a mismatch.
    assert script_defaults(str(lines)) == {"A": "1", "C": "x y"}
    assert script_defaults(str(tmp_path / "missing")) == {}


@pytest.mark.parametrize(("parallel", "array"), [(None, "--array=0-3"), (2, "--array=0-3%2")])
def test_parallel_throttles_the_array(tmp_path, monkeypatch, parallel, array):
    """``--parallel N`` is Slurm's own throttle (``%N``): at most N tasks of the array run at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$(dirname "$0")/args"\necho 42\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    study, tasks = _study(tmp_path, [], ["1", "2"])
    study.dir.mkdir(parents=True)
    assert submit(study, tasks, "docker/slurm-cpu.sbatch", [], parallel) == "42"
    assert array in (bin_dir / "args").read_text().splitlines()
