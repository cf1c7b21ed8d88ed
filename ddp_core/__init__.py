"""ddp_core: what every ddp-lab experiment shares. Nothing here knows about a particular experiment.

Grouped by concern; imports flow one way, from the top of this list down:

- ``ddp_core.torchrun``, ``ddp_core.entrypoint``: the command lines (torchrun with one-line failures; the
  container's entrypoint).
- ``ddp_core.process``: a worker's life: starting N without torchrun, stopping on a signal, leaving with a
  stated exit code.
- ``ddp_core.output``: what a run leaves behind, written by global rank 0 only: run directory, manifest,
  metrics, checkpoints, storage failures, logging and TensorBoard.
- ``ddp_core.config``: flags, variables and ``.env`` with their declared ranges.
- ``ddp_core.training``: seeding and RNG state, samplers, schedules, mixed precision, the non-finite guard,
  augmentation and the resident loader, exact metrics, DDP's bucket layout on resume.
- ``ddp_core.distributed``: torchrun's environment, the process group, CUDA checks, collective helpers,
  synchronized batch norm.
- ``ddp_core.errors``: the one-line errors everything above raises.
"""
