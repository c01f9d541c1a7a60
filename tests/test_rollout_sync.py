"""Engine against trainer on a real Ray cluster: the engine's log-probs of the tokens it
samples equal the Megatron trainer's `forward_logprobs` (TP=1 and TP=2), before and after
weight updates through each sync path, and a failed update leaves the old weights serving."""

from __future__ import annotations

import shutil

import pytest
import ray
import torch
from conftest import assert_close

pytest.importorskip("megatron.core")

from miles.cluster.train_group import TrainGroup  # noqa: E402
from miles.data.synthetic import SyntheticSource  # noqa: E402
from miles.rollout.manager import RolloutManager  # noqa: E402
from miles.rollout.sync import sync_broadcast, sync_disk, sync_object_store, sync_shared, write_version  # noqa: E402
from miles.rollout.weights import WeightSyncError, read_dir, update_targets  # noqa: E402
from miles.train.batching import MicroBatch, replica_micro_batches  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config  # noqa: E402
from plugins.deepseek_v4.model import IGNORE_INDEX, DeepSeekV4ForCausalLM  # noqa: E402

CFG = DeepSeekV4Config.tiny()
BUCKET = 1 << 16  # several buckets, so a failure can come midway


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def _requests(seed: int, round_: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(4):
        n = int(torch.randint(3, 30, (), generator=g))
        out.append({"id": f"r{round_}-{i}", "input_ids": torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist(),
                    "return_logprob": True,
                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": seed + i,
                                        "ignore_eos": True}})
    return out


def _trainer_logprobs(group: TrainGroup, reqs: list[dict], results: list[dict]) -> list[torch.Tensor]:
    """The trainer's log p of each generated token (one micro-batch per sample)."""
    mbs = []
    for q, r in zip(reqs, results, strict=True):
        ids = torch.tensor(q["input_ids"] + r["output_ids"])[None]
        labels = torch.cat((ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)), 1)
        mbs.append(MicroBatch.lm(ids, labels))
    out = group.forward_logprobs([mbs])[0]
    return [lp[0, len(q["input_ids"]) - 1: -1] for lp, q in zip(out, reqs, strict=True)]


def _engine_logprobs(results: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]]) for r in results]


@torch.no_grad()
def _local_logprobs(group: TrainGroup, reqs: list[dict], results: list[dict],
                    directory) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same log-probs from the weights the trainer exports (DeepSeek's HF layout) in a
    single-process model here, whole sequences: with fp32 parameters, then float64 ones (the
    reference; the ops that compute in fp32 whatever their input, e.g. the attention core and
    the head, still round there, so it is a differently rounded evaluation, not exact)."""
    path, _ = write_version(group, directory, CFG, 0)
    model = DeepSeekV4ForCausalLM(CFG).eval()
    targets = update_targets(model)
    weights = read_dir(str(path))
    assert set(weights) == set(targets)
    for k, v in weights.items():
        targets[k].copy_(v)
    out = []
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)  # in place: the fp32 pass runs before the conversion
        assert next(model.parameters()).dtype == dtype
        out.append([])
        for q, r in zip(reqs, results, strict=True):
            ids = torch.tensor(q["input_ids"] + r["output_ids"])[None]
            p = len(q["input_ids"])
            lp = model(ids).head.logits()[0, p - 1:-1].double().log_softmax(-1)  # [T, V]
            out[-1].append(lp.gather(1, ids[0, p:, None])[:, 0])
    return out[0], out[1]


def _agree(group, reqs, results, what: str, spread_dir=None) -> float:
    """Each sampled token's log-prob from the engine equals the trainer's to 1e-5.

    With `spread_dir` (after training) all are held to a third evaluation, the weights the
    trainer exports as float64 parameters in a single-process model here (_local_logprobs): the
    trainer and the same model with fp32 parameters to 5e-5, and the engine to 1e-5 plus twice
    the larger of those two evaluations' distances from it at that token (how far rounding
    moves that token). Why: after training at lr 1e-2 a few tokens are ill-conditioned, e.g. one
    whose sliding-window attention output nearly cancels (seed 1853276993, step 5: the last
    layer's attention multiplies its input's rounding ~75x). There every evaluation lands ~1e-5
    from the others (engine, trainer and local fp32 model 2.6e-6 / 1.2e-5 / 1.6e-5 from a
    float64 one on one token, 1.4e-5 / 8.9e-6 / 6.1e-6 on another, their neighbours <= 5e-7),
    so a flat 1e-5 between two of them fails on some seeds. A stale or half-applied sync moves
    log-probs by 0.1-2, four orders above either bound; a skipped hc_head_scale, 2e-5, fails
    on the well-conditioned tokens."""
    worst = 0.0
    engine, trainer = _engine_logprobs(results), _trainer_logprobs(group, reqs, results)
    if spread_dir is not None:
        local32, local64 = _local_logprobs(group, reqs, results, spread_dir)
    for i, (a, b) in enumerate(zip(engine, trainer, strict=True)):
        if spread_dir is None:
            assert_close(a, b.float(), atol=1e-5, what=f"{what}: sample {i}")
        else:
            ref = local64[i]
            assert_close(b, ref, atol=5e-5, what=f"{what}: sample {i}, trainer against its export in float64")
            assert_close(local32[i], ref, atol=5e-5, what=f"{what}: sample {i}, its export in fp32 against float64")
            # [T]: how far rounding moves each token here (its conditioning)
            noise = torch.maximum((b.double() - ref).abs(), (local32[i] - ref).abs())
            assert_close(a, ref, atol=1e-5 + 2 * noise,
                         what=f"{what}: sample {i}, engine against the trainer's export in float64")
        worst = max(worst, (a - b).abs().max().item())
    return worst


def test_engine_logprobs_follow_the_trainer_through_every_sync_path(cluster, seed, tmp_path, tmp_path_factory):
    rollout = {"num_engines": 1, "max_running": 8, "max_len": 128, "health_interval": 5.0}
    mgr = RolloutManager(rollout, {"config": CFG.to_dict(), "seed": seed})
    tp2 = TrainGroup(2, tp=2)
    try:
        tp2.call("build_model", CFG.to_dict(), seed)
        tp2.call("setup_training", lr=1e-2, total_steps=10)
        tp1 = TrainGroup(1)
        tp1.call("build_model", CFG.to_dict(), seed)
        reqs = _requests(seed, 0)
        res = mgr.generate(reqs)
        print("TP=1 max |engine - trainer|", _agree(tp1, reqs, res, "TP=1 trainer, initial weights"))
        print("TP=2 max |engine - trainer|", _agree(tp2, reqs, res, "TP=2 trainer, initial weights"))
        tp1.shutdown()

        src = SyntheticSource(32, CFG.vocab_size, seed)
        engine = mgr.engine_actors()[0]
        spread = tmp_path_factory.mktemp("spread")  # the trainer's weights for _local_logprobs
        # broadcast: a group for the one call; then twice through the manager, whose group is
        # opened at the first and kept for the second (other paths' updates in between)
        for step, path in ((1, "object_store"), (2, "broadcast"), (3, "disk"), (4, "shared"),
                           (5, "kept broadcast"), (6, "kept broadcast")):
            tp2.train_step(replica_micro_batches(src.batch(step, 4), 1, 2))
            stale = mgr.generate(_requests(seed, step))  # old weights, new trainer
            with pytest.raises(AssertionError, match="engine against the trainer's export in float64"):
                _agree(tp2, _requests(seed, step), stale, "stale engine", spread_dir=spread)
            if path == "object_store":
                info = sync_object_store(tp2, mgr, BUCKET, version=step)
            elif path == "broadcast":
                info = sync_broadcast(tp2, [engine], BUCKET, version=step, backend="gloo")
            elif path == "kept broadcast":
                info = mgr.update_by_broadcast(tp2, BUCKET, version=step, backend="gloo")
            elif path == "shared":  # colocated: the engine opens the ranks' buffers in place
                info = sync_shared(tp2, mgr, BUCKET, version=step)
            else:
                from miles.rollout.sync import MARKER

                (tmp_path / "v0000001").mkdir()  # an older version it wrote: removed once the engines serve this one
                (tmp_path / "v0000001" / MARKER).write_text(str(tmp_path.absolute()))
                info = sync_disk(tp2, mgr, tmp_path, CFG, version=step)
                assert sorted(d.name for d in tmp_path.iterdir()) == ["v0000003"]
                assert mgr.latest == {"path": str(tmp_path / "v0000003"), "version": 3}  # for a replacement
            print(path, info)
            reqs = _requests(seed, 10 + step)
            res = mgr.generate(reqs)
            assert {r["meta_info"]["weight_version"] for r in res} == {step}
            _agree(tp2, reqs, res, f"after the {path} sync of step {step}", spread_dir=spread)

        # A sync that fails midway: a bucket in the middle arrives corrupted.
        before = mgr.generate(_requests(seed, 20))
        tp2.train_step(replica_micro_batches(src.batch(7, 4), 1, 2))
        buckets = [b for rank in tp2.call("put_weight_buckets", BUCKET) for b in rank]
        assert len(buckets) >= 3
        ref, sums = buckets[len(buckets) // 2]
        buckets[len(buckets) // 2] = (ref, {**sums, next(iter(sums)): "0" * 32})
        with pytest.raises(WeightSyncError, match="checksum mismatch"):
            mgr.update_weights(buckets, [n for _, s in buckets for n in s], 7)
        after = mgr.generate(_requests(seed, 20))
        for a, b in zip(before, after, strict=True):
            assert a["output_ids"] == b["output_ids"] and a["meta_info"]["weight_version"] == 6
            assert_close(_engine_logprobs([a])[0], _engine_logprobs([b])[0], atol=1e-5, what="old weights kept")
        # A directory the engine cannot load (a shard missing): refused naming the engine and
        # the directory; the old weights keep serving, and stay what a replacement would get.
        bad = tmp_path / "bad"
        shutil.copytree(tmp_path / "v0000003", bad)
        sorted(bad.glob("*.safetensors"))[-1].unlink()
        refused = rf"1 of 1 engines refused the weights at {bad} and keep their previous ones: .* is missing"
        with pytest.raises(WeightSyncError, match=refused):
            mgr.update_from_disk(str(bad), 7)
        assert mgr.latest["path"] == str(tmp_path / "v0000003")
        assert [r["output_ids"] for r in mgr.generate(_requests(seed, 20))] == [r["output_ids"] for r in before]
        # An update that never completes (names announced but missing) is refused as well.
        ray.get(engine.begin_update.remote())
        ray.get(engine.stage.remote(*buckets[0]))
        with pytest.raises(ray.exceptions.RayTaskError, match="update incomplete"):
            ray.get(engine.commit.remote([n for _, s in buckets for n in s], 7))
        assert mgr.generate(_requests(seed, 20))[0]["output_ids"] == before[0]["output_ids"]
    finally:
        tp2.shutdown()
        mgr.shutdown()


def test_an_engine_replaced_after_a_broadcast_copies_a_live_engines_weights(cluster, seed):
    """A broadcast is not kept to replay: an engine that dies after one is replaced by an engine
    that copies the weights a live one serves (object-store buckets, MD5s checked). It serves the
    broadcast's version (its log-probs equal the trainer's) and the manager still knows which
    version the engines serve (before: the replacement served its start weights until the next
    sync, and the manager forgot the version). A live engine serving another version than the
    manager's (a partial sync) is not copied from: the replacement waits for the next sync."""
    import time

    import httpx

    rollout = {"num_engines": 2, "max_running": 8, "max_len": 128, "health_interval": 0.5, "health_timeout": 2.0,
               "health_failures": 2, "bucket_mb": 1}
    mgr = RolloutManager(rollout, {"config": CFG.to_dict(), "seed": seed})
    tp1 = TrainGroup(1)
    try:
        tp1.call("build_model", CFG.to_dict(), seed)
        tp1.call("setup_training", lr=1e-2, total_steps=10)
        tp1.train_step(replica_micro_batches(SyntheticSource(32, CFG.vocab_size, seed).batch(1, 4), 1, 1))
        mgr.update_by_broadcast(tp1, BUCKET, version=1, backend="gloo")

        def replace_first(restarts: int):  # kill engines[0]; the monitor's replacement
            dead = mgr.engines[0]
            ray.kill(dead.actor, no_restart=True)
            deadline = time.monotonic() + 120
            while mgr.stats["restarts"] < restarts and time.monotonic() < deadline:
                time.sleep(0.2)
            assert mgr.stats["restarts"] == restarts, f"dead engine {restarts} was not replaced"
            assert mgr.engines[0].pid != dead.pid
            return mgr.engines[0]

        def served(slot, reqs):
            return [httpx.post(f"{slot.url}/generate", json={k: v for k, v in r.items() if k != "id"},
                               headers=mgr.router.headers, timeout=60).json() for r in reqs]

        new = replace_first(1)
        assert mgr.version == 1
        reqs = _requests(seed, 30)
        res = served(new, reqs)
        assert {r["meta_info"]["weight_version"] for r in res} == {1}
        _agree(tp1, reqs, res, "the replacement engine")

        # A sync that reached only some engines: the survivor serves version 2 (staged into it
        # directly), the manager still records 1. The next replacement must not copy version 2
        # as if it were 1: it keeps its start weights and the manager forces the next sync.
        other = mgr.engines[1]
        own = ray.get(other.actor.put_weight_buckets.remote(1 << 20))
        ray.get(other.actor.begin_update.remote())
        for ref, sums in own["buckets"]:
            ray.get(other.actor.stage.remote(ref, sums))
        ray.get(other.actor.commit.remote([n for _, s in own["buckets"] for n in s], 2))
        newer = replace_first(2)
        assert mgr.version is None
        res = served(newer, reqs[:2])
        assert {r["meta_info"]["weight_version"] for r in res}.isdisjoint({1, 2}), res[0]["meta_info"]

        # The manager's broadcast group was opened with the first engines: a replaced member
        # makes the next broadcast open a new one, and both engines take it.
        tp1.train_step(replica_micro_batches(SyntheticSource(32, CFG.vocab_size, seed).batch(2, 4), 1, 1))
        mgr.update_by_broadcast(tp1, BUCKET, version=3, backend="gloo")
        for slot in mgr.engines:
            res = served(slot, reqs[:2])
            assert {r["meta_info"]["weight_version"] for r in res} == {3}
            _agree(tp1, reqs[:2], res, f"engine {slot.pid} after the broadcast to a new member set")
    finally:
        tp1.shutdown()
        mgr.shutdown()


def test_the_kl_term_is_the_kl_to_the_kept_reference(cluster, seed):
    """Guards a KL term that is computed but wrong (a reference that is the current policy, a
    forward at another temperature, an estimator with the sign turned): a trainer moved two
    steps off the weights it kept as reference reports kl_loss equal to k3 written out here
    from two single-process models (the reference's seeded weights, the trainer's exported
    ones) at the rollouts' temperature, weighed by the RL token weights."""
    from dataclasses import replace

    from miles.algo.losses import response_weights
    from plugins.deepseek_v4 import DeepSeekV4ForCausalLM

    group = TrainGroup(1)
    try:
        group.call("build_model", CFG.to_dict(), seed)
        group.call("setup_training", lr=1e-2, total_steps=10)
        group.call("keep_reference")  # the seeded weights
        src = SyntheticSource(32, CFG.vocab_size, seed)
        for step in (1, 2):
            group.train_step(replica_micro_batches(src.batch(step, 4), 1, 2))
        weights = {k: v for b in group.call("export_weights")[0] for k, v in b.items()}
        temperature = 0.8
        group.call("set_loss", "policy", {"kl_coef": 0.5, "kl_estimator": "k3", "temperature": temperature},
                   mtp=0.0, indexer=0.0)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, CFG.vocab_size, (3, 20), generator=g)
        labels = torch.cat((ids[:, 1:], torch.full((3, 1), IGNORE_INDEX)), 1)
        mask = (labels != IGNORE_INDEX).float()
        mask[:, :6] = 0  # the prompts
        mask[1, 14:] = 0  # a shorter response
        w = torch.tensor(response_weights([int(n) for n in mask.sum(1)], "token_mean", 20))[:, None] * mask
        mbs = [MicroBatch(ids[i:i + 1], labels[i:i + 1], mask[i:i + 1], advantages=torch.randn(1, 20, generator=g),
                          token_weights=w[i:i + 1].float()) for i in range(3)]
        ref = group.forward_logprobs([mbs], reference=True)[0]
        mbs = [replace(mb, ref_logprobs=r) for mb, r in zip(mbs, ref, strict=True)]
        kl = group.train_step([mbs])[0]["kl_loss"]
    finally:
        group.shutdown()

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            z = model(ids).logits.double() / temperature
        return torch.log_softmax(z, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]

    policy = DeepSeekV4ForCausalLM(CFG, seed=None)
    policy.load_state_dict(weights)
    lp, lp_ref = logprobs(policy.eval()), logprobs(DeepSeekV4ForCausalLM(CFG, seed=seed).eval())
    d = lp - lp_ref
    want = ((torch.exp(-d) - 1 + d) * w.double()).sum().item()
    assert kl == kl and want > 1e-4, (kl, want)  # finite, and the policy has moved off the reference
    assert abs(kl - want) <= 1e-5 * want, (kl, want)


def test_only_version_directories_this_run_wrote_are_ever_removed(tmp_path):
    """rollout.sync_dir may be a user's folder: its own v<digits> folders, and another run's,
    survive this run's clean-up, and a version path that exists unmarked is refused, not
    replaced; this run's older versions go."""
    from miles.rollout.sync import MARKER, remove_older_versions, write_version

    class Trainer:  # writes what save_hf would, into the directory given
        def save_hf(self, path, config):
            (path / "model.safetensors").write_bytes(b"w")
            return 1

    mine, other = str(tmp_path / "run"), str(tmp_path / "other-run")
    users = tmp_path / "v0000001"
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    theirs = tmp_path / "v0000002"
    theirs.mkdir()
    (theirs / MARKER).write_text(other)
    for v in (3, 4, 5):
        write_version(Trainer(), tmp_path, None, v, owner=mine)
    write_version(Trainer(), tmp_path, None, 4, owner=mine)  # a restart rewrites its own version whole
    assert remove_older_versions(tmp_path, 5, owner=mine) == ["v0000003", "v0000004"]
    assert (users / "notes.txt").read_text() == "keep me" and (theirs / MARKER).is_file()
    assert (tmp_path / "v0000005" / "model.safetensors").is_file()
    with pytest.raises(FileExistsError, match="v0000001 exists and this run did not write it"):
        write_version(Trainer(), tmp_path, None, 1, owner=mine)
    assert (users / "notes.txt").read_text() == "keep me"


def test_device_fingerprints_tell_apart_what_the_md5_tells_apart(seed, monkeypatch):
    """The GPU sync paths (CUDA IPC, NCCL broadcast) compare fingerprints computed on the
    device instead of MD5s: equal bytes agree, in chunks or not; a torn copy, two words
    swapped, a view one element off, another dtype of the same values and one byte more each
    differ; a staged bucket whose fingerprint differs is refused and stages nothing."""
    from miles.rollout.weights import Staging, bucket_digests, pack, spans_of, spec_of
    from plugins.deepseek_v4 import checksum

    g = torch.Generator().manual_seed(seed)
    t = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
    base = checksum.fingerprint(t)
    monkeypatch.setattr(checksum, "FINGERPRINT_CHUNK", 7)  # many chunks, the last one short
    assert checksum.fingerprint(t) == base == checksum.fingerprint(t.clone())
    torn = t.clone().reshape(-1)
    torn[len(torn) // 2:] = 0
    swapped = t.clone().reshape(-1)
    j = 11 + int((swapped[11:] == swapped[10]).cumprod(0).sum())  # the first later value that differs
    swapped[[10, j]] = swapped[[j, 10]]  # (two bf16 draws are equal ~1 in 1,100)
    assert not torch.equal(swapped, t.reshape(-1))
    buf = torch.cat((torch.zeros(1, dtype=t.dtype), t.reshape(-1)))
    others = {"torn": torn, "swapped": swapped, "off by one": buf[:-1], "float32": t.float(),
              "one byte more": torch.cat((t.reshape(-1).view(torch.uint8), torch.zeros(1, dtype=torch.uint8)))}
    for what, x in others.items():
        assert checksum.fingerprint(x) != base, what

    model = torch.nn.Linear(1000, 3, bias=False)
    staging = Staging(model)
    w = torch.randn(3, 1000, generator=g)
    flat = pack({"weight": w})
    spec = spec_of({"weight": w})
    with pytest.raises(WeightSyncError, match="fingerprint mismatch"):
        staging.add_bucket(flat, spec, {"weight": checksum.fingerprint(w) + 1})
    assert staging.staged == {}
    staging.add_bucket(flat, spec, checksum.packed_fingerprints(flat, spans_of(spec)))
    assert torch.equal(staging.staged["weight"], w)
    flat.zero_()  # staged from a copy: the sender's buffer is free once the call returns
    assert torch.equal(staging.staged["weight"], w)
    assert bucket_digests(flat, spec) == {"weight": checksum.tensor_md5(torch.zeros_like(w))}  # host: MD5s


@pytest.mark.parametrize("chunk", [5, 64, 1 << 24, "kernel 8", "kernel 4096"])
def test_a_buckets_fingerprints_in_one_pass_equal_each_tensors_own(seed, chunk, monkeypatch):
    """packed_fingerprints (a bucket's buffer at once, what the GPU paths compute) gives each
    tensor the integer fingerprints() gives it alone, positions counted from its own start;
    odd-sized, empty and chunk-straddling tensors too; checked against the definition in
    Python integers. By torch's scans in chunks (CPU), and by the GPU's block-sum kernel
    (Triton's interpreter here) with blocks that tensors straddle and with its own block."""
    from miles.rollout.weights import pack, spans_of, spec_of
    from plugins.deepseek_v4 import checksum

    kernel = isinstance(chunk, str)
    if kernel:
        pytest.importorskip("triton")
        from plugins.deepseek_v4.kernels import fingerprint

        monkeypatch.setattr(fingerprint, "BLOCK", int(chunk.split()[1]))
    else:
        monkeypatch.setattr(checksum, "FINGERPRINT_CHUNK", chunk)
    g = torch.Generator().manual_seed(seed)
    bucket = {"a": torch.randn(7, 13, generator=g).to(torch.bfloat16),
              "odd": torch.randint(0, 256, (37,), generator=g, dtype=torch.int64).to(torch.uint8),
              "empty": torch.zeros(0, 5),
              "b": torch.randn(301, generator=g),
              "c": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    flat, spec = pack(bucket), spec_of(bucket)
    got = checksum.packed_fingerprints(flat, spans_of(spec), kernel=kernel)

    def definition(t: torch.Tensor) -> int:
        b = bytes(t.reshape(-1).view(torch.uint8).tolist())
        n = len(b)
        b += b"\0" * (n % 2)
        w = [int.from_bytes(b[i:i + 2], "little", signed=True) for i in range(0, len(b), 2)]
        s, ws = sum(w) % 2**64, sum((j + 1) * x for j, x in enumerate(w)) % 2**64
        return s * 2**128 + ws * 2**64 + n

    assert got == checksum.fingerprints(bucket) == {k: definition(v) for k, v in bucket.items()}
    assert len(set(got.values())) == len(got)
