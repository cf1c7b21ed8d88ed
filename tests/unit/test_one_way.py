"""Rank 0's work is decided one way: ``on_rank0`` (nothing sent) or ``rank0_decides`` (its outcome broadcast), and
output through ddp_core/output/logging.py's gates (the log's rank filter, print0, the writer, the bar).

The test they key on, ``is_global_rank0()``, is read only by the modules below; any other rank-0 gate goes through
the helpers, tools and bench included.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ("ddp_core", "experiments", "tools", "bench")
NAME = "is_global_rank0"
READS_IT = {
    "ddp_core/ranks.py": "defines it, and on_rank0 on it",
    "ddp_core/output/logging.py": "output's gates: the log's rank filter, print0, the writer, the progress bar",
    "ddp_core/errors.py": "who prints a one-line error: a yes or no per kind of error, not work to run",
    "ddp_core/config.py": "while parsing, before any group: only rank 0's output folder must be writable",
    "tools/write_audit.py": "a test instrument: which ranks it watches",
}
AT_MOST = 6


def readers(files: dict[str, str]) -> set[str]:
    """The files (repo-relative path: text) that name ``is_global_rank0``."""
    return {path for path, text in files.items() if NAME in text}


def code_files() -> dict[str, str]:
    return {
        path.relative_to(REPO).as_posix(): path.read_text()
        for root in CODE
        for path in sorted((REPO / root).rglob("*.py"))
    }


def test_is_global_rank0_is_read_only_by_the_modules_allowed():
    assert len(READS_IT) <= AT_MOST
    assert readers(code_files()) - READS_IT.keys() == set(), "gate rank 0's work with on_rank0 or rank0_decides"


def test_the_allowed_modules_exist():
    assert {path for path in READS_IT if not (REPO / path).is_file()} == set()


def test_a_gate_of_its_own_is_caught():
    files = {
        "ddp_core/ranks.py": "def is_global_rank0() -> bool: ...",
        "tools/commbench.py": "from ddp_core.ranks import is_global_rank0\nif is_global_rank0():\n    print(x)",
        "bench/comm_probe.py": "rank0_decides(lambda: path.write_text(text))",
        "experiments/charlm.py": "sample = on_rank0(lambda: generate(net))",
    }
    assert readers(files) - READS_IT.keys() == {"tools/commbench.py"}
