"""The process group and what runs across it: torchrun's environment, the group, CUDA checks, collectives."""
