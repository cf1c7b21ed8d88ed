"""The process group and what runs across it: torchrun's environment, the group's setup and
teardown, CUDA checks, collective helpers, synchronized batch norm. Imports nothing else of ddp_core
but errors.
"""
