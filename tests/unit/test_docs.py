"""The commands in README.md and docs/ are checked against the code, so a renamed flag, target, file or
variable fails here instead of in a user's shell.

Every line of every ```bash block is read as a shell command (continuation lines joined, comments
dropped) and what can be checked is:

- ``make TARGET VAR=...``: the target is in the Makefile, and each variable is one the Makefile reads;
- ``python -m MODULE`` / ``torchrun ... -m MODULE`` (``.venv/bin/`` or not, through ``ddp_core.torchrun``
  or not): torchrun's own flags are torchrun's, and each ``--flag`` after the module is in that module's
  ``--help`` (flags after ``--`` belong to another program and are left alone);
- every repository path (``docker/...``, ``experiments/...``, ``.env.example``) exists;
- every ``NAME=value`` in front of a command or after ``export`` names a variable the code, the Makefile,
  compose or the sbatch files read.

And the other way round: every variable the Python code reads by name is in ``.env.example`` or in
``INTERNAL`` below, with why it is not there.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import prefork

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
USERS_OWN = {"experiments.mine", "mine"}  # the experiment a reader makes with `make new-experiment NAME=mine`
LAUNCHERS = {"torch.distributed.run", "ddp_core.torchrun"}
PATH_ROOTS = (
    "bench/",
    "ddp_core/",
    "docker/",
    "docker-compose",
    "docs/",
    "experiments/",
    "tests/",
    "tools/",
    ".env.example",
    ".ci/",
)
# Read from the environment by the code, but not for a user to set in .env: why, for each.
INTERNAL = {
    "CUDA_VISIBLE_DEVICES": "CUDA's own; the code only reads whether it hides every GPU",
    "GROUP_RANK": "set by torchrun for each node's agent",
    "TORCHELASTIC_RUN_ID": "set by torchrun: tells a worker it runs under torchrun",
    "TORCHELASTIC_ERROR_FILE": "set by torchrun: where @record keeps a traceback, which ddp_core.torchrun prints",
    "NCCL_DEBUG_FILE": "NCCL's own: the preflight points it at a file to read which transport NCCL chose",
    "NCCL_IB_DISABLE": "NCCL's own: set by docker/compose.multihost.yml; the preflight reports it",
    "TORCHELASTIC_USE_AGENT_STORE": "set by torchrun: whether the agent hosts the rendezvous store",
    "CUBLAS_WORKSPACE_CONFIG": (
        "CUDA's own: --deterministic sets it, unless it is set already, as cuBLAS needs for repeatable results"
    ),
    "OMP_NUM_THREADS": (
        "OpenMP's own: --nproc and the contract's CPU runs default it to 1 as torchrun does, keeping a value the "
        "caller set"
    ),
    "DDP_LAB_TRACE": "set by the contract for its runs: where each rank records what it trained each step on",
    "STUDY_TASKS": "set by a study's Slurm array or Kubernetes Job: the file of its runs, one per task",
    "JOB_COMPLETION_INDEX": "set by Kubernetes in each pod of an Indexed Job: which line of STUDY_TASKS it runs",
    "KINETO_LOG_LEVEL": (
        "torch's profiler's own: --profile on CPU defaults it to 5, unless it is set already, so that a CUDA build "
        "without GPUs logs no false ERROR line"
    ),
    "GLIBC_TUNABLES": "glibc's own: with malloc tunables in it, the user chose how memory is kept (ddp_core.training."
    "host_memory then changes nothing)",
    "LD_PRELOAD": "the dynamic loader's own: another allocator preloaded (jemalloc, tcmalloc) is kept as it is",
    "RUST_LOG": "torchft's logger's own: --heal defaults it to warn, unless it is set already (info: every quorum)",
}
# Read by torch, NCCL or the shell, not by ddp-lab's files, and named in the docs on purpose.
OTHERS = {
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "TORCH_DISTRIBUTED_DEBUG",
    "OMP_NUM_THREADS",
}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    words: tuple[str, ...]


COMMAND_SPAN = re.compile(r"(?<!`)`((?:make|python3?|torchrun|\.venv/bin/(?:python|torchrun)) [^`]+)`(?!`)")


def shell_commands(markdown: str, name: str) -> list[Command]:
    """Every command of the ```bash blocks (continuation lines joined, comments and blank lines dropped),
    and every inline code span outside them that starts with make, python or torchrun."""
    commands = []
    prose = re.sub(r"^```.*?^```", lambda block: "\n" * block[0].count("\n"), markdown, flags=re.S | re.M)
    for span in COMMAND_SPAN.finditer(prose):
        try:
            words = shlex.split(span[1])
        except ValueError:
            continue  # a fragment, not a whole command
        commands.append(Command(f"{name}:{prose[: span.start()].count(chr(10)) + 1}", tuple(words)))
    for block in re.finditer(r"^```bash\n(.*?)^```", markdown, re.S | re.M):
        first_line = markdown[: block.start()].count("\n") + 2
        text = block[1].replace("\\\n", " ")
        for offset, line in enumerate(text.splitlines()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError as error:
                raise AssertionError(f"{name}:{first_line + offset}: not a shell line ({error}): {line}") from None
            if words:
                commands.append(Command(f"{name}:{first_line + offset}", tuple(words)))
    return commands


@functools.cache
def makefile() -> str:
    return (REPO / "Makefile").read_text()


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", makefile(), re.M))


@functools.cache
def module_flags(module: str) -> frozenset[str]:
    """The --flags a module's --help lists (its parser, whatever builds it), from a process forked with torch
    imported already (tests/prefork.py): a real interpreter per module spent most of this file's minute."""
    return help_flags(module, python=prefork.python())


def help_flags(module: str, python: str = sys.executable, **env: str) -> frozenset[str]:
    """``env`` reaches a real interpreter only (a forked child keeps its server's ``sys.path``)."""
    result = subprocess.run(
        [python, "-m", module, "--help"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"python -m {module} --help exited {result.returncode}: {result.stderr[-500:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", result.stdout))


@functools.cache
def torchrun_flags() -> frozenset[str]:
    from torch.distributed.run import get_args_parser

    flags = {option for action in get_args_parser()._actions for option in action.option_strings}
    return frozenset(flags | {flag.replace("-", "_") for flag in flags} | {flag.replace("_", "-") for flag in flags})


@functools.cache
def variables_read() -> str:
    """The text of every file that may read a variable: code, Makefile, compose, Dockerfiles, sbatch, k8s."""
    files = [
        *REPO.glob("ddp_core/**/*.py"),
        *REPO.glob("experiments/**/*.py"),
        *REPO.glob("tools/**/*.py"),
        *REPO.glob("bench/**/*.py"),
        REPO / "Makefile",
        *REPO.glob("docker-compose*.yml"),
        *REPO.glob("docker/**/*"),
    ]
    return "\n".join(path.read_text(errors="replace") for path in files if path.is_file())


def flags_of(words: list[str]) -> list[str]:
    """The --flags among ``words``, up to a ``--`` (what follows is another program's)."""
    flags = []
    for word in words:
        if word == "--":
            break
        if word.startswith("--"):
            flags.append(word.split("=", 1)[0])
    return flags


def problems(command: Command) -> list[str]:
    """What in ``command`` does not match the repository; empty when all of it does."""
    words, found = list(command.words), []
    if words[:1] == ["export"]:
        words.pop(0)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name = words.pop(0).split("=", 1)[0]
        if name not in OTHERS and not re.search(rf"\b{name}\b", variables_read()):
            found.append(f"{name} is set, but nothing in the repository reads it")
    for word in command.words:
        path = word.rstrip(".,;:)")
        if path.startswith(PATH_ROOTS) and "*" not in path and "<" not in path and not (REPO / path).exists():
            found.append(f"{path} does not exist")
    if not words:
        return found
    program = Path(words[0]).name
    if program == "make":
        for word in words[1:]:
            if "=" in word:
                name = word.split("=", 1)[0]
                if not re.search(rf"\$\({name}\)|^{name} \?=", makefile(), re.M):
                    found.append(f"make variable {name} is not read by the Makefile")
            elif not word.startswith("-") and word not in make_targets():
                found.append(f"make target {word} is not in the Makefile")
        return found
    if program in ("torchrun", "python", "python3") or program.startswith("python3."):
        rest, own = words[1:], set()
        launcher = program == "torchrun"
        if not launcher:
            if len(rest) < 2 or rest[0] != "-m":
                return found
            module, rest = rest[1], rest[2:]
            launcher = module in LAUNCHERS
            own = {"--heal"} if module == "ddp_core.torchrun" else set()  # ddp_core.torchrun's own flag
            if not launcher:
                return found + module_problems(module, rest)
        if "-m" not in rest:
            return found
        split = rest.index("-m")
        for flag in flags_of(rest[:split]):
            if flag not in torchrun_flags() | own:
                found.append(f"torchrun has no flag {flag}")
        if split + 1 < len(rest):
            found += module_problems(rest[split + 1], rest[split + 2 :])
    return found


def module_problems(module: str, args: list[str]) -> list[str]:
    if (
        module in USERS_OWN or module.split(".")[-1].isupper() or "..." in args
    ):  # the reader's own, a placeholder (experiments.NAME)
        return []
    if (
        not (REPO / Path(*module.split("."))).with_suffix(".py").is_file()
        and not (REPO / Path(*module.split(".")) / "__main__.py").is_file()
    ):
        return [] if module.split(".")[0] in ("torch", "tensorboard") else [f"module {module} is not in the repository"]
    flags = flags_of(args)
    known = module_flags(module) if flags else frozenset()  # `python -m bench` has no parser: it runs
    return [f"python -m {module} has no flag {flag}" for flag in flags if flag not in known]


def all_commands() -> list[Command]:
    return [command for path in DOCS for command in shell_commands(path.read_text(), path.relative_to(REPO).as_posix())]


def test_every_documented_command_matches_the_code():
    commands = all_commands()
    assert len(commands) > 30  # the blocks were found
    found = [f"{command.where}: {problem}" for command in commands for problem in problems(command)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --checkpoint-evry 5",
            "python -m experiments.cifar10 has no flag --checkpoint-evry",
        ),
        (
            ".venv/bin/python -m ddp_core.torchrun --nnodes=2 --nodes-rank=1 -m experiments.toy",
            "torchrun has no flag --nodes-rank",
        ),
        ("python -m experiments.toy --stepz 5", "python -m experiments.toy has no flag --stepz"),
        ("make trian", "make target trian is not in the Makefile"),
        ("make train NPROCS=3", "make variable NPROCS is not read by the Makefile"),
        ("sbatch docker/slurm-gpu.sbatch", "docker/slurm-gpu.sbatch does not exist"),
        ("DIST_TIMEOUT=60 make train", "DIST_TIMEOUT is set, but nothing in the repository reads it"),
        ("export DIST_INIT_TIMEOUT=600", "DIST_INIT_TIMEOUT is set, but nothing in the repository reads it"),
        ("docker compose -f docker-compose.yaml up trainer", "docker-compose.yaml does not exist"),
    ],
)
def test_a_renamed_flag_target_file_or_variable_is_caught(line, expected):
    """Negative controls: each line is a real one with one name changed the way a rename would."""
    commands = shell_commands(f"```bash\n{line}\n```\n", "doc.md")
    assert problems(commands[0]) == [expected]


def test_an_inline_command_in_prose_is_checked_too():
    prose = "Resume often: `torchrun --standalone -m experiments.cifar10 --checkpoint-every-steps 5` keeps more.\n"
    assert [problems(command) for command in shell_commands(prose, "doc.md")] == [
        ["python -m experiments.cifar10 has no flag --checkpoint-every-steps"]
    ]


def test_the_same_lines_as_they_are_pass():
    for line in (
        "torchrun --standalone --nproc-per-node=2 -m experiments.cifar10 --checkpoint-every 5",
        "python -m tools.contract experiments.mine -- --hidden 32",
        "EXPERIMENT=cifar10 make train NPROC=2 ARGS='--epochs 1'",
    ):
        assert problems(shell_commands(f"```bash\n{line}\n```\n", "doc.md")[0]) == [], line


def test_a_flag_renamed_in_the_code_fails_every_doc_line_that_still_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The rename is real: a copy of experiments/toy.py whose length in steps is its own ``total_steps`` option,
    not the shared ``steps``. The docs, unchanged, now fail wherever they give the toy --steps, and nowhere else."""
    source = (REPO / "experiments" / "toy.py").read_text()
    shared, own = "(StepsArgs, TrainingArgs):\n", '(TrainingArgs):\n    total_steps: int = option(200, "steps")\n'
    assert shared in source and "\n    steps: int = 200" in source
    (tmp_path / "toy_renamed.py").write_text(
        source.replace(shared, own)
        .replace("\n    steps: int = 200", "\n    seed: int = 0")
        .replace("args.steps", "args.total_steps")
    )
    renamed = help_flags("toy_renamed", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    assert "--total-steps" in renamed and "--steps" not in renamed
    real = module_flags
    monkeypatch.setattr(
        sys.modules[__name__], "module_flags", lambda module: renamed if module == "experiments.toy" else real(module)
    )
    found = [f"{command.where}: {problem}" for command in all_commands() for problem in problems(command)]
    assert found and all(problem.endswith("python -m experiments.toy has no flag --steps") for problem in found), found


def test_every_variable_the_code_reads_is_in_env_example_or_internal():
    code = "\n".join(
        path.read_text()
        for pattern in ("ddp_core/**/*.py", "experiments/**/*.py", "tools/**/*.py")
        for path in REPO.glob(pattern)
    )
    read = set(re.findall(r'env="([A-Z][A-Z0-9_]+)"', code))  # an option's variable
    # environ["X"], env.get("X"), environ.setdefault("X", ...), and helpers called as f(environ, "X", ...)
    read |= set(
        re.findall(
            r'\b(?:environ|env|environment)(?:\.get|\.pop|\.setdefault)?[\[(]\s*["\']([A-Z][A-Z0-9_]+)["\']', code
        )
    )
    read |= set(re.findall(r'\w\(\s*(?:os\.)?(?:environ|env|environment),\s*["\']([A-Z][A-Z0-9_]+)["\']', code))
    read |= set(re.findall(r'getenv\(\s*["\']([A-Z][A-Z0-9_]+)["\']', code))
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M))
    assert read - documented - set(INTERNAL) == set()
    assert set(INTERNAL) <= read  # no stale entry


# What compose deliberately does not pass to the containers, and why.
NOT_UNDER_DOCKER = {"DATA_DIR": "the data is always /app/data in a container, the DATA_VOLUME mount"}


def test_every_experiment_variable_reaches_the_containers():
    """A line of .env that an experiment reads must do the same under `docker compose`: compose passes it."""
    code = "\n".join(
        path.read_text()
        for pattern in ("ddp_core/**/*.py", "experiments/**/*.py", "tools/**/*.py")
        for path in REPO.glob(pattern)
    )
    experiment_variables = set(re.findall(r'env="([A-Z][A-Z0-9_]+)"', code)) | {"LOG_ALL_RANKS"}
    compose = (REPO / "docker-compose.yml").read_text()
    missing = {name for name in experiment_variables if not re.search(rf"^  {name}: \$\{{{name}:-", compose, re.M)}
    assert missing == set(NOT_UNDER_DOCKER)


def test_make_variables_are_not_offered_in_env_example():
    """The Makefile reads only NPROC from .env (ddp_core/process/nproc.py), so another make variable there would
    do nothing."""
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M))
    make_only = {"ARGS", "TB_PORT", "PYTHON", "TEST_WORKERS", "RUNS_DIR", "N", "NAME"}
    assert documented & make_only == set()


def test_the_readme_is_a_front_page_whose_exit_codes_are_the_codes():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    from ddp_core import exit_codes

    stated = [line.replace("``", "`") for line in exit_codes.__doc__.splitlines() if line.startswith("| ")]
    table = [line for line in readme.split("## Exit codes", 1)[1].splitlines() if line.startswith("| ")]
    assert table == [line for line in stated], "README's exit codes differ from ddp_core/exit_codes.py's"


DOCS_LINE_BUDGET = 2000  # README.md and docs/*.md together, reference.md included: a fact is stated once


def test_the_readme_and_docs_stay_within_their_line_budget():
    counts = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in DOCS}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda item: -item[1])[:3])
    assert total <= DOCS_LINE_BUDGET, (
        f"README.md + docs/*.md hold {total} lines, over {DOCS_LINE_BUDGET} (largest: {largest}): cut repetition "
        "and history rather than add (figures in docs/benchmarks.md, reasons in docs/decisions.md)"
    )


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_leads_somewhere():
    broken = []
    for path in DOCS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"(https?|mailto):", target):
                continue
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif fragment and linked.suffix == ".md":
                headings = {
                    anchor(h)
                    for h in re.findall(
                        r"^#+ (.+)$", re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.S | re.M), re.M
                    )
                }
                if fragment not in headings:
                    broken.append(f"{path.name}: {target} (no such heading)")
    assert broken == []


TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
TESTED_BY_DOCS = ("docs/faults.md", "docs/testing.md")


def functions_of(path: str) -> set[str]:
    """The test functions of a test file (top level or in a class), read with ast: nothing is imported."""
    import ast

    tree = ast.parse((REPO / path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def unresolved_test_ids(name: str, text: str) -> list[str]:
    """Each row of a table whose last column is "tested by" names at least one test id, and every test id the
    text names (tests/...py::test_name) is a test that exists."""
    found = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("|") and line.rstrip(" |").lower().endswith("tested by"):
            for row_number in range(number + 2, len(lines)):
                row = lines[row_number]
                if not row.startswith("|"):
                    break
                if not TEST_ID.search(row.rstrip(" |").rsplit(" | ", 1)[-1]):
                    found.append(f"{name}:{row_number + 1}: its tested-by cell names no test id (tests/...py::test_x)")
    for match in TEST_ID.finditer(text):
        where = f"{name}:{text[: match.start()].count(chr(10)) + 1}"
        if not (REPO / match[1]).is_file():
            found.append(f"{where}: {match[1]} does not exist")
        elif match[2] not in functions_of(match[1]):
            found.append(f"{where}: {match[1]} has no test {match[2]}")
    return found


def test_every_tested_by_entry_names_a_test_that_exists():
    found = [problem for name in TESTED_BY_DOCS for problem in unresolved_test_ids(name, (REPO / name).read_text())]
    assert found == [], "\n".join(found)


def test_a_renamed_test_or_a_row_without_an_id_is_caught():
    """Negative controls: a real id with its test renamed, a file that is not there, and a row naming none."""
    real = "tests/unit/test_docs.py::test_a_renamed_test_or_a_row_without_an_id_is_caught"
    table = f"| fault | tested by |\n|---|---|\n| a | `{real}` |\n"
    assert unresolved_test_ids("doc.md", table) == []
    assert unresolved_test_ids("doc.md", table.replace("is_caught`", "is_kaught`")) == [
        "doc.md:3: tests/unit/test_docs.py has no test test_a_renamed_test_or_a_row_without_an_id_is_kaught"
    ]
    assert unresolved_test_ids("doc.md", "see `tests/unit/test_nothing.py::test_x`") == [
        "doc.md:1: tests/unit/test_nothing.py does not exist"
    ]
    assert unresolved_test_ids("doc.md", "| fault | tested by |\n|---|---|\n| a | unit tests |\n") == [
        "doc.md:3: its tested-by cell names no test id (tests/...py::test_x)"
    ]
