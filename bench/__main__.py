"""`python -m bench` (`make bench`): every ddp-lab benchmark, one after the other.

The code lives in importable modules: processes started with the spawn method cannot find functions
defined in a package's `__main__`.
"""

from bench import cifar10_models, cifar10_pipeline, ddp, ddp_overhead, replica_check

ddp.main([])
cifar10_pipeline.main([])
cifar10_models.main([])
ddp_overhead.main([])
replica_check.main([])
