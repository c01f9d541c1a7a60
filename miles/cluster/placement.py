"""Bundle plans: which placement-group bundles the trainer and the rollout engines use.

Colocated: training and generation share the same devices (the trainer sleeps while the
engines generate and the other way round), so engines take the trainer's bundles.
Disaggregated: engines get their own bundles after the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BundlePlan:
    bundles: list[dict[str, float]]
    train: list[int]  # bundle index of each train rank, in rank order
    engines: list[list[int]]  # bundle indices of each engine replica


def plan_bundles(train_world: int, n_engines: int, devices_per_engine: int, colocate: bool,
                 device: str = "GPU", cpus_per_bundle: float = 1.0) -> BundlePlan:
    """One bundle per device. Rank i sits on bundle i (Megatron's rank order = physical order)."""
    if train_world < 1 or devices_per_engine < 1 or n_engines < 0:
        raise ValueError("train_world and devices_per_engine must be >= 1, n_engines >= 0")
    per = {"CPU": cpus_per_bundle} if device == "CPU" else {"CPU": cpus_per_bundle, device: 1.0}
    if colocate:
        need = n_engines * devices_per_engine
        if need > train_world:
            raise ValueError(f"colocated: {n_engines} engines x {devices_per_engine} devices = {need} exceed the "
                             f"trainer's {train_world} devices")
        engines = [list(range(e * devices_per_engine, (e + 1) * devices_per_engine)) for e in range(n_engines)]
        return BundlePlan([dict(per) for _ in range(train_world)], list(range(train_world)), engines)
    total = train_world + n_engines * devices_per_engine
    engines = [list(range(train_world + e * devices_per_engine, train_world + (e + 1) * devices_per_engine))
               for e in range(n_engines)]
    return BundlePlan([dict(per) for _ in range(total)], list(range(train_world)), engines)
