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


def saves_at(step: int, last_step: int, save_interval: int, warmup_save: bool, first_step: int = 1,
             async_save: bool = False) -> bool:
    """Whether the state after `step` is saved: every save_interval steps, after the last step of
    the run, and a warm-up save (is_warmup)."""
    return (step == last_step or (save_interval > 0 and step % save_interval == 0)
            or is_warmup(step, last_step, save_interval, warmup_save, first_step, async_save))


def is_warmup(step: int, last_step: int, save_interval: int, warmup_save: bool, first_step: int = 1,
              async_save: bool = False) -> bool:
    """A save after this process's first step that no other rule asks for (warmup_save), so a
    broken save path fails in minute one: in a run from scratch (first_step 1), and in every
    resumed process that saves asynchronously (first_step: the resumed iteration + 1). The
    async writer's state is made lazily at a process's first save, so a resume proves nothing
    about it; a synchronous save is the same code as the one that saved what was resumed."""
    regular = step == last_step or (save_interval > 0 and step % save_interval == 0)
    return warmup_save and step == first_step and (first_step == 1 or async_save) and not regular


def retained(iterations: Iterable[int], save_interval: int, keep_every: int | None,
             keep_last: int | None, warmups: Iterable[int] = ()) -> set[int]:
    """The iterations to keep: the newest always; multiples of keep_every; the keep_last newest
    (None: all). A warm-up save (iteration 1 when save_interval does not ask for it, and the
    iterations `warmups` names: those a resumed process saved as one) is kept only while it is
    the newest or keep_every keeps it."""
    its = sorted(set(iterations))
    if not its:
        return set()
    newest = its[-1]
    marked = set(warmups)

    def warmup(i: int) -> bool:
        return (i == 1 and save_interval != 1) or i in marked

    regular = [i for i in its if not warmup(i)]
    keep = {newest}
    keep |= set(regular if keep_last is None else regular[-keep_last:])
    if keep_every:
        keep |= {i for i in its if i % keep_every == 0}
    return keep


def to_delete(iterations: Iterable[int], save_interval: int, keep_every: int | None,
              keep_last: int | None, warmups: Iterable[int] = ()) -> list[int]:
    its = set(iterations)
    return sorted(its - retained(its, save_interval, keep_every, keep_last, warmups))
