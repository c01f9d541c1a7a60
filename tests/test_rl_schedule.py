"""miles.rl.schedule: when each rollout is generated and on which weights, for every placement
and one-step-off (the loop carries the plan out; tests/test_rl.py runs it whole)."""

from __future__ import annotations

import pytest

from miles.rl.schedule import Generate, Sync, step_plan


def generated(last: int, off_policy: bool, colocated: bool) -> dict[int, int]:
    """rollout step -> the weight version it is generated on, as the plans of steps 1..last
    start them (rollout 1 on version 0, started before the loop)."""
    out = {1: 0}
    for step in range(1, last + 1):
        p = step_plan(step, last, off_policy, colocated)
        for a in p.while_training + p.after_training + p.after_save:
            if isinstance(a, Generate):
                assert a.step not in out, f"rollout {a.step} started twice"
                out[a.step] = a.version
    return out


@pytest.mark.parametrize("colocated", [False, True])
def test_on_policy_rollouts_use_the_previous_steps_weights(colocated):
    assert generated(5, False, colocated) == {s: s - 1 for s in range(1, 6)}


def test_one_step_off_rollouts_are_one_update_stale():
    assert generated(5, True, False) == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3}


@pytest.mark.parametrize("off_policy, colocated", [(False, False), (False, True), (True, False)])
def test_every_generation_is_preceded_by_a_sync_to_its_weights(off_policy, colocated):
    for step in range(1, 6):
        p = step_plan(step, 6, off_policy, colocated)
        synced = None
        for a in p.while_training + p.after_training + p.after_save:
            if isinstance(a, Sync):
                synced = a.version
            else:
                assert synced == a.version, f"step {step}: rollout {a.step} starts on weights the engines lack"


@pytest.mark.parametrize("off_policy, colocated", [(False, False), (False, True), (True, False)])
def test_the_last_step_starts_nothing(off_policy, colocated):
    assert step_plan(4, 4, off_policy, colocated) == step_plan(9, 4, off_policy, colocated)
    p = step_plan(4, 4, off_policy, colocated)
    assert not (p.while_training or p.after_training or p.after_save)


def test_where_the_next_generation_starts():
    """Disaggregated on-policy: right after training (it overlaps the log and checkpoint);
    colocated: after the checkpoint (the trainer is done with the GPUs); one-step-off: before
    training (it overlaps training)."""
    assert step_plan(2, 5, False, False).after_training == (Sync(2), Generate(3, 2))
    assert step_plan(2, 5, False, True).after_training == (Sync(2),)
    assert step_plan(2, 5, False, True).after_save == (Generate(3, 2),)
    assert step_plan(2, 5, True, False).while_training == (Sync(1), Generate(3, 1))
