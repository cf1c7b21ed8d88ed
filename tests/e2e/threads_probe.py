"""Each worker writes the threads it was given, under ddp_core.torchrun or --nproc (tests/e2e/test_launch_paths.py).

    python -m tests.e2e.threads_probe --out DIR [--nproc N]

Every rank writes ``DIR/rank<RANK>.json``: its ``OMP_NUM_THREADS`` (null when unset) and
``torch.get_num_threads()``. ``--nproc`` starts the workers through ``ddp_core.process.launch``, the path
``python -m experiments.NAME --nproc N`` takes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ddp_core.process.launch import launch


def threads_given() -> dict[str, str | int | None]:
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads()}


def report(args: argparse.Namespace) -> None:
    (Path(args.out) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(threads_given()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    launch(report, parser.parse_args())  # type: ignore[type-var]


if __name__ == "__main__":
    main()
