"""What a training loop needs: seeding and RNG state, samplers, schedules, mixed precision, the
non-finite guard, batched augmentation and the resident loader, exact metrics, DDP's bucket layout on
resume.
"""
