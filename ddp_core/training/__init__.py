"""What a training loop needs: seeds and RNG state, samplers, schedules, mixed precision, the non-finite guard,
augmentation and loaders, exact metrics, DDP's buckets and comm knobs."""
