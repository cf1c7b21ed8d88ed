"""torchrun, with one plain sentence instead of a traceback when the nodes never meet or a stop was asked for.

    python -m ddp_core.torchrun [torchrun's arguments]       # what the container's entrypoint runs

torchrun's agents meet (rendezvous) before any worker starts, so ddp_core's own join check never runs
when a whole node is missing: the user would see a store traceback ("1/2 clients joined", a socket
timeout, or a bare RendezvousTimeoutError). This runs torchrun's own ``main`` in this process (signals
reach it as they would reach torchrun) and turns those three failures into one line naming the
endpoint, the node count, the timeout and the fix.

A stop signal (``docker stop``, Slurm, Ctrl-C) makes plain torchrun exit 1 with a SignalException
traceback, as if the job had failed. Here it exits ``STOPPED_EXIT_CODE`` (143) with one line, as the
workers do after their checkpoint (ddp_core.process.preemption). Everything else is torchrun's, unchanged.
"""

from __future__ import annotations

import re
import signal
import sys
from argparse import Namespace
from collections.abc import Sequence

import torch.distributed.run as torch_run
from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from ddp_core.errors import CONFIG_ERROR_EXIT_CODE
from ddp_core.process.exit import PREFLIGHT_FAILED_EXIT_CODE
from ddp_core.training.guard import DIVERGED_EXIT_CODE
from ddp_core.process.preemption import STOPPED_EXIT_CODE
from ddp_core.output.storage import STORAGE_EXIT_CODE

RENDEZVOUS_FAILED_EXIT_CODE = 1
# Workers that stop themselves for a reason they print in one line (ddp_core.errors.RunStoppedError) all
# exit with its code; the job exits with it too, instead of torchrun's 1 and its failure summary.
STATED_EXIT_CODES = (CONFIG_ERROR_EXIT_CODE, DIVERGED_EXIT_CODE, PREFLIGHT_FAILED_EXIT_CODE, STORAGE_EXIT_CODE)


def _endpoint(args: Namespace) -> str:
    if args.rdzv_backend == "static" or not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return args.rdzv_endpoint


def _timeout_s(args: Namespace) -> str:
    match = re.search(r"(?:^|,)\s*(?:join_)?timeout\s*=\s*([0-9.]+)", args.rdzv_conf or "")
    return f"{match.group(1)} seconds" if match else "torchrun's rendezvous timeout"


def explain(error: BaseException, args: Namespace) -> str | None:
    """The one-line message for a rendezvous that failed, or None when ``error`` is something else."""
    where, within, nodes = _endpoint(args), _timeout_s(args), args.nnodes
    start_them = f"start every node (NNODES={nodes}) with the same MASTER_ADDR/MASTER_PORT, and check that they reach {where} (firewall, address)"
    if isinstance(error, RendezvousTimeoutError):
        return f"the nodes did not all join rendezvous {args.rdzv_id!r} at {where} within {within} (NNODES={nodes}): {start_them}"
    text = str(error)
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if isinstance(error, DistStoreError) and joined:
        return f"only {joined.group(1)} of {joined.group(2)} nodes joined at {where} within {within}: {start_them}"
    if isinstance(error, DistNetworkError) and "timed out" in text.lower():
        return (
            f"node 0 unreachable at {where} within {within}: is node 0 (NODE_RANK=0) running, and is {where} "
            "reachable from this host (firewall, MASTER_ADDR)?"
        )
    return None


def _shared_exit_code(error: ChildFailedError, code: int) -> bool:
    """Every worker exited with ``code``, or was ended by torchrun's SIGTERM after one did.

    Workers leave together (a barrier), but torchrun may see one exit first and SIGTERM the others while
    they are already in interpreter teardown, where Python's handlers are gone: -SIGTERM, after the
    checkpoint was written (before the barrier).
    """
    codes = {failure.exitcode for failure in error.failures.values()}
    return code in codes and codes <= {code, -signal.SIGTERM}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        torch_run.main(argv)
    except (RendezvousTimeoutError, DistStoreError, DistNetworkError) as error:
        message = explain(error, torch_run.parse_args(argv))
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(RENDEZVOUS_FAILED_EXIT_CODE) from None
    except SignalException as error:
        print(
            f"stopped: torchrun got {error.sigval.name}; its workers stop after the step in progress and write a "
            f"checkpoint (within TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s); relaunch with --resume to continue",
            file=sys.stderr, flush=True,
        )
        raise SystemExit(STOPPED_EXIT_CODE) from None
    except ChildFailedError as error:
        for code in STATED_EXIT_CODES:
            if _shared_exit_code(error, code):  # the workers printed why (global rank 0, one line)
                raise SystemExit(code) from None
        if not _shared_exit_code(error, STOPPED_EXIT_CODE):
            raise
        print("stopped: the workers got a stop signal and wrote a checkpoint; relaunch with --resume to continue", file=sys.stderr, flush=True)
        raise SystemExit(STOPPED_EXIT_CODE) from None


if __name__ == "__main__":
    main()
