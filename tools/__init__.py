"""Tools that train nothing: they check or measure the machines a job runs on.

- ``tools.preflight`` (a package): checks a whole (multi-node) job before the real run and prints one table.
- ``tools.commbench``: the collective-communication benchmark, in the manner of nccl-tests.

Launch them as their documented names, ``experiments.preflight`` and ``experiments.commbench`` (thin aliases,
so that EXPERIMENT=NAME in the container and ``python -m experiments``' listing find them), or as
``python -m tools.preflight`` / ``-m tools.commbench``. Imports flow one way: experiments may import tools,
tools import ddp_core, and ddp_core imports neither.
"""
