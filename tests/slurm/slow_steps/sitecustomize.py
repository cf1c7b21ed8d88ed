"""Test-only: every optimizer step of a torchrun worker sleeps STEP_SLEEP_S seconds (tests/slurm).

On PYTHONPATH, Python imports this at start-up. It makes a run last long enough for Slurm's time-limit
signal to arrive mid-run, whatever the speed of the machine: Slurm checks time limits every 30 s, so the
signal comes 20 to 50 s before --time runs out. A sleep changes no number the run computes (the final
weights stay bitwise those of the unslowed reference run), and costs no CPU. Only processes torchrun
started as workers (LOCAL_RANK set) are slowed; the agent and everything else are untouched.
"""

import os

if os.environ.get("STEP_SLEEP_S") and os.environ.get("LOCAL_RANK") is not None:
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _SLEEP_S = float(os.environ["STEP_SLEEP_S"])
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: time.sleep(_SLEEP_S))
