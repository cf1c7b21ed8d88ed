"""The checkpoint writer process (``writer_process.py``): ``python -m ddp_core.output.checkpoint_writer ADDRESS``,
ADDRESS the Unix socket of the training process that started it."""

from __future__ import annotations

import socket
import sys

from ddp_core.output.checkpoint import CheckpointDir
from ddp_core.output.writer_process import die_with_parent, serve


def main(argv: list[str]) -> None:
    die_with_parent()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(argv[0])
        serve(sock, lambda directory, keep, path, state: CheckpointDir(directory, keep).write(path, state))


if __name__ == "__main__":
    main(sys.argv[1:])
