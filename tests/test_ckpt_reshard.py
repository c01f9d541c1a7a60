"""Checkpoints across layouts: Megatron dist_checkpointing through real TP/EP worker groups,
HF checkpoints read slice by slice, and `miles convert` both ways."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NEAR_TIE, choice_margin, randomize

pytest.importorskip("megatron.core")

from miles.ckpt import store  # noqa: E402
from miles.data.synthetic import SyntheticSource  # noqa: E402
from miles.train.batching import replica_micro_batches  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM  # noqa: E402
from plugins.deepseek_v4.checksum import tensor_md5  # noqa: E402
from plugins.deepseek_v4.hf_io import load_safetensors_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = DeepSeekV4Config.tiny()
GPU = torch.cuda.device_count() >= 2  # a GPU a rank (nccl, pinned host copies) where there are GPUs, else gloo


def _group(seed: int, moments: str = "float32", **par):
    from miles.cluster.train_group import TrainGroup

    g = TrainGroup(2 if par else 1, resources={"CPU": 1, "GPU": 1} if GPU else None, **par)
    g.call("build_model", CFG.to_dict(), seed, deterministic=True)
    g.call("setup_training", lr=3e-3, min_lr=3e-4, total_steps=10, weight_decay=0.01, beta2=0.95, moments=moments)
    return g


def _full(g) -> dict[str, torch.Tensor]:
    """The whole model as one process holds it (TP slices gathered, each tensor from its owner)."""
    return {k: v for bucket in g.export_weights() for k, v in bucket.items()}


def _step(g, src, step: int, dp: int) -> float:
    return g.train_step(replica_micro_batches(src.batch(step, 4), dp, 2))[0]["loss"]


def _untied_step(weights: dict[str, torch.Tensor], src, first: int) -> int:
    """The first step from `first` on whose micro-batches the model of `weights` meets no near
    tie (conftest.choice_margin): layouts that round otherwise could choose otherwise there."""
    model = DeepSeekV4ForCausalLM(CFG).eval()
    model.load_state_dict(weights)
    for step in range(first, first + 20):
        mbs = [mb for rep in replica_micro_batches(src.batch(step, 4), 1, 2) for mb in rep]
        if min(choice_margin(model, mb.input_ids, doc_ids=mb.doc_ids) for mb in mbs) > NEAR_TIE:
            break
    return step


def _save(g, directory: Path) -> None:
    directory.mkdir(parents=True)
    g.call("save_checkpoint", str(directory))


def _same_bytes(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    bad = [k for k in a if tensor_md5(a[k]) != tensor_md5(b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def test_reshard_round_trip_keeps_every_byte_and_the_optimizer(ray_cluster, tmp_path, seed):
    """Saved at TP=2 and at EP=2, loaded at TP=1: byte-identical tensors; TP=1 saves, TP=2
    loads: byte-identical again (MD5 table printed). The optimizer's moments reshard too: after
    TP=2 -> TP=1 -> TP=2 the next step is TP=2's own, bit for bit; the step a TP=1 worker takes
    after loading the TP=2 checkpoint is TP=2's to float rounding, and without the moments it
    is not."""
    src = SyntheticSource(32, CFG.vocab_size, seed)
    nxt = None  # the step taken after the saves: 3, or later where 3's batch meets a near tie

    def run(par: dict, dp: int, name: str):
        nonlocal nxt
        g = _group(seed, **par)
        for s in (1, 2):
            _step(g, src, s, dp)
        _save(g, tmp_path / name)
        before = _full(g)
        nxt = nxt or _untied_step(before, src, 3)
        _step(g, src, nxt, dp)
        after = _full(g)
        g.shutdown()
        return before, {k: after[k].double() - before[k].double() for k in before}

    w_tp2, delta_tp2 = run({"tp": 2}, 1, "tp2")
    w_ep2, _ = run({"ep": 2}, 2, "ep2")

    g1 = _group(seed + 1)  # other init: everything must come from the checkpoint
    g1.call("load_checkpoint", str(tmp_path / "ep2"), same_layout=False)
    _same_bytes(_full(g1), w_ep2, "EP=2 -> TP=1")
    g1.call("load_checkpoint", str(tmp_path / "tp2"), same_layout=False)
    w1 = _full(g1)
    _same_bytes(w1, w_tp2, "TP=2 -> TP=1")
    _save(g1, tmp_path / "tp1")
    _step(g1, src, nxt, 1)
    delta_tp1 = {k: v.double() - w1[k].double() for k, v in _full(g1).items()}
    g1.shutdown()

    g2 = _group(seed + 2, tp=2)
    g2.call("load_checkpoint", str(tmp_path / "tp1"), same_layout=False)
    _same_bytes(_full(g2), w_tp2, "TP=2 -> TP=1 -> TP=2")
    _step(g2, src, nxt, 1)  # the moments made the round trip too: TP=2's own next step, bit for bit
    back = {k: v.double() - w_tp2[k].double() for k, v in _full(g2).items()}
    assert all(torch.equal(back[k], delta_tp2[k]) for k in back), "optimizer state changed in TP=2 -> 1 -> 2"
    g2.shutdown()
    print("\ntensor                                   md5 (saved at TP=2 = after TP=1 and TP=2 again)")
    for k in sorted(w_tp2)[:12]:
        print(f"{k:40s} {tensor_md5(w_tp2[k])}")

    fresh = _group(seed + 3)  # the planted bug: weights without the optimizer's moments
    fresh.call("load_checkpoint", str(tmp_path / "tp2"), same_layout=False, with_optimizer=False)
    _step(fresh, src, nxt, 1)
    delta_fresh = {k: v.double() - w1[k].double() for k, v in _full(fresh).items()}
    fresh.shutdown()

    def gap(d: dict) -> float:
        """|update - TP=2's update| / |TP=2's update| over the whole model (L2)."""
        for v in list(d.values()) + list(delta_tp2.values()):
            assert torch.isfinite(v).all()
        diff = sum(float(((d[k] - delta_tp2[k]) ** 2).sum()) for k in d)
        return (diff / sum(float((v ** 2).sum()) for v in delta_tp2.values())) ** 0.5

    print(f"update gap after resharding {gap(delta_tp1):.2e}; without the moments {gap(delta_fresh):.2e}")
    assert gap(delta_tp1) < 1e-3, f"TP=1 step after resharding differs from TP=2's by {gap(delta_tp1):.2e}"
    assert gap(delta_fresh) > 1e-2, "the check cannot tell a lost optimizer state"


def test_bf16_moments_resume_bit_for_bit(ray_cluster, tmp_path, seed):
    """train.optim.moments: bfloat16 through a checkpoint: the loaded moments are bf16 before
    any step (their memory is the plan's from the load on), and the step after the load is the
    step the saving run took next, bit for bit; a run keeping fp32 moments takes another step
    (the check can tell them apart)."""
    src = SyntheticSource(32, CFG.vocab_size, seed)

    def after_save(moments: str, name: str) -> tuple[dict, dict]:
        g = _group(seed, moments)
        for s in (1, 2):
            _step(g, src, s, 1)
        _save(g, tmp_path / name)
        before = _full(g)
        _step(g, src, 3, 1)
        delta = {k: v.double() - before[k].double() for k, v in _full(g).items()}
        g.shutdown()
        return before, delta

    before, delta = after_save("bfloat16", "bf16")
    _, delta_fp32 = after_save("float32", "fp32")
    g = _group(seed + 1, "bfloat16")  # other init: everything comes from the checkpoint
    g.call("load_checkpoint", str(tmp_path / "bf16"), same_layout=True)
    # kept in bf16 from the load on (torch's load_state_dict makes them fp32), not at the next step
    assert g.call("inspect", "moment_dtypes") == [["torch.bfloat16"]]
    _same_bytes(_full(g), before, "bf16 moments: the saved weights")
    _step(g, src, 3, 1)
    resumed = {k: v.double() - before[k].double() for k, v in _full(g).items()}
    g.shutdown()
    for d in (delta, delta_fp32, resumed):
        assert all(torch.isfinite(v).all() for v in d.values())
    assert all(torch.equal(resumed[k], delta[k]) for k in delta), "the resumed step differs"
    assert not all(torch.equal(delta_fp32[k], delta[k]) for k in delta), "fp32 and bf16 moments took one step"


def test_workers_read_only_their_slices_of_an_hf_checkpoint(ray_cluster, tmp_path, seed):
    """TP=2 and EP=2 groups built from an HF checkpoint: the same log-probs as one process
    loading it; each rank reads only the tensors it holds (its experts), with at most one
    tensor in flight (peak <= the largest tensor), so its peak is its shard + one tensor."""
    model = randomize(DeepSeekV4ForCausalLM(CFG, seed=seed), seed)
    model.save_pretrained(tmp_path / "hf", max_shard_bytes=1 << 20)
    on_disk = load_safetensors_dir(tmp_path / "hf")
    largest = max(t.numel() * t.element_size() for t in on_disk.values())
    batch = replica_micro_batches(SyntheticSource(32, CFG.vocab_size, seed).batch(1, 2), 1, 2)

    one = _group(seed + 1)
    info = one.call("load_hf", str(tmp_path / "hf"))[0]
    _same_bytes(_full(one), on_disk, "HF -> one worker")
    assert sorted(info["names"]) == sorted(on_disk)
    want = one.forward_logprobs(batch)[0][0]
    one.shutdown()
    for par in ({"tp": 2}, {"ep": 2}):
        g = _group(seed + 2, **par)
        infos = g.call("load_hf", str(tmp_path / "hf"))
        got = g.forward_logprobs(batch * (2 if "ep" in par else 1))[0][0]
        g.shutdown()
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        for i in infos:
            assert i["peak_bytes"] <= largest, par
        if "ep" in par:
            e0 = {n for n in infos[0]["names"] if ".experts." in n}
            e1 = {n for n in infos[1]["names"] if ".experts." in n}
            assert e0 and e1 and not e0 & e1, "each EP rank reads its own experts only"
            assert infos[0]["shard_bytes"] < sum(t.numel() * t.element_size() for t in on_disk.values())


def test_convert_hf_to_dist_to_hf_is_byte_identical(ray_cluster, tmp_path, seed):
    """`miles convert hf-to-dist --tp 2` then `dist-to-hf` on one worker and on two (the
    commands' functions, on this module's cluster): the same tensors, byte for byte; with two
    workers each rank wrote its own shard files (the index names both); a missing checkpoint is
    a clean exit 1."""
    from miles.ckpt.convert import main

    model = randomize(DeepSeekV4ForCausalLM(CFG, seed=seed), seed)
    model.save_pretrained(tmp_path / "hf")
    main(["hf-to-dist", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dist"), "--tp", "2"])
    main(["dist-to-hf", "--ckpt", str(tmp_path / "dist"), "--out", str(tmp_path / "back")])
    main(["dist-to-hf", "--ckpt", str(tmp_path / "dist"), "--out", str(tmp_path / "back2"), "--ep", "2"])
    assert store.read_meta(tmp_path / "dist" / "iter_0000000")["model_only"]
    _same_bytes(load_safetensors_dir(tmp_path / "back"), load_safetensors_dir(tmp_path / "hf"), "HF -> dist -> HF")
    _same_bytes(load_safetensors_dir(tmp_path / "back2"), load_safetensors_dir(tmp_path / "hf"), "HF -> dist -> HF, 2")
    files = set(json.loads((tmp_path / "back2" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert {f.split("-")[1] for f in files} == {"rank00000", "rank00001"}, files
    p = subprocess.run([sys.executable, "-m", "miles.cli", "convert", "dist-to-hf", "--ckpt", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "no complete checkpoint" in p.stdout


def test_async_save_writes_the_state_of_its_step_while_training_goes_on_and_no_save_forks(ray_cluster, tmp_path,
                                                                                          seed):
    """ckpt.async_save: save_checkpoint returns before the files are written; the next step
    changes every weight meanwhile; the finished checkpoint still holds the state at the save
    (weights and the optimizer: a group loading it takes that next step bit for bit; the
    writer is held until that step is done, so a save that kept no copy fails). No save
    forks the worker, sync or async: a Ray actor must not (its other threads may hold locks
    the child then waits on forever); Megatron's writer forks a process per file and its
    async caller one per save."""
    src = SyntheticSource(32, CFG.vocab_size, seed)
    g = _group(seed, tp=2)
    for s in (1, 2):
        _step(g, src, s, 1)

    def count_forks(worker) -> None:  # in the worker (by value: workers cannot import this file)
        import os

        worker.forks = []
        os.register_at_fork(before=lambda: worker.forks.append(1))

    def hold_writes(worker) -> None:  # the async writer waits until step 3 has changed every weight
        import threading

        from miles.ckpt import sharded

        worker.release, write = threading.Event(), sharded._write_here
        sharded._write_here = lambda *a: (worker.release.wait(120), write(*a))[1]

    ray_cluster.get([w.__ray_call__.remote(count_forks) for w in g.workers])
    _save(g, tmp_path / "sync")
    at_save = _full(g)
    (tmp_path / "a").mkdir()
    ray_cluster.get([w.__ray_call__.remote(hold_writes) for w in g.workers])
    g.call("save_checkpoint", str(tmp_path / "a"), True)
    _step(g, src, 3, 1)
    assert not any(g.call("finish_save", False))  # still held: nothing written yet
    ray_cluster.get([w.__ray_call__.remote(lambda w: w.release.set()) for w in g.workers])
    while not all(g.call("finish_save", False)):
        pass
    after = _full(g)
    forks = ray_cluster.get([w.__ray_call__.remote(lambda w: len(w.forks)) for w in g.workers])
    g.shutdown()
    assert forks == [0, 0], f"forks per rank during a sync and an async save: {forks}"
    assert any(not torch.equal(after[k], at_save[k]) for k in after), "step 3 must change the weights"
    g2 = _group(seed + 1, tp=2)
    g2.call("load_checkpoint", str(tmp_path / "a"), same_layout=True)
    _same_bytes(_full(g2), at_save, "async save vs the state at its step")
    _step(g2, src, 3, 1)
    _same_bytes(_full(g2), after, "step 3 from the async checkpoint")
    g2.shutdown()


def _wait_on(group_name: str):
    """Run in a worker (Ray's __ray_call__): an all-reduce on one of its process groups."""
    def call(worker):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = {"world": dist.group.WORLD, "tp": ps.get_tensor_model_parallel_group()}[group_name]
        one = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(one, group=group)
        one.item()  # nccl returns at once; the wait is here
    return call


def test_a_failed_rank_raises_at_once_a_hang_is_named_and_shutdown_kills_stuck_ranks(ray_cluster, seed, capsys):
    """What a job sees of a rank that fails or hangs. (1) Rank 1 raises while rank 0 waits
    for it in a collective: the error reaches the caller at once, not when gloo releases rank
    0 after 5 minutes (a wait for every rank first would). (2) Both ranks stuck in collectives that never
    complete (rank 0 on the TP group, rank 1 on the world group): a call to them is named on
    stderr after `warn_after` seconds and keeps waiting. (3) A stopped job unwinds through
    TrainGroup.shutdown: it returns within its grace and the actors are gone (it queued
    behind the collective: the job outlived Ray's stop window and was SIGKILLed before the
    driver could unwind)."""
    import threading
    import time

    g = _group(seed, tp=2)

    def fail(worker):
        raise ValueError("rank 1 failed")

    stuck = g.workers[0].__ray_call__.remote(_wait_on("tp"))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 failed"):
        g.wait("step", {0: stuck, 1: g.workers[1].__ray_call__.remote(fail)})
    assert time.monotonic() - t0 < 30, "the error waited for the stuck rank"

    g.workers[1].__ray_call__.remote(_wait_on("world"))  # now both are stuck
    g.warn_after = 1.0
    late: list[BaseException] = []

    def call_them() -> None:
        try:
            g.call("layout")
        except BaseException as e:  # the actors are killed below
            late.append(e)

    waiter = threading.Thread(target=call_them, daemon=True)
    waiter.start()
    time.sleep(4)
    assert "TrainWorker.layout has not returned on rank(s) [0, 1] after" in capsys.readouterr().err
    assert waiter.is_alive() and not late  # still waiting: a warning, not a failure

    t0 = time.monotonic()
    closer = threading.Thread(target=g.shutdown, kwargs={"grace": 2.0}, daemon=True)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "shutdown waited on ranks stuck in a collective"
    assert time.monotonic() - t0 < 30
    for w in g.workers:  # killed, not merely left alone
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(w.layout.remote(), timeout=30)
    waiter.join(timeout=30)
    assert late and isinstance(late[0], ray_cluster.exceptions.RayActorError)
