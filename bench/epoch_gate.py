"""A pause after each epoch's training steps, for ``bench.step_overhead``: only where it asks for one.

The benchmark compares the experiment's steady-state epochs with a bare training step timed in its own process.
On a shared machine the pace moves by 10-20% over tens of seconds, so a whole run bracketed by two bare passes
pairs an epoch with passes half a minute away. With ``DDP_LAB_EPOCH_GATE=SOCKET`` (a Unix socket the benchmark
listens on, inherited by the launcher and its worker), the worker connects after each epoch's training steps,
with the loop's clock paused and before the epoch's evaluation and checkpoint, sends the epoch's number and
waits for the benchmark's answer: it times one bare pass in that pause. Everything the run does otherwise (its
evaluation, its checkpoint written in the background during the next epoch's steps) keeps its place, so each
epoch is paired with passes timed seconds before and after its steps.

The worker's side is an observer (``ddp_core/observers.py``): the benchmark sets ``DDP_LAB_OBSERVERS`` to this
module with the socket (``env``). One process: at a larger world the other ranks would wait in the next
collective. Without the variable nothing happens; with no benchmark listening (it died) the run goes on ungated.
"""

from __future__ import annotations

import os
import socket

from ddp_core import observers

VARIABLE = "DDP_LAB_EPOCH_GATE"
WAIT_S = 600.0  # the longest a bare pass may take (a GPU's compiled modes included) before the run goes on


def trained(epoch: int) -> None:
    """After ``epoch``'s (1-based) training steps: where ``DDP_LAB_EPOCH_GATE`` names a socket, wait for its go."""
    path = os.environ.get(VARIABLE)
    if not path:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gate:
            gate.settimeout(WAIT_S)
            gate.connect(path)
            gate.sendall(f"{epoch}\n".encode())
            gate.recv(1)  # its go: one byte, or the connection closed
    except OSError:
        return  # the benchmark is gone or late: the run is never lost to its measurement


class EpochGate(observers.Observer):
    def epoch_trained(self, epoch: int) -> None:
        trained(epoch)


def observer() -> EpochGate | None:
    """The worker's gate, where the benchmark named a socket."""
    return EpochGate() if os.environ.get(VARIABLE) else None


def env(socket_path: str) -> dict[str, str]:
    """What a run started by the benchmark needs to pause at each epoch's end for ``socket_path``'s go."""
    return {VARIABLE: socket_path, **observers.env(__name__)}
