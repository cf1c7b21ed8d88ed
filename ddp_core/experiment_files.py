"""Which files of experiments/ are experiments, and of which kind, for EXPERIMENT=NAME and ``python -m experiments``.

Read with ``ast``, never imported (no torch): ``KIND = "training" | "demo" | "tool"``, or ``main =
experiment_main(...)`` without a KIND (training); a module with neither is a helper.
"""

from __future__ import annotations

import ast
from pathlib import Path

TRAINING, DEMO, TOOL = "training", "demo", "tool"
KINDS = (TRAINING, DEMO, TOOL)  # the order python -m experiments lists them in


def declared_kind(source: str) -> str | None:
    """The kind ``source`` declares (one of KINDS), or None: not an experiment, or not Python."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    harness = False
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if name == "KIND" and isinstance(value, ast.Constant) and value.value in KINDS:
            return value.value
        if name == "main" and isinstance(value, ast.Call) and getattr(value.func, "id", None) == "experiment_main":
            harness = True
    return TRAINING if harness else None


def kind_of(path: Path) -> str | None:
    """experiments/NAME.py's declared kind; None for a helper, ``__init__``, or a file that is not NAME.py."""
    if path.suffix != ".py" or not path.stem.isidentifier() or path.stem.startswith("_"):
        return None
    try:
        return declared_kind(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
