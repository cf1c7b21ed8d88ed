"""`python -m bench` (`make bench`): every ddp-lab benchmark, one after the other, each one's wall time
after it and the total at the end (the aim: under 10 minutes on the project's 2-core machine; docs/benchmarks.md).

The code lives in importable modules: processes started with the spawn method cannot find functions
defined in a package's `__main__`.
"""

import time

from bench import cifar10_pipeline, comm, ddp, ddp_overhead, model_speed, replica_check, step_overhead

started = time.perf_counter()
for module in (ddp, cifar10_pipeline, model_speed, ddp_overhead, step_overhead, replica_check, comm):
    began = time.perf_counter()
    module.main([])
    print(f"({module.__name__}: {time.perf_counter() - began:.0f} s)\n", flush=True)
print(f"make bench: {time.perf_counter() - started:.0f} s in all")
