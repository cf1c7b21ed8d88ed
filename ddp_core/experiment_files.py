"""Which files of experiments/ are experiments: the one rule for the container's EXPERIMENT=NAME and for
``python -m experiments``' listing. Torch-free, so the listing stays instant."""

from __future__ import annotations

from pathlib import Path


def is_experiment_file(path: Path) -> bool:
    """experiments/NAME.py with a top-level ``def main(``: not a helper such as cifar10_data, nor ``__init__``."""
    if path.suffix != ".py" or not path.stem.isidentifier() or path.stem.startswith("_"):
        return False
    try:
        return "\ndef main(" in path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
