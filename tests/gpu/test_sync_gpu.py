"""Weight sync on GPUs takes effect (skipped without CUDA; `make test-gpu`): a bf16 trainer on
a GPU and an embedded engine with CUDA graphs; after a training step the engine is stale (its
log-probs of its own samples are the old weights', far from the trainer's), after the sync
(CUDA IPC on a shared GPU, NCCL to a GPU of its own) they are the trainer's again, to bf16
rounding, and a second round does the same on graphs captured before the first. The CPU test
of every path (tests/test_rollout_sync.py) runs gloo and host buffers; this is the device
path the GPU jobs take."""

from __future__ import annotations

import pytest
import ray
import torch

from miles.cluster.train_group import TrainGroup
from miles.data.synthetic import SyntheticSource
from miles.rollout.manager import RolloutManager
from miles.rollout.sync import sync_broadcast, sync_shared
from miles.train.batching import replica_micro_batches
from tests.test_rollout_sync import BUCKET, CFG, _engine_logprobs, _requests, _trainer_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the device sync paths need CUDA")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("path, share, gpus", [("shared", 0.5, 1), ("broadcast", 1.0, 2)])
def test_a_gpu_weight_sync_brings_the_engine_to_the_trainers_weights(cluster, seed, path, share, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"the {path} path needs {gpus} GPUs")
    group = TrainGroup(1, resources={"CPU": 1, "GPU": share})
    mgr = None
    try:
        group.call("build_model", CFG.to_dict(), seed, dtype="bfloat16")
        group.call("setup_training", lr=1e-2, total_steps=10)
        mgr = RolloutManager({"num_engines": 1, "max_running": 8, "max_len": 128, "gpus_per_engine": share},
                             {"config": CFG.to_dict(), "seed": seed, "dtype": "bfloat16"})

        def gap(round_: int) -> float:  # the worst sample's mean |engine - trainer| log-prob
            reqs = _requests(seed, round_)
            res = mgr.generate(reqs)
            pairs = zip(_engine_logprobs(res), _trainer_logprobs(group, reqs, res), strict=True)
            diffs = [(a - b.float()).abs() for a, b in pairs]
            assert all(torch.isfinite(d).all() for d in diffs)
            return max(d.mean().item() for d in diffs)

        start = gap(0)
        src = SyntheticSource(32, CFG.vocab_size, seed)
        for step in (1, 2):
            group.train_step(replica_micro_batches(src.batch(step, 4), 1, 1))
            stale = gap(10 + step)
            if path == "shared":
                info = sync_shared(group, mgr, BUCKET, version=step)
            else:
                info = sync_broadcast(group, mgr.engine_actors(), BUCKET, version=step, backend="nccl")
            after = gap(20 + step)
            print(f"{path} step {step}: gap at start {start:.2e}, stale {stale:.2e}, after the sync {after:.2e} "
                  f"({info['seconds']:.2f} s)")
            assert after <= max(3 * start, 2e-2), "the engine does not serve the trainer's weights after the sync"
            assert stale > 5 * after, "the training step changed too little to tell a sync from none"
    finally:
        if mgr is not None:
            mgr.shutdown()
        group.shutdown()
