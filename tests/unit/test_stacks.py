"""A hang's stacks (ddp_core.distributed.stacks): each rank's line from faulthandler's dumps and a timed-out rank's
own record, and the gathering from live processes that registered (a real child process, a few milliseconds)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_core.distributed import stacks
from ddp_core.process import heartbeat

LIB = os.path.dirname(os.__file__)  # the standard library's folder
REPO = Path(__file__).resolve().parents[2]
TORCH = "/venv/lib/python3.11/site-packages/torch"
CWD = os.getcwd()


def dump(*threads: list[str], header: str = "") -> str:
    """faulthandler's format: each thread's frames innermost first, the main thread last."""
    blocks = [
        f"{'Current thread' if i == len(threads) - 1 else 'Thread'} 0x00007f{i:010x} (most recent call first):\n"
        + "".join(f"  {frame}\n" for frame in frames)
        for i, frames in enumerate(threads)
    ]
    return header + "\n".join(blocks)


def frame(path: str, line: int, function: str) -> str:
    return f'File "{path}", line {line} in {function}'


MAIN_TAIL = [frame(f"{CWD}/experiments/mine.py", 140, "main"), frame("<frozen runpy>", 88, "_run_code")]
WRITER_THREAD = [frame(f"{LIB}/threading.py", 327, "wait"), frame(f"{LIB}/threading.py", 1002, "_bootstrap")]
SLEEPING = [frame(f"{CWD}/experiments/mine.py", 88, "read_shard"), frame(f"{CWD}/experiments/mine.py", 131, "train")]
IN_TORCH = [
    frame(f"{TORCH}/autograd/__init__.py", 395, "backward"),
    frame(f"{CWD}/ddp_core/lifecycle/loop.py", 217, "backward"),
]
ON_LOADER = [
    frame(f"{LIB}/queue.py", 180, "get"),
    frame(f"{TORCH}/utils/data/dataloader.py", 1150, "_try_get_data"),
    frame(f"{CWD}/experiments/mine.py", 131, "train"),
]
WORKER = [
    frame(f"{TORCH}/utils/data/_utils/worker.py", 300, "_worker_loop"),
    frame(f"{LIB}/multiprocessing/process.py", 314, "_bootstrap"),
]
WORKER_STUCK = [
    frame(f"{CWD}/experiments/data.py", 20, "__getitem__"),
    frame(f"{TORCH}/utils/data/_utils/fetch.py", 54, "fetch"),
    *WORKER,
]
RECORD = "Timed out in all_reduce #42 (sizes [[3]]) (most recent call first):\n" + "".join(
    f"  {line}\n" for line in [*IN_TORCH, frame(f"{CWD}/experiments/mine.py", 131, "train"), *MAIN_TAIL]
)

CASES = {
    "the main thread, listed last": (
        dump(WRITER_THREAD, SLEEPING + MAIN_TAIL),
        [],
        "rank 1: experiments/mine.py:88 read_shard (no collective)",
    ),
    "ddp-lab's frame inside torch's": (
        dump(IN_TORCH + MAIN_TAIL),
        [],
        "rank 1: ddp_core/lifecycle/loop.py:217 backward (no collective)",
    ),
    "a timed-out rank's record, not a later dump": (
        RECORD + "\n" + dump(SLEEPING + MAIN_TAIL),
        [],
        "rank 1: ddp_core/lifecycle/loop.py:217 backward, in all_reduce #42 (sizes [[3]])",
    ),
    "the newest of two dumps": (
        dump(SLEEPING + MAIN_TAIL) + "\n" + dump(IN_TORCH + MAIN_TAIL),
        [],
        "rank 1: ddp_core/lifecycle/loop.py:217 backward (no collective)",
    ),
    "waiting on the loader: the worker's frame": (
        dump(ON_LOADER + MAIN_TAIL),
        [dump(WORKER + ON_LOADER + MAIN_TAIL), dump(WORKER_STUCK + ON_LOADER + MAIN_TAIL)],
        "rank 1: experiments/data.py:20 __getitem__ in a DataLoader worker (no collective)",
    ),
    "idle workers: the rank's own frame": (
        dump(ON_LOADER + MAIN_TAIL),
        [dump(WORKER + ON_LOADER + MAIN_TAIL)],
        "rank 1: experiments/mine.py:131 train (no collective)",
    ),
    "a worker busy while the rank is elsewhere": (
        dump(SLEEPING + MAIN_TAIL),
        [dump(WORKER_STUCK + ON_LOADER + MAIN_TAIL)],
        "rank 1: experiments/mine.py:88 read_shard (no collective)",
    ),
    "aborted (NCCL's watchdog)": (
        dump(IN_TORCH + MAIN_TAIL, header="Fatal Python error: Aborted\n\n"),
        [],
        "rank 1: ddp_core/lifecycle/loop.py:217 backward (aborted)",
    ),
    "only library frames": (dump(WRITER_THREAD), [], "rank 1: no frame of its own code (no collective)"),
    "no answer": ("", [], "rank 1: no stack (the process did not answer)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_is_named_by_its_innermost_frame_of_its_own_code(case: str):
    main, forked, line = CASES[case]
    assert stacks.summary(1, main, forked) == line


def test_a_path_outside_the_working_directory_is_shown_whole():
    assert stacks.innermost([("/elsewhere/job.py", 3, "f")]) == "/elsewhere/job.py:3 f"


def test_a_timed_out_rank_records_where_the_collective_raised(tmp_path: Path, monkeypatch):
    """As in the process group: the collective raises inside the ``with`` body, the context manager catches it."""
    monkeypatch.setattr(stacks, "_own", {"file": (tmp_path / "record").open("a")})

    def collective() -> None:
        raise RuntimeError("timed out")

    @contextlib.contextmanager
    def group() -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:
            stacks.record_timeout(error, "all_reduce #7 (sizes [[1]])")

    def train() -> None:
        with group():
            collective()

    train()
    [(header, frames)] = stacks.threads((tmp_path / "record").read_text())
    assert header == "Timed out in all_reduce #7 (sizes [[1]])"
    functions = [function for _, _, function in frames]
    assert functions[:3] == ["collective", "train", test_a_timed_out_rank_records_where_the_collective_raised.__name__]
    assert "group" not in functions and "__exit__" not in functions  # the frames that caught it, not where it was


CHILD = """
import sys, threading
from ddp_core.distributed import stacks
stacks.register(sys.argv[1], "3")
def stuck_here():
    print("ready", flush=True)
    threading.Event().wait()
stuck_here()
"""


def test_the_launcher_gathers_a_live_rank_s_stack_into_the_run_directory(tmp_path: Path):
    job, run = tmp_path / "job", tmp_path / "run"
    job.mkdir()
    run.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(CHILD))
    child = subprocess.Popen([sys.executable, str(script), str(job)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline() == "ready\n"
        (job / "stack_0_1").write_text(RECORD)  # a rank that timed out and has gone: its record is kept as it is
        stacks.gather(str(job), run, [1])
        assert child.poll() is None  # the signal asked for a dump; it ended nothing
    finally:
        child.kill()
        child.wait()
    line = (run / "stacks_rank_3.txt").read_text().splitlines()[0]
    assert re.fullmatch(rf"rank 3: {tmp_path}/rank.py:[67] stuck_here \(no collective\)", line), line
    assert (run / "stacks_rank_0.txt").read_text().splitlines()[0].endswith(", in all_reduce #42 (sizes [[3]])")


def test_nothing_is_gathered_without_a_timeout(tmp_path: Path):
    (tmp_path / "stack_0_1").write_text(dump(SLEEPING + MAIN_TAIL))
    stacks.gather(str(tmp_path), tmp_path, [1, None])
    assert not list(tmp_path.glob("stacks_rank_*"))
    stacks.gather(str(tmp_path), tmp_path, [-signal.SIGABRT, None])
    assert list(tmp_path.glob("stacks_rank_*")) == [tmp_path / "stacks_rank_0.txt"]


def test_a_process_that_does_not_catch_the_signal_is_not_sent_it(tmp_path: Path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / f"stack_0_{sleeper.pid}").write_text("")
        stacks.gather(str(tmp_path), tmp_path, [-signal.SIGABRT])
        assert sleeper.poll() is None, "SIGUSR2's default action would have ended it"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (tmp_path / "stacks_rank_0.txt").read_text().startswith("rank 0: no stack")


FORKS = """
import os, sys
from ddp_core.distributed import stacks
stacks.register(sys.argv[1], "0")
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(pid)
"""


def test_a_forked_process_answers_in_its_own_file_which_goes_once_it_has_ended(tmp_path: Path):
    """A loader's workers come and go each epoch: the files of those that ended go at the rank's next fork."""
    script = tmp_path / "forks.py"
    script.write_text(textwrap.dedent(FORKS))
    job = tmp_path / "job"
    job.mkdir()
    done = subprocess.run([sys.executable, str(script), str(job)], capture_output=True, text=True, cwd=REPO, check=True)
    last = int(done.stdout)
    names = sorted(path.name for path in job.iterdir())
    own = [name for name in names if re.fullmatch(r"stack_0_\d+", name)]
    assert len(own) == 1 and names == sorted([*own, f"stack_0_{last}_child"]), names


@pytest.mark.parametrize("rank", ["0", "2"])
def test_a_new_launch_s_rank_0_removes_an_earlier_hang_s_stacks_from_the_run_directory(
    tmp_path: Path, monkeypatch, rank: str
):
    """A resumed run hangs again: the report must not name where an earlier launch's ranks were. Rank 0 alone
    writes the run directory (the contract checks it), so it removes every rank's; another rank removes none."""
    monkeypatch.setenv(heartbeat.JOB_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(heartbeat, "_fd", None)
    (tmp_path / "stacks_rank_2.txt").write_text("rank 2: earlier.py:1 f (no collective)\n")
    (tmp_path / "stacks_rank_3.txt").write_text("rank 3: earlier.py:2 g (no collective)\n")
    heartbeat.started(tmp_path)
    os.close(heartbeat._fd)
    left = sorted(path.name for path in tmp_path.glob("stacks_rank_*"))
    assert left == ([] if rank == "0" else ["stacks_rank_2.txt", "stacks_rank_3.txt"])
