"""ddp_core.torchrun's agent (LabAgent) in torch's own run loop, with the workers and the rendezvous left out.

``TorchSide`` stands for torch's methods that start, stop, watch and meet workers: it sits between LabAgent and
torch's LocalElasticAgent in the method order, so LabAgent's ``super()`` calls reach it, while ``run``,
``_invoke_run``, ``_restart_workers`` and ``_initialize_workers`` are torch's own. Nothing of torch's is patched.
``launch_agent`` is run with torch's own rendezvous and workers at the end.
"""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed.run as torch_run
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddp_core.distributed.env import RDZV_ROUND_VARIABLE
from ddp_core.exit_codes import CONFIG_ERROR_EXIT_CODE
from ddp_core.process import agent as agent_module
from ddp_core.process import timeline
from ddp_core.process.orphans import LAUNCHER_PID_VARIABLE


def failed(*codes: int) -> RunResult:
    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in enumerate(codes)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


class TorchSide(LocalElasticAgent):
    """The workers' side: each watch returns the next of ``results``; what was called is in ``calls``."""

    results: list[RunResult]
    calls: list[str]

    def _rendezvous(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.calls.append("rendezvous")

    def _start_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> dict[int, Any]:
        self.calls.append("start")
        return {}

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self.calls.append("stop")

    def _monitor_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> RunResult:
        return self.results.pop(0)


class Agent(agent_module.LabAgent, TorchSide):
    pass


class Handler:
    """What torch's run loop asks a rendezvous handler, for its events and metrics."""

    def get_run_id(self) -> str:
        return "job"

    def get_backend(self) -> str:
        return "static"


class C10dHandler(Handler):
    _state_holder = SimpleNamespace(state=SimpleNamespace(round=4))  # where c10d's handler keeps its round

    use_agent_store = True


def agent(results: list[RunResult], max_restarts: int, handler: object = None) -> Agent:
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=handler or Handler(),  # type: ignore[arg-type]
        entrypoint=sys.executable,
        args=("-u", "-m", "experiments.toy"),
        max_restarts=max_restarts,
        monitor_interval=0.001,
    )
    made = Agent(spec, DefaultLogsSpecs())
    made.results, made.calls = list(results), []
    return made


@pytest.mark.parametrize("codes", [(CONFIG_ERROR_EXIT_CODE, CONFIG_ERROR_EXIT_CODE), (2, -signal.SIGTERM)])
def test_a_refusal_by_every_worker_ends_the_run_at_once_with_restarts_left(codes):
    refusing = agent([failed(*codes)], max_restarts=3)
    with pytest.raises(ChildFailedError) as raised:
        refusing.run()
    assert {rank: f.exitcode for rank, f in raised.value.failures.items()} == dict(enumerate(codes))
    assert refusing.calls == ["rendezvous", "start", "stop"]  # stopped, never restarted
    assert refusing.get_worker_group().state == WorkerState.FAILED


def test_any_other_failure_spends_torchs_restarts_as_before():
    crashing = agent([failed(-signal.SIGKILL), failed(CONFIG_ERROR_EXIT_CODE, 1)], max_restarts=1)
    result = crashing.run()
    assert result.is_failed() and result.failures[1].exitcode == 1
    assert crashing.calls == ["rendezvous", "start", "stop", "rendezvous", "start", "stop"]  # one restart


def test_the_restarts_are_timed(monkeypatch, tmp_path):
    monkeypatch.setenv(timeline.VARIABLE, str(tmp_path / "timeline"))
    agent([failed(-signal.SIGKILL), failed(-signal.SIGKILL)], max_restarts=1).run()
    events = [(event["event"], event["restart"]) for event in timeline.read(tmp_path / "timeline")]
    assert events == [("spawned", 0), ("failure_seen", 1), ("stopped", 1), ("spawned", 1), ("stopped", 1)]


def test_the_workers_are_told_their_rendezvous_round_where_there_is_one(monkeypatch):
    monkeypatch.setenv(RDZV_ROUND_VARIABLE, "stale")
    c10d = agent([], max_restarts=0, handler=agent_module.EveryRoundStore(C10dHandler()))
    c10d._rendezvous(c10d.get_worker_group())
    assert os.environ[RDZV_ROUND_VARIABLE] == "4"
    static = agent([], max_restarts=0)
    static._rendezvous(static.get_worker_group())
    assert RDZV_ROUND_VARIABLE not in os.environ


def test_launch_agent_runs_torchs_workers_under_the_lab_agent_with_the_launchers_config(monkeypatch, tmp_path):
    """Built from torchrun's own config (its parser's, as ``main`` gets it): the workers get the job's variables and
    the launcher's pid, a failure raises torch's ChildFailedError with the worker's exit code."""
    out = tmp_path / "seen.txt"
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        f"open({str(out)!r} + os.environ['RANK'], 'w').write(os.environ['{LAUNCHER_PID_VARIABLE}'] + ' ' + "
        "os.environ['WORLD_SIZE'])\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    for code in (0, 3):
        launch = torch_run.parse_args(
            ["--standalone", "--nproc-per-node=2", "--max-restarts=0", str(script), str(code)]
        )
        launch.rdzv_backend, launch.rdzv_endpoint, launch.rdzv_id = "c10d", "localhost:0", f"job{code}"
        launch.log_dir = str(tmp_path / f"logs{code}")
        config, command, command_args = torch_run.config_from_args(launch)
        if code == 0:
            agent_module.launch_agent(config, command, command_args)
            assert [(tmp_path / f"seen.txt{rank}").read_text() for rank in (0, 1)] == [f"{os.getpid()} 2"] * 2
        else:
            with pytest.raises(ChildFailedError) as raised:
                agent_module.launch_agent(config, command, command_args)
            codes = {failure.exitcode for failure in raised.value.failures.values()}
            assert 3 in codes and codes <= {3, -signal.SIGTERM}  # the other worker may be closed after the first
        assert LAUNCHER_PID_VARIABLE not in os.environ  # the workers', not left in the launcher's
