"""DDP's gradient-bucket layout, settled before a resumed run's first step so the resume stays bitwise.

DDP assigns gradients to buckets in parameter order for the first iteration and rebuilds the buckets
in the order the gradients became ready once that iteration is done (docs/design.md, "Bucket layout"). An element's
position in a bucket decides which rank starts its ring reduction, so the two layouts sum the same
gradients in different orders; with 3 or more ranks float addition then gives other last bits. A run
that never stopped uses the first layout for its step 1 only; a resumed run would use it for its first
step after the checkpoint, where the uninterrupted run already used the rebuilt one.

``settle_bucket_layout`` runs one throw-away backward pass so that DDP rebuilds its buckets right away,
then puts back everything that pass touched (gradients, buffers such as batch-norm statistics, RNG
states). The cost: one forward and backward pass, once per resume (measured in docs/decisions.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from ddp_core.training.seed import get_rng_state, set_rng_state

log = logging.getLogger(__name__)


def settle_bucket_layout(model: nn.Module, loss_of_sample: Callable[[], torch.Tensor]) -> bool:
    """Make ``model`` (DDP) rebuild its gradient buckets now, as a run that never stopped already has.

    ``loss_of_sample`` computes a loss through the same forward and loss function the training step
    uses (the compiled one too), on a batch of the training batch's shape; zeros will do, since only
    the order in which gradients become ready matters. Call it on every rank, when resuming, before
    the first training step. Weights, gradients, buffers and RNG states are as before it returns.
    Returns whether the buckets were rebuilt (False outside DDP, or where DDP never rebuilds them).
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel) or model._has_rebuilt_buckets:
        return False
    if model.find_unused_parameters and not model.static_graph:
        return False  # DDP keeps its first layout for the whole run then: nothing differs after a resume
    if any(p.grad is not None for p in model.parameters()):
        raise RuntimeError("settle_bucket_layout must run before the first backward pass: it discards gradients")
    started = time.perf_counter()
    buffers = [buffer.detach().clone() for buffer in model.buffers()]
    rng = get_rng_state()

    loss_of_sample().backward()  # DDP records the gradient-ready order and all-reduces once
    model.zero_grad(set_to_none=True)
    rebuilt = bool(model.reducer._rebuild_buckets())  # what DDP's next forward would do, done now
    model._has_rebuilt_buckets = model._has_rebuilt_buckets or rebuilt

    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers):
            buffer.copy_(saved)
    set_rng_state(rng)
    if rebuilt:
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()  # once per resume: the time logged is the pass's, not its launch's
        log.info(
            "DDP's gradient buckets settled in %.0f ms (one throw-away pass, so the resume is bitwise)",
            1000 * (time.perf_counter() - started),
        )
    else:
        log.warning(
            "DDP did not rebuild its gradient buckets: with 3 or more processes this resume may differ from "
            "an uninterrupted run in the last bits"
        )
    return rebuilt
