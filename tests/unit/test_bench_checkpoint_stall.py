"""bench.checkpoint_stall end to end on the small CNN: both kinds of save, and the dispatching thread's gaps."""

from __future__ import annotations

import time

from bench import checkpoint_stall


def test_one_save_of_each_kind_gives_every_figure(tmp_path, capsys):
    result = checkpoint_stall.main(["--saves", "2", "--dir", str(tmp_path), "--limit", "1000"])
    assert [len(result["stall_s"][kind]) for kind in ("in place", "background")] == [2, 2]
    assert len(result["background_write_s"]) == 2 and result["bytes"] > 0
    gaps = result["dispatch_gaps_s"]
    assert sorted(gaps) == ["beside nothing", "beside the write"]
    assert all(len(values) == 2 and min(values) >= 0 for values in gaps.values())
    assert "beside each background write" in capsys.readouterr().out
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
