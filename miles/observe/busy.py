"""Who worked and who waited in an RL step. The engines' work (generation with its rewards,
evaluation, weight sync) is kept as intervals on the perf_counter clock, since generation runs
in the rollout thread across step boundaries; the trainer's work is the step's own timed calls.
Each side's idle time in a step's window is the window less its work there
(perf/trainer_idle_time, perf/engine_idle_time)."""

from __future__ import annotations

import contextlib
import threading
import time


def busy_within(spans: list[tuple[float, float | None]], a: float, b: float) -> float:
    """Seconds of [a, b] covered by the union of `spans` (start, end); a span still open (end
    None) runs to b."""
    clipped = sorted((max(s, a), min(b if e is None else e, b)) for s, e in spans)
    total, reach = 0.0, a
    for s, e in clipped:
        if e > max(s, reach):
            total += e - max(s, reach)
            reach = e
    return total


class Busy:
    """One side's busy intervals; spans open and close in any thread."""

    def __init__(self) -> None:
        self._spans: list[list[float | None]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def span(self):
        span = [time.perf_counter(), None]
        with self._lock:
            self._spans.append(span)
        try:
            yield
        finally:
            span[1] = time.perf_counter()

    def within(self, a: float, b: float) -> float:
        """Busy seconds in [a, b]; spans that ended before a are dropped (windows only move on)."""
        with self._lock:
            self._spans = [s for s in self._spans if s[1] is None or s[1] > a]
            spans = [(s, e) for s, e in self._spans]
        return busy_within(spans, a, b)
