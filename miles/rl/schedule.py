"""When each rollout is generated and on which weights: the placement and one-step-off as a
plan per step, a pure function the loop carries out (tests/test_rl_schedule.py).

The trainer's weights after step s are version s. Rollout s+1 is generated

- on-policy, disaggregated: on version s, as soon as step s has trained and evaluated (its
  generation overlaps the log and the checkpoint);
- on-policy, colocated: on version s, after step s's checkpoint (engines and trainer take
  turns in the GPUs' memory: the trainer is done with them first);
- one-step-off: on version s-1, while step s trains (the engines never wait for the trainer;
  each rollout is one update stale, the policy loss corrects for it).

The last step starts no rollout. An evaluation brings the engines to version s on its own
(miles.rl.loop), after any generation in flight.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sync:
    version: int  # the trainer's weights the engines take


@dataclass(frozen=True)
class Generate:
    step: int  # the rollout that starts generating (in the background)
    version: int  # on these weights (the engines take them first: a Sync before it)


@dataclass(frozen=True)
class StepPlan:
    while_training: tuple  # before the step's training starts
    after_training: tuple  # after its training and evaluation
    after_save: tuple  # after its log and checkpoint


def step_plan(step: int, last: int, off_policy: bool, colocated: bool) -> StepPlan:
    if step >= last:
        return StepPlan((), (), ())
    if off_policy:
        return StepPlan((Sync(step - 1), Generate(step + 1, step - 1)), (), ())
    if colocated:
        return StepPlan((), (Sync(step),), (Generate(step + 1, step),))
    return StepPlan((), (Sync(step), Generate(step + 1, step)), ())
