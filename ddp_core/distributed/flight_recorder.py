"""torch's flight recorder, on by default: which collective each rank was in when one timed out. Each rank dumps
its record to the run directory; ``python -m ddp_core.distributed.flight_recorder RUN_DIR`` reads the dumps
(docs/faults.md, "Finding a hang")."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ddp_core.layout import FLIGHT_RECORDER

BUFFER_SIZE = 2000  # collectives kept per rank: a few hundred steps of DDP's bucket all-reduces
DUMP_FILE_PREFIX = FLIGHT_RECORDER  # + the rank: the run directory's name for the dumps
DUMP_VARIABLE = "TORCH_FR_DUMP_TEMP_FILE"  # torch's: where a rank dumps


def enable(backend: str) -> None:
    """Before the process group forms: record collectives, and on NCCL dump them when the watchdog times out."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_SIZE))
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


_set_here: str | None = None  # the value dump_to last set, so that a second run in this process moves it


def dump_to(run_dir: Path) -> None:
    """Dump to the run directory; a user's TORCH_FR_DUMP_TEMP_FILE wins, but not an earlier run's of this process."""
    global _set_here
    current = os.environ.get(DUMP_VARIABLE)
    if not current or current == _set_here:
        _set_here = os.environ[DUMP_VARIABLE] = str(run_dir / DUMP_FILE_PREFIX)


def _trace(stack_traces: bool) -> bytes:
    # JSON, not torch's pickle: a file in the run directory is read back later, and pickle runs code when loaded
    return torch._C._distributed_c10d._dump_fr_trace_json(True, stack_traces)  # collectives, stack traces


def last_collective() -> dict[str, Any] | None:
    """This rank's newest recorded collective: ``{"op", "seq", "sizes"}``, or None when nothing was recorded."""
    try:
        entries = json.loads(_trace(False)).get("entries", [])
    except Exception:
        return None
    if not entries:
        return None
    newest = entries[-1]
    return {
        "op": str(newest.get("profiling_name", "?")).split(":")[-1],
        "seq": newest.get("collective_seq_id"),
        "sizes": newest.get("input_sizes"),
    }


def dump(rank: int) -> Path | None:
    """Write this rank's recorded collectives where TORCH_FR_DUMP_TEMP_FILE says; the file, or None."""
    prefix = os.environ.get(DUMP_VARIABLE)
    if not prefix:
        return None
    path = Path(f"{prefix}{rank}")
    with contextlib.suppress(Exception):
        path.parent.mkdir(parents=True, exist_ok=True)  # a hang in set-up comes before the run directory is made
        path.write_bytes(_trace(True))
        return path
    return None


def describe(last: dict[str, Any] | None) -> str:
    """``all_reduce #12 (sizes [[3]])``: a collective as the timeout line names it."""
    return f"{last['op']} #{last['seq']} (sizes {last['sizes']})" if last else "no recorded collective"


def where_ranks_were(lasts: dict[int, dict[str, Any] | None]) -> tuple[str, int]:
    """``ranks 0, 2 in all_reduce #12 (sizes [[3]]); rank 1 in ...`` and how many different places."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(lasts):
        groups.setdefault(describe(lasts[rank]), []).append(rank)
    parts = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} in {what}" for what, ranks in groups.items()
    ]
    return "; ".join(parts), len(groups)


def read(run_dir: Path, last: int = 5, prefix: str = DUMP_FILE_PREFIX) -> str:
    """Each dumped rank's newest ``last`` collectives, one line each, from the JSON dumps ``dump`` writes."""

    def rank_of(path: Path) -> tuple[bool, int, str]:
        suffix = path.name.removeprefix(prefix)
        return (not suffix.isdigit(), int(suffix) if suffix.isdigit() else 0, path.name)

    lines = []
    for path in sorted(run_dir.glob(prefix + "*"), key=rank_of):
        try:
            entries = json.loads(path.read_bytes()).get("entries", [])
        except (ValueError, AttributeError):
            lines.append(f"{path.name}: not JSON (NCCL's watchdog writes pickles: read those with torch's fr_trace)")
            continue
        lines.append(f"rank {path.name.removeprefix(prefix)}: {len(entries)} recorded collective(s), newest last")
        for entry in entries[-last:]:
            lines.append(
                f"  #{entry.get('collective_seq_id')} {str(entry.get('profiling_name', '?')).split(':')[-1]} "
                f"sizes {entry.get('input_sizes')} -> {entry.get('output_sizes')}  {entry.get('state')}"
            )
    return "\n".join(lines) if lines else f"no {prefix}N files in {run_dir}"


def main(argv: list[str] | None = None) -> None:
    about = "Print each rank's newest recorded collectives from a run directory's dumps."
    parser = argparse.ArgumentParser(description=about)
    where = "the run directory (or the folder TORCH_FR_DUMP_TEMP_FILE points into)"
    parser.add_argument("run_dir", type=Path, help=where)
    prefix = f"the dumps' file name before the rank (default {DUMP_FILE_PREFIX})"
    parser.add_argument("--prefix", default=DUMP_FILE_PREFIX, help=prefix)
    parser.add_argument("--last", type=int, default=5, help="collectives per rank (default 5)")
    args = parser.parse_args(argv)
    print(read(args.run_dir, args.last, args.prefix))


if __name__ == "__main__":
    main()
