"""Run an experiment with every index its TrainSampler hands out written down, one file per process:

    torchrun ... -m tests.e2e.recording_sampler experiments.toy [flags]       (SAMPLES_DIR=/some/dir)

Each line of ``SAMPLES_DIR/<pid>.jsonl`` is ``[epoch, index]``, written as the loader pulls the index, so
what a rank trained on can be read back after it stopped. Test code only.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

from ddp_core.training.samplers import TrainSampler

handing_out = TrainSampler.__iter__


def recorded(self: TrainSampler) -> Iterator[int]:
    epoch = self.epoch  # read first: the sampler moves to the next epoch after its last index
    with (Path(os.environ["SAMPLES_DIR"]) / f"{os.getpid()}.jsonl").open("a") as record:
        for index in handing_out(self):
            record.write(json.dumps([epoch, index]) + "\n")
            record.flush()
            yield index


if __name__ == "__main__":
    TrainSampler.__iter__ = recorded  # type: ignore[method-assign]
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
