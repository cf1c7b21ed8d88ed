"""ddp_core.torchrun's translations, without launching anything (the e2e tests launch it for real)."""

from __future__ import annotations

import signal

import torch.distributed.run as torch_run
from torch.distributed import DistStoreError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddp_core.process.preemption import STOPPED_EXIT_CODE
from ddp_core.torchrun import _shared_exit_code, explain


def failed(*exitcodes: int) -> ChildFailedError:
    failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent") for rank, code in enumerate(exitcodes)}
    return ChildFailedError(name="experiments.toy", failures=failures)


def test_stopped_workers_map_to_the_stopped_code_and_failures_do_not():
    assert _shared_exit_code(failed(STOPPED_EXIT_CODE, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE)
    assert _shared_exit_code(failed(-signal.SIGTERM, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE)  # ended by torchrun in teardown
    assert not _shared_exit_code(failed(-signal.SIGTERM, -signal.SIGTERM), STOPPED_EXIT_CODE)  # nobody chose to stop
    assert not _shared_exit_code(failed(STOPPED_EXIT_CODE, 1), STOPPED_EXIT_CODE)  # a real failure is never hidden
    assert not _shared_exit_code(failed(-signal.SIGKILL, STOPPED_EXIT_CODE), STOPPED_EXIT_CODE)


def test_other_errors_are_left_to_torchrun():
    args = torch_run.parse_args(["--nnodes=2", "--node-rank=0", "--master-addr=h", "--master-port=5", "--nproc-per-node=1", "x.py"])
    assert explain(DistStoreError("some other store problem"), args) is None
    assert explain(ValueError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."), args) is None
    message = explain(DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."), args)
    assert message is not None and message.startswith("only 1 of 2 nodes joined at h:5 within torchrun's rendezvous timeout")
