"""What tests/unit/test_write_audit.py runs under tools.write_audit: writes of every kind into WATCHED, and
reads and writes that must not count (a read inside, a write outside). Test code only."""

import os
import shutil
from pathlib import Path

import torch

watched, outside = Path(os.environ["WATCHED"]), Path(os.environ["OUTSIDE"])
(watched / "existing.txt").read_text()
(outside / "fine.txt").write_text("not watched")
with open(watched / "opened.txt", "w") as handle:
    handle.write("x")
os.close(os.open(watched / "os_open.bin", os.O_WRONLY | os.O_CREAT))
(watched / "path.txt").write_text("x")
os.mkdir(watched / "folder")
os.replace(outside / "fine.txt", watched / "moved.txt")
shutil.copyfile(watched / "existing.txt", watched / "copied.txt")
torch.save({"a": 1}, watched / "saved.pt")
torch.save({"a": 1}, str(watched / "saved_str.pt"))
os.remove(watched / "path.txt")
