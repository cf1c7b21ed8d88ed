"""Tools that train nothing: they check or measure the machines a job runs on.

- ``tools.preflight`` (a package): checks a whole (multi-node) job before the real run and prints one table.
- ``tools.commbench``: the collective-communication benchmark, in the manner of nccl-tests.

Launch them as their documented names, ``experiments.preflight`` and ``experiments.commbench`` (thin aliases,
so that EXPERIMENT=NAME in the container and ``python -m experiments``' listing find them), or as
``python -m tools.preflight`` / ``-m tools.commbench``. Imports flow one way: tools may import experiments and
ddp_core, experiments only ddp_core (an alias runs its tool by the module's name), ddp_core neither.
"""
