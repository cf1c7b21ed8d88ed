"""The processes per node that ``make train`` starts: NPROC, from make's command line, the environment or ./.env.

    nproc=$(python -m ddp_core.process.nproc)      # the Makefile's train recipe prints the count

The precedence is the experiments' own (ddp_core.config): a real environment variable (make puts an
``NPROC=`` of its command line there too) wins over ``./.env``, which wins over the default; empty means the
default: every visible GPU, or 2 CPU processes (gloo). The Makefile read its command line and the
environment only, so an ``NPROC`` in ``.env`` was silently ignored. A bad value is one line and exit 2,
before torchrun starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from dotenv import dotenv_values

from ddp_core.config import MAX_NPROC
from ddp_core.distributed.env import int_var
from ddp_core.errors import exits_with_one_line


def processes_per_node(environ: Mapping[str, str], dotenv: Path) -> int:
    """NPROC from ``environ``, else from the ``dotenv`` file, else every visible GPU or 2."""
    if "NPROC" not in environ:
        environ = {"NPROC": dotenv_values(dotenv).get("NPROC") or ""}
    count = int_var(environ, "NPROC", None, 1, MAX_NPROC)
    if count is not None:
        return count
    import torch  # ddp_core.config has imported it already

    return torch.cuda.device_count() or 2


@exits_with_one_line
def main() -> None:
    print(processes_per_node(os.environ, Path.cwd() / ".env"))


if __name__ == "__main__":
    main()
