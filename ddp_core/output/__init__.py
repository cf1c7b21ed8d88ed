"""What a run leaves behind, written by global rank 0 only: the run directory and its manifest and
metrics, checkpoints, storage failures, logging and TensorBoard.
"""
