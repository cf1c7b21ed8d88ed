"""bench.checkpoint_stall end to end on the small CNN: each kind of save, and the dispatching thread's gaps."""

from __future__ import annotations

import time

from bench import checkpoint_stall


def test_one_save_of_each_kind_gives_every_figure(tmp_path, capsys):
    result = checkpoint_stall.main(["--saves", "2", "--dir", str(tmp_path), "--limit", "1000"])
    assert {kind: len(stalls) for kind, stalls in result["stall_s"].items()} == {
        "in place": 2,
        "thread": 2,
        "process": 2,
    }
    assert {kind: len(writes) for kind, writes in result["background_write_s"].items()} == {"thread": 2, "process": 2}
    assert result["bytes"] > 0 and sorted(result["ratio"]) == ["process", "thread"]
    gaps = result["dispatch_gaps_s"]
    assert {kind: len(values) for kind, values in gaps.items()} == {"thread": 2, "process": 2, "none": 4}
    assert min(min(values) for values in gaps.values()) >= 0
    printed = capsys.readouterr().out
    assert "| background, --checkpoint-writer process |" in printed and "| (as long beside no write) |" in printed
    assert not list(tmp_path.iterdir())  # its temporary folder is gone


def test_only_gaps_over_a_millisecond_count():
    def one_pause_of(seconds: float):
        answers = iter([True, "pause", False])  # an op, a pause then an op, the end

        def going_on() -> bool:
            answer = next(answers)
            if answer == "pause":
                time.sleep(seconds)  # the gap to count, as a writer holding the GIL makes it
            return bool(answer)

        return going_on

    assert checkpoint_stall.dispatch_gaps(lambda: False) == 0.0
    assert 0.009 <= checkpoint_stall.dispatch_gaps(one_pause_of(0.01)) < 0.5
