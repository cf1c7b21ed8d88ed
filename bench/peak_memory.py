"""Run a module as ``__main__``, then print this process's peak CUDA memory.

    torchrun --standalone --nproc-per-node=1 -m bench.peak_memory experiments.cifar10 --epochs 3

The experiments do not record their peak memory, and torch's allocator statistics can only be read inside
the process that allocated: gpu_check launches the CIFAR10 runs through this wrapper so that each rank
prints one line (``LINE_PREFIX``) after the experiment has finished, whatever its exit status.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

LINE_PREFIX = "peak CUDA memory"
GIB = 2**30


def report() -> None:
    if not torch.cuda.is_initialized():  # a CPU run, or one that failed before touching the GPU
        return
    device = torch.cuda.current_device()
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rank = os.environ.get("RANK", "0")
    print(f"{LINE_PREFIX} rank {rank}: {allocated / GIB:.2f} GiB allocated, {reserved / GIB:.2f} GiB reserved", flush=True)


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m bench.peak_memory MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]  # the module parses sys.argv[1:] as if launched with -m MODULE
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        report()


if __name__ == "__main__":
    main()
