"""tests.e2e.faulty's step faults in every interpreter started with this folder on PYTHONPATH.

The --nproc path's workers are interpreters that torch.multiprocessing spawns: they never run faulty's
``__main__``, so the fault is installed here, as each starts, and fires on FAULT_RANK only.
"""

import os

if os.environ.get("FAULT") in ("crash", "hang", "sigkill"):
    from tests.e2e import faulty

    faulty.inject(lazy=True)
