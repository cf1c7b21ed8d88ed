"""Measurements, not experiments: nothing here trains a model you keep.

- Benchmarks (`make bench`, `python -m bench`): ratios measured side by side in one run.
  `ddp` (DDP vs a single process, collective batching), `cifar10_pipeline`, `model_speed` (the CIFAR10 models' step),
  `ddp_overhead`, `replica_check` (the cost of comparing the ranks' models); `timing` holds their clock helpers.
- Stress loops that measure how often a rare failure happens (hundreds of runs; docs/benchmarks.md):
  `stress` (gloo's teardown abort, `make stress`) with its reproducers `teardown_control` (plain torch)
  and `spawn_teardown` (the torch.multiprocessing path), `missing_node` (a node that never starts) and
  `cannot_choose` (a node that cannot choose its interface), on hosts made of network namespaces: `netns`, which
  tests/hosts uses too. The loop that counts the test suite's own
  python stand-in's misreports is the suite's: `python -m tests.prefork_signal_race`.
- The GPU box's first check (`make gpu-check`): `gpu_check` runs everything, `gpu_report` reads it back;
  `gpu_gaps` reads a `--profile` trace for where the GPU waited.

Training experiments are in `experiments/` (`python -m experiments` lists them apart from the collective
demos and the tools); the tools that train nothing (preflight, the communication benchmark) are in `tools/`.
"""
