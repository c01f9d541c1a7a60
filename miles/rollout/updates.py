"""How one weight update reaches a set of engines: staged, checked and swapped in whole, or
refused whole (the manager's update methods decide which engines and keep the version)."""

from __future__ import annotations

import time

import ray

from miles.rollout.weights import WeightSyncError


def _cause(err: Exception) -> Exception:
    """The exception raised inside an actor (Ray wraps it in a RayTaskError)."""
    return err.cause if isinstance(getattr(err, "cause", None), Exception) else err


def apply_update(engines: list, update: dict) -> dict:
    """One weight update to `engines` (EngineSlots): {"path"} each loads a directory; {"buckets"}
    (object-store refs with MD5s) or {"shared"} (share handles with fingerprints) are staged on
    every engine, checked, and committed whole only when all arrived (an error aborts them all:
    every engine keeps its weights)."""
    t0 = time.perf_counter()
    if "path" in update:  # one call per engine; an engine that refuses keeps its weights
        refs = [e.actor.update_from_disk.remote(update["path"], update["version"]) for e in engines]
        errors = []
        for e, ref in zip(engines, refs, strict=True):
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                errors.append(f"{e.url}: {_cause(err)}")
        if errors:
            rest = len(engines) - len(errors)
            raise WeightSyncError(f"{len(errors)} of {len(engines)} engines refused the weights at "
                                  f"{update['path']} and keep their previous ones"
                                  + (f" (the other {rest} serve version {update['version']})" if rest else "")
                                  + f": {errors[0]}")
        return {"seconds": time.perf_counter() - t0, "engines": len(engines)}
    ray.get([e.actor.begin_update.remote() for e in engines])
    if "shared" in update:
        staged = [e.actor.stage_shared.remote(*bucket) for e in engines for bucket in update["shared"]]
    else:
        staged = [e.actor.stage.remote(ref, sums) for e in engines for ref, sums in update["buckets"]]
    errors = []
    for ref in staged:  # in order: the first error is the cause, later ones its echo
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            errors.append(_cause(err))
    if errors:
        ray.get([e.actor.abort_update.remote() for e in engines])
        raise WeightSyncError(f"weight update failed, engines keep their weights: {errors[0]}")
    t1 = time.perf_counter()
    res = ray.get([e.actor.commit.remote(update["names"], update["version"]) for e in engines])
    return {"seconds": time.perf_counter() - t0, "bytes": res[0]["bytes"], "engines": len(engines),
            "stage_s": t1 - t0, "swap_s": max(r["swap_s"] for r in res)}
