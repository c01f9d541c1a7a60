"""A torch.profiler window over chosen training steps of one rank (`log.profile` in a job file).

Shapes, stacks and memory are recorded only when asked: stack capture is known to stall
NCCL collectives at scale. The trace is Chrome's format (chrome://tracing, Perfetto).
"""

from __future__ import annotations

from pathlib import Path

import torch


def default_ranks(layout: list[dict]) -> list[int]:
    """The ranks profiled when log.profile.ranks is not given: the first rank (TP, CP and DP
    rank 0) of the pipeline's first, middle and last stage, where a pipeline step's time goes
    differently (embedding, blocks, head and loss). `layout`: each rank's coordinates, in rank
    order (TrainGroup.layout)."""
    pp = max((x["pp"] for x in layout), default=1)
    stages = sorted({0, pp // 2, pp - 1})
    first = {}
    for rank, x in enumerate(layout):
        if x["tp_rank"] == x["cp_rank"] == x["dp_rank"] == 0:
            first.setdefault(x["pp_rank"], rank)
    return [first[s] for s in stages if s in first]


class Profile:
    def __init__(self, trace: Path, record_shapes: bool = False, with_stack: bool = False,
                 profile_memory: bool = False):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.trace = Path(trace)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=record_shapes,
                                           with_stack=with_stack, profile_memory=profile_memory)
        self.prof.start()

    def stop(self) -> Path:
        self.prof.stop()
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.trace))
        return self.trace
