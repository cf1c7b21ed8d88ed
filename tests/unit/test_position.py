"""ddp_core.lifecycle.position: where a run stands and where a resumed run continues, as arithmetic."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ddp_core.lifecycle.position import Position


@given(
    steps_per_epoch=st.integers(1, 50),
    batch=st.integers(1, 64),
    steps_done=st.integers(0, 400),
)
def test_a_resume_at_the_same_world_size_continues_exactly_where_the_checkpoint_was(steps_per_epoch, batch, steps_done):
    run = Position(steps_per_epoch, batch)
    run.begin_epoch()
    for _ in range(steps_done):
        if run.advance():
            run.begin_epoch()
    resumed = Position(steps_per_epoch, batch)
    resumed.load_state_dict(run.state_dict())
    resumed.begin_epoch()
    assert (resumed.step, resumed.epoch, resumed.consumed) == tuple(run.state_dict().values())
    assert resumed.start == resumed.step  # the steps this process trains are counted from here
    assert resumed.steps_left(range(10**6), 1) == run.epoch_end - run.step  # the loader's length is not consulted
    assert 0 < resumed.steps_left(range(0), 1) <= steps_per_epoch


@given(
    samples=st.integers(8, 2000),
    batch=st.integers(1, 16),
    old_world=st.integers(1, 8),
    new_world=st.integers(1, 8),
    fraction=st.floats(0, 0.99),
)
def test_at_another_world_size_the_samples_decide_and_the_loader_fits_the_epochs_end(
    samples, batch, old_world, new_world, fraction
):
    """The position is kept in samples: the new world's step is where its own steps would stand after those
    samples, and the epoch ends after the batches the sampler still deals this world."""
    old_per_step, new_per_step = batch * old_world, batch * new_world
    old_spe, new_spe = samples // old_per_step, samples // new_per_step
    if old_spe == 0 or new_spe == 0:
        return
    done = int(old_spe * fraction)
    checkpoint = {"step": old_spe + done, "epoch": 1, "epoch_samples": done * old_per_step}
    resumed = Position(new_spe, new_per_step)
    resumed.load_state_dict(checkpoint)
    resumed.refit()
    assert resumed.step == new_spe + (done * old_per_step) // new_per_step
    resumed.begin_epoch()
    left_in_sampler = (samples - done * old_per_step) // new_world // batch  # what this rank's loader holds
    left = resumed.steps_left(range(left_in_sampler), 1)
    assert left == left_in_sampler and resumed.epoch_end == 2 * new_spe  # the epoch ends where the new plan says
    for _ in range(left):
        ended = resumed.advance()
    assert left == 0 or (ended and resumed.epoch == 2 and resumed.consumed == 0)
