"""The code stays small enough to read: no file over 500 lines, no function over 60, ddp_core under a ceiling."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("ddp_core", "experiments", "tools")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60
CEILING = 12_000  # ddp_core's lines of Python at most: what a reader of a run has to trust


def sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for package in CHECKED
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_no_file_is_over_500_lines():
    offenders = {name: text.count("\n") for name, text in sources().items() if text.count("\n") > MAX_FILE_LINES}
    assert not offenders, f"files over {MAX_FILE_LINES} lines (split them by job, or simplify): {offenders}"


def long_functions(name: str, text: str) -> dict[str, int]:
    lengths = {
        f"{name}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1  # from the def line, decorators aside
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return {where: length for where, length in lengths.items() if length > MAX_FUNCTION_LINES}


def test_no_function_is_over_60_lines():
    offenders = {
        where: length for name, text in sources().items() for where, length in long_functions(name, text).items()
    }
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (extract well-named helpers): {offenders}"


def test_ddp_core_stays_under_its_ceiling():
    counts = {name: text.count("\n") for name, text in sources().items() if name.startswith("ddp_core/")}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {lines}" for name, lines in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total <= CEILING, f"ddp_core has {total} lines, over its ceiling of {CEILING}; the largest: {largest}"
