"""What a training loop needs: seeds, samplers, schedules, precision, guards, augmentation, metrics, DDP's knobs."""
