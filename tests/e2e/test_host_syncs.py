"""What the host reads from the step's tensors in CIFAR10's steady state: nothing that would make it wait for a GPU.

The small CNN trains for 2 epochs in this process (a world of one, as `python -m experiments.cifar10` runs) while
``tests.steady_state.HostReads`` records, in steps 18-30 (the second epoch, which neither logs, evaluates nor
checkpoints in between), every call that reads a tensor's value on the host, with the project's call site.
On a GPU each would stall the host until the GPU caught up, so the host could no longer queue work ahead.
A world of one reads none. (With several ranks on CPU the loop asks every step whether a rank got a stop signal,
a collective whose answer the host reads; on CUDA it asks only where it pauses anyway: ddp_core/lifecycle/loop.py.)
With log points inside those steps, read late as on a GPU (``--log-reads late``), the one read is of the host copy
each log point made of its figures, at the next one, after that copy's event: it waits for no GPU.
tests/gpu/test_steady_state_gpu.py holds such steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments import cifar10
from experiments.cifar10_data import write_standin
from tests.steady_state import HostReads, watch_steps

FIRST, LAST = 18, 30  # 512 images / batch 32 = 16 steps an epoch: the second epoch but its ends
WATCHED = LAST - FIRST + 1
LATE_FLAGS = ("--log-every", "4", "--log-reads", "late")

CPU_ONLY: dict[tuple[str, str], int] = {}  # (call, site) -> reads in the watched steps that only a CPU run makes
# --log-reads late, a log point every 4 steps (20, 24 and 28 in the watched steps): the log points at 24 and 28 read
# the host copy of the one before (the copy at 28 is read at 32, the epoch's end)
LATE = {("tolist", "ddp_core/lifecycle/late_reads.py:receive"): 2}


@pytest.mark.parametrize(("log_flags", "host_copies"), [(("--log-every", "16"), {}), (LATE_FLAGS, LATE)])
def test_the_steady_state_step_reads_nothing_from_its_tensors_but_what_only_cpu_runs_read(
    tmp_path: Path, log_flags: tuple[str, ...], host_copies: dict[tuple[str, str], int]
):
    data = write_standin(tmp_path / "data", train_images=512, test_images=64)
    reads = HostReads()
    argv = [
        *("--model", "small", "--epochs", "2", "--batch-size", "32", "--eval-batch-size", "64", *log_flags),
        *("--data-dir", str(data.parent), "--no-verify", "--run-dir", str(tmp_path / "run")),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each process of a launch in the suite (OMP_NUM_THREADS=1)
    try:
        with watch_steps(FIRST, LAST, reads.__enter__, lambda: reads.__exit__(None, None, None)):
            metrics = cifar10.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert metrics["steps"] == 32
    assert {site: count for site, count in reads.calls.items() if site not in CPU_ONLY} == host_copies
    assert dict(reads.calls) == {**CPU_ONLY, **host_copies}
