"""The processes per node that ``make train`` starts (``nproc=$(python -m ddp_core.process.nproc)``): NPROC from
the environment, else ./.env, else every visible GPU or 2, as the experiments' parser ranks them (docs/decisions.md).
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
