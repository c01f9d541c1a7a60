"""Where the trainer's ranks and the rollout engines run: Ray resources and placement-group
bundles (a small pure policy; the RL loop applies it).

Disaggregated (the default): each trainer rank holds a whole device, the engines ask for their
own (`rollout.gpus_per_engine`) wherever Ray finds them. Colocated on GPUs: the two take turns
on the same GPUs (the trainer sleeps while the engines generate, the engines release their
weights and cache while it trains), so one placement group has a bundle per trainer GPU, and
engine e shares bundle e with trainer rank e: Ray gives both the same GPU, the engine
`gpus_per_engine` of it and the rank the rest. Colocated on CPUs needs no bundles: engines and
ranks share the node's cores.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Colocation:
    bundles: list[dict[str, float]]  # one per trainer rank, rank = bundle index
    rank: dict[str, float]  # each trainer rank's actor resources
    engine: dict[str, float]  # each engine's actor resources
    engine_bundles: list[int]  # the bundle (the trainer rank's GPU) each engine shares


def colocate_on_gpus(world: int, num_engines: int, gpus_per_engine: float, cpus_per_worker: float,
                     cpus_per_engine: float) -> Colocation:
    """Engines 0..num_engines-1 on trainer ranks 0..num_engines-1's GPUs, `gpus_per_engine` of
    each (Ray's share: what the engine may hold while the trainer sleeps is its own memory);
    each bundle also holds the CPUs of the rank and of the engine it hosts."""
    if not 0 < gpus_per_engine < 1:
        raise ValueError(f"rollout.gpus_per_engine={gpus_per_engine:g}: colocated on GPUs an engine shares one "
                         "trainer GPU, so it asks for a share of it between 0 and 1 (e.g. 0.5)")
    if not 1 <= num_engines <= world:
        raise ValueError(f"rollout.num_engines={num_engines}: colocated, each engine shares one of the trainer's "
                         f"{world} GPU(s); at most {world} engines")
    bundles = [{"CPU": cpus_per_worker + (cpus_per_engine if i < num_engines else 0.0), "GPU": 1.0}
               for i in range(world)]
    return Colocation(bundles, {"CPU": cpus_per_worker, "GPU": 1.0 - gpus_per_engine},
                      {"CPU": cpus_per_engine, "GPU": gpus_per_engine}, list(range(num_engines)))
