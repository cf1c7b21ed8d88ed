"""ddp_core: what every ddp-lab experiment shares.

Process-group setup and teardown from torchrun's environment, seeding, samplers, rank-0 output,
checkpoints, collective helpers and run directories. Nothing here knows about a particular experiment.
"""
