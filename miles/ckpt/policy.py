"""When to save and what to keep: pure functions of iteration numbers.

An iteration is a count of completed optimizer steps, 1-indexed: iteration 50 is the state
after step 50, and a run resumed from it trains step 51 next. Counting from 1 is what makes
"keep every 100" keep iterations 100, 200, ... (a 0-indexed counter saved after step 100 as
99, and the multiples rule deleted it).
"""

from __future__ import annotations

from collections.abc import Iterable


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_name(name: str) -> int | None:
    """iter_0000050 -> 50; anything else -> None."""
    if len(name) == 12 and name.startswith("iter_") and name[5:].isdigit():
        return int(name[5:])
    return None


def saves_at(step: int, last_step: int, save_interval: int, warmup_save: bool, first_step: int = 1) -> bool:
    """Whether the state after `step` is saved: every save_interval steps, after the last step of
    the run, and (warmup_save) after step 1 of a run that starts from scratch (`first_step` is
    the run's first step: 1, or the resumed iteration + 1)."""
    return (step == last_step or (save_interval > 0 and step % save_interval == 0)
            or (warmup_save and first_step == 1 and step == 1))


def retained(iterations: Iterable[int], save_interval: int, keep_every: int | None,
             keep_last: int | None) -> set[int]:
    """The iterations to keep: the newest always; multiples of keep_every; the keep_last newest
    (None: all). The warmup save (iteration 1, when save_interval does not ask for it) is kept
    only while it is the newest or keep_every keeps it."""
    its = sorted(set(iterations))
    if not its:
        return set()
    newest = its[-1]

    def warmup(i: int) -> bool:
        return i == 1 and save_interval != 1

    regular = [i for i in its if not warmup(i)]
    keep = {newest}
    keep |= set(regular if keep_last is None else regular[-keep_last:])
    if keep_every:
        keep |= {i for i in its if i % keep_every == 0}
    return keep


def to_delete(iterations: Iterable[int], save_interval: int, keep_every: int | None,
              keep_last: int | None) -> list[int]:
    its = set(iterations)
    return sorted(its - retained(its, save_interval, keep_every, keep_last))
