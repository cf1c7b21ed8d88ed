"""Which files of experiments/ are experiments: the one rule for the container's EXPERIMENT=NAME and for
``python -m experiments``' listing. Torch-free, so the listing stays instant."""

from __future__ import annotations

import re
from pathlib import Path

# A top-level entry point: ``def main(`` (collectives, preflight) or ``main = experiment_main(...)`` (training).
_ENTRY_POINT = re.compile(r"^(def main\(|main = )", re.MULTILINE)


def is_experiment_file(path: Path) -> bool:
    """experiments/NAME.py with a top-level ``main``: not a helper such as cifar10_data, nor ``__init__``."""
    if path.suffix != ".py" or not path.stem.isidentifier() or path.stem.startswith("_"):
        return False
    try:
        return _ENTRY_POINT.search(path.read_text(encoding="utf-8")) is not None
    except (OSError, UnicodeDecodeError):
        return False


def trains(source: str) -> bool:
    """A training experiment (``main = experiment_main(...)``: it checkpoints and resumes), not a tool."""
    return "\nmain = experiment_main(" in source
