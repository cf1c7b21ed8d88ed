"""Check that a training experiment keeps clear of DDP's traps: ``python -m tools.contract MODULE [-- FLAGS]``.

It runs the experiment briefly under torchrun at 1, 2 and 3 CPU processes (gloo), each in a fresh run directory,
and prints PASS or FAIL with why for each of ``PROPERTIES``; exit 1 if any failed. docs/new-experiment.md (§5) says
what each property means; the experiment declares what its flags cannot say as ``CONTRACT``
(``ddp_core.contract_spec.ContractSpec``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch

from ddp_core.contract_spec import ContractSpec
from ddp_core.errors import ConfigError, exits_with_one_line
from ddp_core.exit_codes import STOPPED_EXIT_CODE
from ddp_core.layout import CHECKPOINTS, EVENTS, LAST, MANIFEST, METRICS, STEP_FILE, STEP_GLOB
from ddp_core.lifecycle.states import PROJECT_STATES
from ddp_core.output.checkpoint import named_states
from ddp_core.output.checkpoint_diff import first_difference
from ddp_core.process.preemption import STOPPED_BY_SIGNAL
from tools import contract_trace

PROPERTIES = ("bad-flag", "run-dir", "same-seed", "resume", "world-size", "sigterm", "rank-zero-writes")
SEED = 1234
# float32 rounding, accumulated over a brief run's steps: what 1 vs 2 processes may differ by
RTOL, ATOL = 1e-5, 1e-6
# the contract's runs choose their own
CHOSEN_PER_RUN = (
    "RUN_DIR SEED RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID LOG_ALL_RANKS".split()
)
_STOP_LINE = re.compile(
    r"\[rank (\d+)(?:/\d+)?\] WARNING " + re.escape(STOPPED_BY_SIGNAL.split("{step}")[0]) + r"(\d+)"
)


@dataclass
class Launch:
    """One torchrun launch of the experiment: its exit code, output and run directory."""

    name: str
    nproc: int
    returncode: int
    output: str
    run_dir: Path

    def failure(self) -> str:
        """Why it did not exit 0, in one line: its last error line (or the last line)."""
        lines = [line for line in self.output.strip().splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:") or "Error" in line]
        last = (errors or lines or ["no output"])[-1].strip()
        return (
            f"the {self.name} run ({self.nproc} process{'es' if self.nproc > 1 else ''}) exited {self.returncode}: "
            f"{last[:300]}"
        )


class PropertyFailed(Exception):
    """A property does not hold; the message says why."""


class Contract:
    """Runs an experiment as the properties need it, each launch once, and checks them."""

    def __init__(self, module: str, spec: ContractSpec, extra: Sequence[str], work: Path, timeout_s: float) -> None:
        self.module, self.spec, self.extra = module, spec, tuple(extra)
        self.work, self.timeout_s = work, timeout_s
        self.reports = work / "writes"
        self.reports.mkdir(parents=True, exist_ok=True)
        self.traces = work / "traces"  # what each rank trained each step on (tools/contract_trace.py)
        self.launches: dict[str, Launch] = {}

    # ------------------------------------------------------------------------------------- launching

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            BACKEND="gloo",
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        env.update(contract_trace.env(self.traces))
        for name in CHOSEN_PER_RUN:
            env.pop(name, None)
        return env

    def command(self, nproc: int, run_dir: Path, flags: Sequence[str]) -> list[str]:
        torchrun = [sys.executable, "-m", "ddp_core.torchrun", "--standalone", f"--nproc-per-node={nproc}"]
        # every rank runs under tools.write_audit, which reports each file it writes into the run directory
        audit = ["-m", "tools.write_audit", str(self.reports), str(run_dir)]
        return [*torchrun, *audit, self.module, "--run-dir", str(run_dir), "--seed", str(SEED), *flags, *self.extra]

    def batch(self, nproc: int) -> tuple[str, ...]:
        double = nproc == 1 and self.spec.world_size_invariant  # the same global batch as 2 processes
        return (self.spec.batch_flag, str(self.spec.batch_size * (2 if double else 1)))

    def launch(
        self,
        name: str,
        nproc: int,
        *flags: str,
        run_as: str | None = None,
        on_started: Callable[[subprocess.Popen, Path], None] | None = None,
    ) -> Launch:
        """The launch called ``name`` (once; later calls return it). ``run_as`` reuses that launch's run directory."""
        if name in self.launches:
            return self.launches[name]
        run_dir = self.work / "runs" / (run_as or name)
        process = subprocess.Popen(
            self.command(nproc, run_dir, flags),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            if on_started is not None:
                on_started(process, run_dir)
            output = process.communicate(timeout=self.timeout_s)[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = (
                process.communicate()[0] + f"\nerror: still running after {self.timeout_s:.0f} s (--timeout): a hang?"
            )
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        launch = Launch(name, nproc, process.returncode, output, run_dir)
        (self.work / f"{name}.log").write_text(output)
        self.launches[name] = launch
        return launch

    def finished(self, name: str, nproc: int, *flags: str, run_as: str | None = None) -> Launch:
        launch = self.launch(name, nproc, *self.spec.brief, *self.batch(nproc), *flags, run_as=run_as)
        if launch.returncode != 0:
            raise PropertyFailed(launch.failure())
        return launch

    def weights(self, launch: Launch) -> dict[str, torch.Tensor]:
        return self.checkpoint(launch)["model"]

    def tracked(self, launch: Launch) -> dict[str, Any]:
        """The states of the objects the experiment tracks (``run.track``): the checkpoint's names beyond ddp-lab's."""
        return {
            name: state for name, state in named_states(self.checkpoint(launch)).items() if name not in PROJECT_STATES
        }

    def checkpoint(self, launch: Launch) -> dict[str, Any]:
        path = launch.run_dir / CHECKPOINTS / LAST
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise PropertyFailed(
                f"{path.relative_to(self.work)} does not load with weights_only=True: "
                f"{str(error).splitlines()[0][:200]}"
            ) from None

    # ------------------------------------------------------------------------------------ properties

    def check_bad_flag(self) -> str:
        for flags, what in ((["--contract-no-such-flag"], "an unknown flag"), (["--seed=-1"], "--seed=-1")):
            result = subprocess.run(
                [sys.executable, "-m", self.module, *flags, *self.extra],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
            )
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            if result.returncode != 2:
                raise PropertyFailed(f"{what} exited {result.returncode}, not 2: {(lines or ['no stderr'])[-1][:200]}")
            if len(lines) != 1:
                raise PropertyFailed(
                    f"{what} printed {len(lines)} lines on stderr, not one: {' | '.join(lines[:3])[:300]}"
                )
        return "an unknown flag and --seed=-1 each exit 2 with one line"

    def check_run_dir(self) -> str:
        for name, nproc in (("one", 1), ("two", 2)):
            run_dir = self.finished(name, nproc).run_dir
            missing = [
                what
                for what, present in (
                    (MANIFEST, (run_dir / MANIFEST).is_file()),
                    (METRICS, (run_dir / METRICS).is_file()),
                    ("TensorBoard events", any(run_dir.rglob(EVENTS))),
                    (f"{CHECKPOINTS}/{LAST}", (run_dir / CHECKPOINTS / LAST).is_file()),
                )
                if not present
            ]
            if missing:
                raise PropertyFailed(f"the {nproc}-process run directory has no {', no '.join(missing)}")
            try:
                config = json.loads((run_dir / MANIFEST).read_text())["config"]
                json.loads((run_dir / METRICS).read_text())
            except (ValueError, KeyError) as error:
                raise PropertyFailed(
                    f"manifest.json or metrics.json of the {nproc}-process run is not what ddp_core writes: {error}"
                ) from None
            model = self.spec.model(config)
            try:
                model.load_state_dict(self.weights(self.launches[name]), strict=True)
            except RuntimeError as error:
                raise PropertyFailed(
                    f"checkpoints/last.pt does not load into {type(model).__name__}: {str(error).splitlines()[0][:200]}"
                ) from None
        return (
            "manifest, metrics, TensorBoard events; last.pt loads weights_only into "
            f"{type(model).__name__} (1 and 2 processes)"
        )

    def check_same_seed(self) -> str:
        first, second = self.finished("two", 2), self.finished("two-again", 2)
        difference = compare(self.weights(first), self.weights(second), exact=True)
        if difference:
            raise PropertyFailed(f"two runs with --seed {SEED} at 2 processes differ: {difference}")
        return "two runs with one seed end bitwise-equal (2 processes)"

    def check_resume(self) -> str:
        step = self.spec.stop_at_step
        for nproc, whole in ((2, "two"), (3, "three")):
            reference = self.finished(whole, nproc)
            stopped = self.finished(f"{whole}-stopped", nproc, "--stop-at-step", str(step))
            if (stopped.run_dir / METRICS).exists():
                raise PropertyFailed(
                    f"--stop-at-step {step} at {nproc} processes wrote metrics.json: a stopped run has not ended"
                )
            checkpoint_step = self.checkpoint_step(stopped)
            if checkpoint_step != step:
                raise PropertyFailed(
                    f"--stop-at-step {step} at {nproc} processes left a checkpoint of step {checkpoint_step}, "
                    f"not {step}"
                )
            resumed = self.finished(f"{whole}-resumed", nproc, "--resume", run_as=f"{whole}-stopped")
            difference = compare(self.weights(reference), self.weights(resumed), exact=True)
            if difference:
                raise PropertyFailed(
                    f"--stop-at-step {step} then --resume at {nproc} processes differs from the uninterrupted run: "
                    f"{difference}; {self.likely_cause(whole, f'{whole}-stopped', step)}"
                )
            tracked = self.tracked(reference)
            difference = compare_states(tracked, self.tracked(resumed))
            if difference:
                raise PropertyFailed(
                    f"--stop-at-step {step} then --resume at {nproc} processes: the tracked {difference} differs from "
                    "the uninterrupted run's, though the weights agree: its state_dict() leaves out what it changes "
                    "as it trains, or its load_state_dict(state) does not put all of it back"
                )
        objects = f" and the {len(tracked)} tracked object(s) ({', '.join(tracked)})" if tracked else ""
        return (
            f"--stop-at-step {step} then --resume ends bitwise-equal to the uninterrupted run{objects} "
            "(2 and 3 processes)"
        )

    def likely_cause(self, reference: str, resumed: str, stopped_at: int) -> str:
        """Which rule a resume that differs broke, read from what each rank trained each step on."""
        before, after = contract_trace.read(self.traces, reference), contract_trace.read(self.traces, resumed)
        for rank in sorted(before):
            expected = {line["step"]: line for line in before[rank] if line["step"] > stopped_at}
            continued = [line for line in after.get(rank, []) if line["step"] > stopped_at]
            for line in continued:
                other = expected.get(line["step"])
                if other is None:
                    continue
                if line["batch"] != other["batch"]:
                    return (
                        f"likely cause: after the resume, rank {rank} trained step {line['step']} on other samples "
                        "than the uninterrupted run: the epoch did not continue where it stopped (use ddp_core's "
                        "TrainSampler, not a plain DistributedSampler, and call sampler.set_epoch(epoch, "
                        "consumed=consumed) with the values of loop.epochs())"
                    )
                if line["streams"] != other["streams"]:
                    return (
                        f"likely cause: after the resume, rank {rank}'s random streams at step {line['step']} differ "
                        "from the uninterrupted run's: randomness the checkpoint does not hold (draw from the global "
                        "RNGs the run seeds and checkpoints, and give a DataLoader run.loader_generator())"
                    )
        return (
            "likely cause: the same batches and random streams, yet other weights: state the checkpoint does not "
            "hold (an optimizer, scheduler or counter of the experiment's own that the run does not restore)"
        )

    def check_world_size(self) -> str:
        if not self.spec.world_size_invariant:
            return "SKIP: the experiment does not declare world_size_invariant"
        hook = _flag_value(self.extra, "--comm-hook")
        if hook not in (None, "none"):
            return f"SKIP: --comm-hook {hook} compresses the all-reduce: 1 and 2 processes differ beyond rounding"
        one, two = self.finished("one", 1), self.finished("two", 2)
        difference = compare(self.weights(one), self.weights(two), exact=False)
        if difference:
            raise PropertyFailed(
                f"1 process ({self.spec.batch_flag} {self.spec.batch_size * 2}) and 2 ({self.spec.batch_flag} "
                f"{self.spec.batch_size}) differ beyond float32 rounding: {difference}"
            )
        return f"1 and 2 processes with the same global batch agree within rtol {RTOL:g}, atol {ATOL:g}"

    def check_sigterm(self) -> str:
        nproc = 3
        launch = self.launch(
            "sigterm", nproc, *self.spec.long, *self.batch(nproc), on_started=signal_after_first_checkpoint
        )
        if launch.returncode != STOPPED_EXIT_CODE:
            raise PropertyFailed(f"exit {launch.returncode}, not {STOPPED_EXIT_CODE}: " + launch.failure())
        # Each rank's own record of the step it stopped after: the last batch it was handed (the stop line itself
        # is printed once, by rank 0)
        steps = contract_trace.last_steps(self.traces, launch.run_dir.name)
        if set(steps) != set(range(nproc)):
            raise PropertyFailed(
                f"ranks {sorted(set(range(nproc)) - set(steps))} recorded no step in {self.traces}: hand the batches "
                "out through loop.steps(loader)"
            )
        if len(set(steps.values())) != 1:
            raise PropertyFailed(f"the ranks stopped after different steps: {dict(sorted(steps.items()))}")
        step = steps[0]
        said = {int(rank): int(after) for rank, after in _STOP_LINE.findall(launch.output)}
        if said.get(0) != step:
            raise PropertyFailed(
                f"every rank stopped after step {step}, but rank 0 did not log GracefulStop.report's line for it "
                f"({STOPPED_BY_SIGNAL.split(';')[0].format(step=step)})"
            )
        checkpoint_step = self.checkpoint_step(launch)
        if checkpoint_step != step:
            raise PropertyFailed(
                f"every rank stopped after step {step}, but the newest checkpoint holds step {checkpoint_step}"
            )
        return f"every rank stopped after step {step}, its checkpoint written, exit {STOPPED_EXIT_CODE} (3 processes)"

    def check_rank_zero_writes(self) -> str:
        if not self.launches:
            self.finished("two", 2)
        lines = sorted({line for report in self.reports.glob("rank*.txt") for line in report.read_text().splitlines()})
        if lines:
            more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
            raise PropertyFailed("other ranks wrote into the run directory: " + "; ".join(lines[:3]) + more)
        return f"no rank but 0 wrote into the run directory ({len(self.launches)} runs watched)"

    def checkpoint_step(self, launch: Launch) -> int | None:
        checkpoint = launch.run_dir / CHECKPOINTS / LAST
        if not checkpoint.is_file():
            return None
        return int(torch.load(checkpoint, map_location="cpu", weights_only=True).get("step", -1))


def signal_after_first_checkpoint(process: subprocess.Popen, run_dir: Path) -> None:
    """SIGTERM to torchrun (as ``docker stop`` sends it) once the run has written a checkpoint: it is training."""
    folder = run_dir / CHECKPOINTS
    while process.poll() is None and not any(STEP_FILE.fullmatch(path.name) for path in folder.glob(STEP_GLOB)):
        time.sleep(0.05)  # polling a condition (the first checkpoint), not a delay
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> str | None:
    """None when the two state dicts agree (bitwise, or within float32 rounding); else the first difference."""
    if a.keys() != b.keys():
        return f"different parameter names: {sorted(set(a) ^ set(b))[:3]}"
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        same = torch.equal(x, y) if exact or not x.is_floating_point() else torch.allclose(x, y, rtol=RTOL, atol=ATOL)
        if not same:
            gap = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            return f"{key} differs (largest difference {gap:.3g})"
    return None


def compare_states(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when the two named states are bitwise equal; else where the first difference is (``runs --same``'s walk)."""
    found = first_difference(a, b)
    return None if found is None else found.where


def load_spec(module: str) -> ContractSpec:
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ConfigError(
            f"no module {error.name!r} (checking {module}): name it as `python -m` would, e.g. experiments.toy, "
            "from the repository root"
        ) from None
    spec = getattr(imported, "CONTRACT", None)
    if not isinstance(spec, ContractSpec):
        raise ConfigError(
            f"{module} declares no CONTRACT = ContractSpec(...): the contract checks training experiments; "
            "add one as docs/new-experiment.md shows"
        )
    return spec


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value ``flags`` give ``name`` (``--name VALUE`` or ``--name=VALUE``; the last one wins), or None."""
    value = None
    for index, flag in enumerate(flags):
        if flag == name and index + 1 < len(flags):
            value = flags[index + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.contract", description=__doc__.splitlines()[0])
    parser.add_argument("module", help="the experiment, as `python -m` names it (experiments.toy)")
    parser.add_argument("--only", default="", help=f"comma-separated properties (default all): {', '.join(PROPERTIES)}")
    parser.add_argument(
        "--keep", default="", help="keep the runs in this folder (default: a temporary one, kept on FAIL)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take before it is a hang")
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    return argument_parser().parse_args(own), extra


@exits_with_one_line
def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()] or list(PROPERTIES)
    unknown = [name for name in chosen if name not in PROPERTIES]
    if unknown:
        raise ConfigError(f"--only: no property {', '.join(unknown)}; choose from {', '.join(PROPERTIES)}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout={args.timeout:g} must be above 0 seconds")
    spec = load_spec(args.module)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ddp-contract-"))
    if args.keep and work.exists() and any(work.iterdir()):
        raise ConfigError(f"--keep={work} is not empty: name a new or empty folder")
    contract = Contract(args.module, spec, extra, work, args.timeout)
    print(f"contract of {args.module}: torchrun at 1, 2 and 3 CPU processes (gloo), runs in {work}", flush=True)
    failed = 0
    for name in [name for name in PROPERTIES if name in chosen]:  # rank-zero-writes last: it reads every run's report
        try:
            detail = getattr(contract, "check_" + name.replace("-", "_"))()
            verdict = "SKIP" if detail.startswith("SKIP: ") else "PASS"
            print(f"{verdict}  {name:<17} {detail.removeprefix('SKIP: ')}", flush=True)
        except PropertyFailed as why:
            failed += 1
            print(f"FAIL  {name:<17} {why}", flush=True)
    if failed:
        print(
            f"{failed} of {len(chosen)} properties failed; every run's output is in {work} (<run>.log, runs/<run>/)",
            flush=True,
        )
    elif not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def run() -> NoReturn:
    raise SystemExit(main())


if __name__ == "__main__":
    run()
