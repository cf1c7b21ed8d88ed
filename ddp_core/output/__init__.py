"""What a run leaves behind, written by global rank 0 only: the run directory, checkpoints, logging, TensorBoard."""
