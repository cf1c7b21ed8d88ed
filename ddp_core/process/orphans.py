"""Workers never outlive their launcher: the kernel kills a worker as soon as the process that started it dies.

torchrun starts every worker in a session of its own, and forwards the signals it gets; the ``--nproc``
launcher waits for its workers. A launcher killed by SIGKILL (``kill -9``, the out-of-memory killer)
forwards nothing: its workers trained on as orphans, holding the rendezvous port and the GPUs.

Linux's ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the kernel to send SIGKILL to this process when its
parent dies: at once, with nothing to poll. The parent is the thread that started the worker, so it must
be one that lives as long as the launcher (both launchers start their workers from the main thread, which
then waits for them). A parent that died before the request was made is found by its pid: the worker was
adopted by another process, and kills itself.

- ``python -m ddp_core.torchrun``: the launcher *is* torchrun's agent and starts each worker with
  ``Popen``, naming itself in ``DDP_LAB_LAUNCHER_PID``; the worker makes the request as it enters ddp-lab
  (``die_with_launcher``, from ``ddp_core.process.launch``), and if its launcher is gone by then, kills
  itself. A worker that never enters ddp-lab (a plain script) is not covered: torch starts it, and only a
  patch of torch's ``Popen`` could make the request before the script's first line (docs/decisions.md).
- ``python -m experiments.NAME --nproc N``: torch.multiprocessing already asks for SIGINT, which
  ``GracefulStop`` takes as a stop request for after the step: ranks hung inside torch (mismatched
  collectives) never see it and lived on, in 3 of 3 tries. Each spawned worker replaces it with SIGKILL
  first thing (``ddp_core.process.launch``).

SIGKILL, not a stop request: a launcher killed by SIGKILL is a job that was killed, and nothing is left
to enforce a stop's deadline; the run resumes from its last checkpoint (they are written atomically).
Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_VARIABLE = "DDP_LAB_LAUNCHER_PID"  # set by ddp_core.torchrun's agent for the workers it starts
SUPPORTED = sys.platform.startswith("linux")
# Built here, in the launcher: between fork and exec only an already-built function is called. prctl is
# variadic; its arguments after the first are unsigned longs.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if SUPPORTED else None
_REQUEST = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), *(ctypes.c_ulong(0),) * 3)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (its parent's pid when it started) dies.

    Safe between fork and exec: one system call, ``getppid`` and, if the parent is gone already, ``kill``.
    """
    if _prctl is None:
        return
    if _prctl(*_REQUEST) != 0:
        return  # refused: nothing else to do before exec; the worker runs as it did before
    if os.getppid() != parent:  # the parent died before the request: nothing will send the signal now
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """Under ``python -m ddp_core.torchrun``: ``die_with_parent`` for the launcher named in the environment.

    The variable is taken out of the environment first, so that what this worker starts does not inherit it. A
    worker whose parent is not the launcher (a fork server's child in the test suite) is left alone while the
    launcher lives, and kills itself if the launcher is gone.
    """
    value = os.environ.pop(LAUNCHER_PID_VARIABLE, "")
    if not value.isdigit():
        return
    launcher = int(value)
    if os.getppid() == launcher:
        die_with_parent(launcher)
        return
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except PermissionError:
        pass  # alive, and another user's: not ours to judge
