"""On a node with GPUs, actors that asked for none (train ranks, rollout engines) see none."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def gpu_node():
    """A local Ray cluster whose node declares 2 GPUs, CUDA_VISIBLE_DEVICES=0,1 as on a GPU node
    (this machine may have none: Ray schedules by the declared resources, and no actor below
    asks for one); Ray's processes inherit the variable, so an actor sees it unless hidden."""
    ray = pytest.importorskip("ray")
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    try:
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield ray
        ray.shutdown()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def test_ranks_without_a_gpu_see_none_on_a_node_with_gpus(gpu_node):
    """Ray leaves an actor that asked for no GPU every GPU of its node: on an H200 node the two
    ranks of `miles convert` both took device 0 and nccl refused them ("Duplicate GPU
    detected"). TrainGroup hides the GPUs from such ranks, so they use gloo on the host."""
    from miles.cluster.train_group import TrainGroup

    g = TrainGroup(2, tp=2)
    try:
        seen = gpu_node.get([w.__ray_call__.remote(lambda w: os.environ.get("CUDA_VISIBLE_DEVICES"))
                             for w in g.workers])
    finally:
        g.shutdown()
    assert seen == ["", ""], f"CUDA_VISIBLE_DEVICES in the ranks: {seen}"


def test_engines_without_a_gpu_see_none_on_a_node_with_gpus(gpu_node):
    """The same for rollout engines of `rollout.gpus_per_engine: 0`: each would otherwise take
    device 0 beside the trainer's rank there."""
    from miles.rollout.manager import RolloutManager
    from plugins.deepseek_v4 import DeepSeekV4Config

    mgr = RolloutManager({"num_engines": 1, "max_running": 2, "max_len": 32},
                         {"config": DeepSeekV4Config.tiny().to_dict(), "seed": 0})
    try:
        seen = gpu_node.get([e.actor.__ray_call__.remote(lambda e: os.environ.get("CUDA_VISIBLE_DEVICES"))
                             for e in mgr.engines])
    finally:
        mgr.shutdown()
    assert seen == [""], f"CUDA_VISIBLE_DEVICES in the engine: {seen}"
