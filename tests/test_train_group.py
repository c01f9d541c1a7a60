"""On a node with GPUs, actors that asked for none (train ranks, rollout engines) see none; a
group's rendezvous port is held from its publication on."""

from __future__ import annotations

import errno
import os
import socket

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


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def test_a_published_rendezvous_port_stays_held_until_the_group_takes_it(gpu_node):
    """Rank 0 publishes a port its store already listens on: a port found free, closed and
    bound only when the group starts was taken in between in a suite run (EADDRINUSE in
    init_distributed). Held from rendezvous_address on, by the rank's actor (the training group)
    and for a broadcast group (open_group: rank 0 takes the store, a member connects to it)."""
    import threading

    import torch

    from miles.cluster.train_group import TrainGroup
    from miles.rollout.weights import listening_store, open_group

    g = TrainGroup(2, tp=2)  # its group met through rank 0's store
    try:
        host, port = gpu_node.get(g.workers[0].rendezvous_address.remote())  # as a broadcast group asks
        assert _port_taken(host, port), f"rank 0 published {host}:{port} without holding it"
    finally:
        g.shutdown()

    store = listening_store("127.0.0.1")
    assert _port_taken("127.0.0.1", store.port)
    sums = {}

    def member(rank: int, listening=None):
        pg = open_group("127.0.0.1", store.port, rank, 2, "gloo", timeout_s=30, listening=listening)
        t = torch.tensor([float(rank + 1)])
        pg.allreduce([t]).wait()
        sums[rank] = t.item()

    other = threading.Thread(target=member, args=(1,), daemon=True)
    other.start()
    member(0, store)
    other.join(30)
    assert sums == {0: 3.0, 1: 3.0}, sums


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


def test_colocated_engines_share_the_trainer_ranks_gpus(gpu_node):
    """Colocated on GPUs (miles.cluster.placement): the trainer's placement group has a bundle
    per rank's GPU and the engine is started in the bundle of the rank it shares a GPU with,
    so Ray gives both the same GPU (the rank its 1 - gpus_per_engine, the engine the rest) and
    the node's other GPU stays free: RL on one GPU. A replacement takes over the same bundle."""
    from miles.cluster.placement import colocate_on_gpus
    from miles.cluster.train_group import TrainGroup
    from miles.rollout.manager import RolloutManager
    from plugins.deepseek_v4 import DeepSeekV4Config

    plan = colocate_on_gpus(world=1, num_engines=1, gpus_per_engine=0.4, cpus_per_worker=1, cpus_per_engine=1)
    g = TrainGroup(1, resources=plan.rank, bundles=plan.bundles)
    mgr = None
    try:
        mgr = RolloutManager({"num_engines": 1, "max_running": 2, "max_len": 32, "gpus_per_engine": 0.4,
                              "startup_timeout": 60.0},
                             {"config": DeepSeekV4Config.tiny().to_dict(), "seed": 0, "device": "cpu"},
                             colocation=(g.pg, plan))

        def gpus(actor):
            return gpu_node.get(actor.__ray_call__.remote(lambda a: gpu_node.get_runtime_context().get_accelerator_ids()
                                                          ["GPU"]))

        rank, engine = gpus(g.workers[0]), gpus(mgr.engines[0].actor)
        assert rank == engine and len(rank) == 1, (rank, engine)
        assert mgr.engines[0].bundle == 0
        assert gpu_node.available_resources().get("GPU", 0) == 1.0  # the other GPU: nobody's
    finally:
        if mgr is not None:
            mgr.shutdown()
        g.shutdown()
