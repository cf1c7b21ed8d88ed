"""The flight recorder's words: where each rank was when a collective timed out, and the dumps read back.
A real timeout at 3 processes, with the dumps it leaves, is in tests/e2e/test_faults.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddp_core.distributed import flight_recorder
from ddp_core.distributed.flight_recorder import DUMP_FILE_PREFIX, describe, read, where_ranks_were

ALL_REDUCE = {"op": "all_reduce", "seq": 12, "sizes": [[3]]}
ALL_GATHER = {"op": "all_gather", "seq": 12, "sizes": [[10]]}


def test_ranks_in_the_same_collective_are_one_group_and_different_collectives_are_named_apart():
    assert describe(ALL_REDUCE) == "all_reduce #12 (sizes [[3]])"
    assert describe(None) == "no recorded collective"
    assert where_ranks_were({0: ALL_REDUCE, 2: ALL_REDUCE}) == ("ranks 0, 2 in all_reduce #12 (sizes [[3]])", 1)
    # a rank that called another collective at the same point: the ranks called different collectives
    assert where_ranks_were({2: ALL_REDUCE, 0: ALL_REDUCE, 1: ALL_GATHER}) == (
        "ranks 0, 2 in all_reduce #12 (sizes [[3]]); rank 1 in all_gather #12 (sizes [[10]])",
        2,
    )
    assert where_ranks_were({0: ALL_REDUCE, 1: None})[1] == 2


def test_read_prints_each_ranks_newest_collectives_and_names_a_file_it_cannot_read(tmp_path: Path):
    entries = [
        {
            "collective_seq_id": seq,
            "profiling_name": "gloo:all_reduce",
            "input_sizes": [[seq]],
            "output_sizes": [[seq]],
            "state": "scheduled",
        }
        for seq in range(1, 9)
    ]
    for rank in (10, 2):
        (tmp_path / f"{DUMP_FILE_PREFIX}{rank}").write_text(json.dumps({"entries": entries[: rank // 2]}))
    (tmp_path / f"{DUMP_FILE_PREFIX}3").write_bytes(b"\x80\x04 a pickle")  # what NCCL's watchdog writes
    lines = read(tmp_path, last=2).splitlines()
    assert lines == [
        "rank 2: 1 recorded collective(s), newest last",
        "  #1 all_reduce sizes [[1]] -> [[1]]  scheduled",
        f"{DUMP_FILE_PREFIX}3: not JSON (NCCL's watchdog writes pickles: read those with torch's fr_trace)",
        "rank 10: 5 recorded collective(s), newest last",
        "  #4 all_reduce sizes [[4]] -> [[4]]  scheduled",
        "  #5 all_reduce sizes [[5]] -> [[5]]  scheduled",
    ]
    assert read(tmp_path / "nothing-here") == f"no {DUMP_FILE_PREFIX}N files in {tmp_path / 'nothing-here'}"
    (tmp_path / "nccl_trace_rank_1").write_text(json.dumps({"entries": entries[:1]}))  # compose's own prefix
    (tmp_path / "nccl_trace_rank_1.tmp").write_text("")  # a file torch did not finish: named, not fatal
    assert read(tmp_path, prefix="nccl_trace_rank_").splitlines()[0] == "rank 1: 1 recorded collective(s), newest last"


def test_each_run_in_a_process_dumps_into_its_own_directory_and_a_users_choice_wins(tmp_path: Path, monkeypatch):
    """A notebook (or a test) that makes two runs in one process gets each run's dumps in that run's
    directory; a TORCH_FR_DUMP_TEMP_FILE the user set is never replaced."""
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setattr(flight_recorder, "_set_here", None)
    for run in ("first", "second"):
        flight_recorder.dump_to(tmp_path / run)
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / run / DUMP_FILE_PREFIX)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/scratch/mine_")
    flight_recorder.dump_to(tmp_path / "third")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/scratch/mine_"
