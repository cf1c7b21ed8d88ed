"""tools.write_audit names every write into the watched folder by a rank other than 0, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def audited(tmp_path: Path, rank: str) -> tuple[Path, Path]:
    watched, outside, report = tmp_path / "run", tmp_path / "elsewhere", tmp_path / "report"
    for folder in (watched, outside, report):
        folder.mkdir()
    (watched / "existing.txt").write_text("read me")
    env = {**os.environ, "RANK": rank, "WATCHED": str(watched), "OUTSIDE": str(outside), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "tools.write_audit", str(report), str(watched), "tests.unit.write_audit_target"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=120,
    )
    return report, watched


def test_every_kind_of_write_by_another_rank_is_named_once(tmp_path: Path):
    report, _ = audited(tmp_path, rank="1")
    assert [path.name for path in report.iterdir()] == ["rank1.txt"]
    lines = report.joinpath("rank1.txt").read_text().splitlines()
    assert sorted(lines) == sorted(
        [
            "rank 1 wrote opened.txt",
            "rank 1 wrote os_open.bin",
            "rank 1 wrote path.txt",
            "rank 1 os.mkdir folder",
            "rank 1 os.rename moved.txt",
            "rank 1 wrote copied.txt",
            "rank 1 shutil.copyfile copied.txt",
            "rank 1 torch.save saved.pt",
            "rank 1 torch.save saved_str.pt",
            "rank 1 os.remove path.txt",
        ]
    ), lines  # not existing.txt (only read) nor fine.txt (outside)


def test_rank_zero_writes_freely(tmp_path: Path):
    report, watched = audited(tmp_path, rank="0")
    assert list(report.iterdir()) == [] and (watched / "saved.pt").is_file()
