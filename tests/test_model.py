"""Whole-model properties of the DeepSeek-V4 plugin on the tiny all-features config."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, assert_finite, random_ids, tiny_model, without_near_ties

from miles.train import losses
from miles.train.batching import MicroBatch
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM
from plugins.deepseek_v4.model import IGNORE_INDEX, Gate, balanced_hash_table

SEQ = 70  # > 4 HCA blocks (ratio 16), > 17 CSA blocks (ratio 4), > 4 windows (16)


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    return lab


def test_tiny_config_has_every_structural_feature():
    """Guards a tiny preset that silently drops a feature the tests then never exercise."""
    cfg = DeepSeekV4Config.tiny()
    kinds = set(cfg.compress_ratios[: cfg.num_hidden_layers])
    assert {0, 4} <= kinds and any(r > 4 for r in kinds)
    assert cfg.num_hash_layers >= 1 and cfg.num_nextn_predict_layers == 1 and cfg.hc_mult == 4
    assert cfg.index_topk < SEQ // 4, "top-k must actually drop entries in the tests"


def test_forward_backward_all_features_finite(seed):
    """No NaN anywhere: a full forward+backward with every feature on gives finite losses
    and a finite, non-zero gradient for every parameter. A routed expert's gradient is zero
    when it received no tokens, and non-zero when it received a token that a loss reaches:
    one before the last position (whose label is ignored); in the MTP block also not the
    first, which has no MTP prediction. Tokens only there may leave it zero (seed 1058792008:
    one token, MTP's last position; seed 513830750: one token, MTP's first)."""
    model = tiny_model(seed).train()
    ids = random_ids(seed, 3, SEQ)
    routed, reached = {}, {}

    def record(moe_name):
        head = 1 if moe_name.startswith("mtp.") else 0

        def hook(m, a, o):
            experts = o[0].view(len(ids), SEQ, -1)  # [B, S, top-k]
            routed.setdefault(moe_name, set()).update(experts.flatten().tolist())
            reached.setdefault(moe_name, set()).update(experts[:, head:SEQ - 1].flatten().tolist())
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, Gate):
            mod.register_forward_hook(record(name.removesuffix(".gate")))
    _, res = losses.compute(model, MicroBatch.lm(ids, labels_of(ids)))
    for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
        assert_finite(res.metrics[k], what=k)
        assert res.metrics[k] > 0, k
    res.loss.backward()
    grads = dict(model.deepseek_named((n, p.grad) for n, p in model.named_parameters() if p.grad is not None))
    for name, _ in model.deepseek_named(model.named_parameters()):
        g = grads.get(name)
        if ".experts." in name:
            moe, e = name.split(".experts.")[0], int(name.split(".experts.")[1].split(".")[0])
            if e not in routed[moe]:
                # stacked-weight experts get an exact zero (or no) gradient without tokens
                assert g is None or not g.any(), f"{name} got a gradient without tokens"
                continue
            if e not in reached[moe]:  # tail tokens only: no loss reaches them
                assert g is None or torch.isfinite(g).all(), name
                continue
        assert g is not None, f"{name} got no gradient (seed {seed})"
        assert_finite(g, what=name)
        assert g.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_empty_index_sets_give_finite_results(seed):
    """Pitfall 1: rows with no visible compressed block (p < ratio), a window of 1, a row
    that is all padding: outputs and gradients stay finite."""
    model = tiny_model(seed, sliding_window=1).train()
    ids = random_ids(seed, 3, 6)
    docs = torch.zeros(3, 6, dtype=torch.long)
    docs[2] = -1  # a row of padding only
    lab = torch.where(docs >= 0, labels_of(ids), IGNORE_INDEX)
    out, res = losses.compute(model, MicroBatch.lm(ids, lab, docs))
    res.loss.backward()
    assert_finite(out.logits, out.mtp_logits, res.loss)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_finite(p.grad, what=name)


@pytest.mark.parametrize("t", [1, 3, 4, 15, 16, 17, 31, 47, 64])
def test_causality(seed, t):
    """Changing token t never changes logits or MTP logits at positions < t (window,
    compressor blocks incl. the one containing t, indexer, MTP shift), and does change
    them at t (so the test can fail)."""
    model = tiny_model(seed).eval()
    ids = random_ids(seed, 2, SEQ)
    ids2 = ids.clone()
    ids2[:, t] = (ids[:, t] + 1 + seed % 300) % 320
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    # 1e-6: BLAS blocking may reorder sums by a few ulps; a real leak moves logits by >1e-3.
    assert_close(a.logits[:, :t], b.logits[:, :t], atol=1e-6, what=f"logits before {t}")
    assert_close(a.mtp_logits[:, :t], b.mtp_logits[:, :t], atol=1e-6, what=f"mtp logits before {t}")
    assert (a.logits[:, t] - b.logits[:, t]).abs().max() > 1e-4
    assert (a.mtp_logits[:, t] - b.mtp_logits[:, t]).abs().max() > 1e-4


@pytest.mark.parametrize("prompt", [1, 5, 16, 33])
def test_decode_matches_full_forward(seed, prompt):
    """Incremental decoding (window ring, compressor partial blocks and overlap state,
    compressed entries, indexer keys) gives the full forward's logits within 1e-5 (fp32),
    across several compression blocks and windows. Ids whose routers' and indexers' choices
    are not near ties (a tie decided by one ulp goes either way: ~1 seed in 5,000 failed)."""
    model = tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed)
    ids = without_near_ties(model, lambda: torch.randint(0, 320, (2, SEQ), generator=g))
    with torch.no_grad():
        full = model(ids).logits
    cache, slots = model.new_cache(2, SEQ + 1), torch.tensor([1, 0])  # slots in another order than rows
    last = model.prefill(list(ids[:, :prompt]), cache, slots.tolist())
    assert_close(last, full[:, prompt - 1], atol=1e-5, what="prefill")
    for t in range(prompt, SEQ):
        step = model.decode(ids[:, t], cache, slots)
        assert_close(step, full[:, t], atol=1e-5, what=f"decode position {t}")
    assert cache.length.tolist() == [SEQ, SEQ]


def chunk_plan(g: torch.Generator, total: int, first: int) -> list[int]:
    """Chunk sizes after a prefill of `first` tokens (< 20), summing to total - first (> 45):
    one token; up to the next HCA block boundary (16: a CSA one too); 3 tokens from there
    (shorter than a CSA block); 20 (longer than the window and an HCA block); then random."""
    sizes = [1, 16 - (first + 1) % 16, 3, 20]
    left = total - first - sum(sizes)
    while left:
        sizes.append(min(left, int(torch.randint(1, 40, (1,), generator=g))))
        left -= sizes[-1]
    return sizes


def test_chunked_prefill_matches_full_forward(seed):
    """A prompt prefilled in chunks (`extend` over the cache: window keys from the ring and the
    chunk, compressor blocks that straddle chunks with their CSA overlap, the indexer's top-k
    over the cached and new entries) gives the full forward's logits after every chunk, and
    decoding after it goes on as after a whole prefill, within 1e-5 (fp32). Rows of one call
    sit at different positions with chunks of different lengths. (The kernel path, on a GPU:
    tests/gpu/test_engine_gpu.py; in Triton's interpreter it took 80 s.)"""
    check_chunked_prefill(tiny_model(seed).eval(), seed, atol=1e-5)


def check_chunked_prefill(model: DeepSeekV4ForCausalLM, seed: int, atol: float) -> None:
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    ids = without_near_ties(model, lambda: torch.randint(0, model.config.vocab_size, (2, SEQ), generator=g).to(dev))
    with torch.no_grad():
        full = model(ids).logits
    firsts = [int(torch.randint(1, 20, (1,), generator=g)) for _ in range(2)]
    plans = [chunk_plan(g, SEQ - 4, f) for f in firsts]
    cache, slots = model.new_cache(3, SEQ + 1, dev), [2, 0]
    last = model.prefill([ids[b, :firsts[b]] for b in range(2)], cache, slots)
    done = list(firsts)
    while any(plans):
        rows = [b for b in range(2) if plans[b]]
        sizes = [plans[b].pop(0) for b in rows]
        last = model.extend([ids[b, done[b]:done[b] + n] for b, n in zip(rows, sizes, strict=True)], cache,
                            [slots[b] for b in rows])
        for i, (b, n) in enumerate(zip(rows, sizes, strict=True)):
            done[b] += n
            assert_close(last[i], full[b, done[b] - 1], atol=atol, what=f"row {b} after its chunk ending at {done[b]}")
    assert cache.length[slots].tolist() == [SEQ - 4] * 2
    for t in range(SEQ - 4, SEQ):
        step = model.decode(ids[:, t], cache, torch.tensor(slots, device=dev))
        assert_close(step, full[:, t], atol=atol, what=f"decode position {t} after chunks")


def test_chunked_prefill_records_the_choices_of_a_whole_prefill(seed):
    """The experts (routing replay) and the indexer's entries (indexer replay) that chunks
    record, token by token, are those a whole prefill records; a chunk past the cache's
    length is refused."""
    model = tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed)
    ids = without_near_ties(model, lambda: torch.randint(0, model.config.vocab_size, (SEQ,), generator=g))
    cache = model.new_cache(2, SEQ + 1)
    _, whole = model.prefill([ids], cache, [0], record=("routes", "picks"))
    got = {"routes": [], "picks": []}
    done = 0
    for n in chunk_plan(g, SEQ, 0):  # extend from an empty slot on
        _, out = model.extend([ids[done:done + n]], cache, [1], record=("routes", "picks"))
        for k in got:
            got[k].append(out[k][0, :n])
        done += n
    for k in got:
        assert whole[k].shape[:2] == (1, SEQ) and whole[k].numel() > 0, k
        assert torch.equal(torch.cat(got[k]), whole[k][0]), f"{k} differ"
    with pytest.raises(ValueError, match="end before"):
        model.extend([ids[:2]], cache, [1])


def test_chunked_prefill_in_a_cache_shorter_than_a_compression_block(seed):
    """max_len 14, under the HCA ratio (16): that compressor keeps no entry; chunks still give
    the full forward's logits (1e-5)."""
    model = tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed)
    ids = without_near_ties(model, lambda: torch.randint(0, 320, (1, 13), generator=g))
    with torch.no_grad():
        full = model(ids).logits[0]
    cache, done = model.new_cache(1, 14), 0
    for n in (2, 5, 1, 5):
        last = model.extend([ids[0, done:done + n]], cache, [0])
        done += n
        assert_close(last[0], full[done - 1], atol=1e-5, what=f"after the chunk ending at {done}")


def test_decode_on_the_kernel_path_matches_full_forward(seed):
    """The GPU's decode step (the sparse-attention kernel over the cache pool, here in Triton's
    interpreter) with static shapes: every compressed entry of the slot's capacity scored and
    masked, K keys a row, no read of how many blocks this batch completed. Rows at different
    positions (one completes a block while the other does not) match the reference model's
    full forward within 1e-5 (fp32)."""
    ref = tiny_model(seed).eval()
    model = tiny_model(seed, kernels="triton").eval()
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(seed)
    seqs = without_near_ties(ref, lambda: [torch.randint(0, 320, (n,), generator=g) for n in (30, 41)])
    lens = [3, 12]  # the rows complete their compression blocks at different steps
    with torch.no_grad():
        fulls = [ref(s[None]).logits[0] for s in seqs]
        cache = model.new_cache(2, 48)
        model.prefill([s[:n] for s, n in zip(seqs, lens, strict=True)], cache, [1, 0])
        for k in range(18):
            step = model.decode(torch.stack([s[n + k] for s, n in zip(seqs, lens, strict=True)]), cache,
                                torch.tensor([1, 0]))
            for b in range(2):
                assert_close(step[b], fulls[b][lens[b] + k], atol=1e-5, what=f"row {b} step {k}")


def test_decode_ragged_slots_reused(seed):
    """Sequences of different lengths decode together, each at its own position, in slots
    that earlier, longer sequences used (stale state must never leak), and a slot copied
    from a prefilled one continues like the original: every step equals each sequence's
    own full forward within 1e-5."""
    model = tiny_model(seed).eval()
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(4, SEQ + 1)
    with torch.no_grad():
        old = torch.randint(0, model.config.vocab_size, (3, SEQ), generator=g)
        model.prefill(list(old[:, :SEQ - 1]), cache, [0, 1, 2])  # fill the slots with other sequences
        model.decode(old[:, -1], cache, torch.tensor([0, 1, 2]))
        lens = [3, 21, 37]
        seqs = without_near_ties(model, lambda: [torch.randint(0, model.config.vocab_size, (n + 10,), generator=g)
                                                 for n in lens])
        last = model.prefill([s[:n] for s, n in zip(seqs, lens, strict=True)], cache, [2, 0, 1])
        cache.copy_slots([0], [3])  # a second sample of the 21-token prompt
        fulls = [model(s[None]).logits[0] for s in seqs]
        for i, n in enumerate(lens):
            assert_close(last[i], fulls[i][n - 1], atol=1e-5, what=f"prefill of prompt {i}")
        slots = torch.tensor([2, 0, 1, 3])
        rows = [0, 1, 2, 1]
        for k in range(10):
            step = model.decode(torch.stack([seqs[r][lens[r] + k] for r in rows]), cache, slots)
            for b, r in enumerate(rows):
                assert_close(step[b], fulls[r][lens[r] + k], atol=1e-5, what=f"row {b} step {k}")


def test_batched_equals_unbatched_with_padding_and_packing(seed):
    """Padded rows (left and right) and packed documents give the same per-token logits,
    MTP logits and token losses as each sequence alone: padding never attends or pools,
    documents never see each other."""
    model = tiny_model(seed).eval()
    lens = [SEQ, 41, 23]
    g = torch.Generator().manual_seed(seed)
    seqs = without_near_ties(model, lambda: [torch.randint(0, 320, (n,), generator=g) for n in lens])
    with torch.no_grad():
        alone = [model(s[None]) for s in seqs]
        # batch: row 1 left-padded, row 2 right-padded
        ids = torch.full((3, SEQ), 5)
        mask = torch.zeros(3, SEQ, dtype=torch.long)
        ids[0], mask[0] = seqs[0], 1
        ids[1, SEQ - 41:], mask[1, SEQ - 41:] = seqs[1], 1
        ids[2, :23], mask[2, :23] = seqs[2], 1
        out = model(ids, attention_mask=mask)
        got = [out.logits[0], out.logits[1, SEQ - 41:], out.logits[2, :23]]
        got_mtp = [out.mtp_logits[0], out.mtp_logits[1, SEQ - 41:], out.mtp_logits[2, :23]]
        for i in range(3):
            assert_close(got[i], alone[i].logits[0], atol=1e-5, what=f"row {i}")
            assert_close(got_mtp[i][1:], alone[i].mtp_logits[0, 1:], atol=1e-5, what=f"mtp row {i}")
        # packing: documents 1 and 2 in one row, then padding
        packed = torch.cat((seqs[1], seqs[2], torch.full((6,), 9)))[None]
        docs = torch.tensor([0] * 41 + [1] * 23 + [-1] * 6)[None]
        p = model(packed, doc_ids=docs)
        assert_close(p.logits[0, :41], alone[1].logits[0], atol=1e-5, what="packed doc 1")
        assert_close(p.logits[0, 41:64], alone[2].logits[0], atol=1e-5, what="packed doc 2")
        assert_close(p.mtp_logits[0, 42:64], alone[2].mtp_logits[0, 1:], atol=1e-5, what="packed mtp")


def test_indexer_trained_only_by_its_aux_loss(seed):
    """Top-k has no gradient: with the indexer loss off, indexer weights get no gradient and
    every other gradient is unchanged when it is switched on (detached inputs)."""
    ids = random_ids(seed, 2, SEQ)
    grads = {}
    for on in (False, True):
        model = tiny_model(seed).train()
        _, res = losses.compute(model, MicroBatch.lm(ids, labels_of(ids)), losses.LossCoefs(indexer=0.01 * on))
        res.loss.backward()
        grads[on] = {k: p.grad for k, p in model.named_parameters()}
        assert ("indexer_loss" in res.metrics) == on
    idx = [k for k in grads[True] if ".indexer." in k]
    assert idx
    for k in idx:
        g = grads[False][k]
        assert g is None or g.abs().max() == 0, k
        assert grads[True][k] is not None and grads[True][k].abs().max() > 0, k
    for k in grads[True]:
        if ".indexer." not in k:
            assert (grads[True][k] is None) == (grads[False][k] is None), k
            if grads[True][k] is not None:
                assert_close(grads[True][k], grads[False][k], atol=0, what=k)


def test_yarn_only_on_compressed_layers(seed):
    """Pitfall 7: sliding-window layers use plain RoPE (theta 10000, no YaRN); changing the
    compressed-layer frequencies changes compressed layers only."""
    model = tiny_model(seed).eval()
    ids = random_ids(seed, 1, 40)
    outs = {}

    def grab(i):
        return lambda m, a, o: outs.__setitem__(i, o)

    for i, layer in enumerate(model.layers):
        layer.attn.register_forward_hook(grab(i))
    with torch.no_grad():
        model(ids)
        before = dict(outs)
        model.inv_freq_compressed.mul_(1.3)
        model(ids)
    ratios = model.config.compress_ratios
    assert_close(outs[0], before[0], atol=0, what="first SWA layer")
    for i, r in enumerate(ratios[: model.config.num_hidden_layers]):
        if r and i > 0:
            assert (outs[i] - before[i]).abs().max() > 1e-6, f"layer {i} ignores its compressed RoPE"
    inv = model.inv_freq_swa
    rd = model.config.qk_rope_head_dim
    assert_close(inv, 1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd), atol=1e-7)


def test_bf16_dtype_preserved(seed):
    """Pitfall 3: a bf16 model keeps bf16 activations through attention and MoE (logits
    are fp32 by design) and stays close to the fp32 model."""
    ref = tiny_model(seed).eval()
    model = DeepSeekV4ForCausalLM(ref.config, dtype=torch.bfloat16, seed=None).eval()
    sd = ref.state_dict()
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in sd.items()})
    seen = []
    for layer in model.layers:
        layer.attn.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
        layer.ffn.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    ids = random_ids(seed, 2, 40)
    with torch.no_grad():
        out, ref_out = model(ids), ref(ids)
    assert seen and all(d == torch.bfloat16 for d in seen), seen
    assert out.logits.dtype == torch.float32
    assert model.layers[0].attn.attn_sink.dtype == torch.float32, "sink must stay fp32"
    assert_finite(out.logits, ref_out.logits)
    # Per position: bf16 rounding (2^-8) through the blocks gives a typical relative error of
    # 0.010-0.013 (86 random seeds); a discrete top-k flip (routing, indexer) moves one
    # position's logits by up to ~0.55 and is legitimate bf16 behaviour, so the whole-tensor
    # norm (one flip measured 0.068) is the wrong statistic. The median is the rounding's; a
    # planted dtype bug moves it: sink not loaded 0.055, weights through fp8 0.13.
    pos_err = ((out.logits - ref_out.logits).norm(dim=-1) / ref_out.logits.norm(dim=-1)).flatten()
    assert pos_err.median() < 0.03, f"bf16 typical relative error {pos_err.median():.3f}"
    # Flips stay rare (at most 9% of positions measured beyond 0.05) and bounded (the worst
    # measured 0.55; a position at 1 has logits unrelated to the fp32 model's).
    assert (pos_err > 0.05).float().mean() < 0.25 and pos_err.max() < 1.0, pos_err


def test_anomaly_mode_forward_backward(seed):
    """No in-place write into a tensor autograd saved (pitfall 2): forward+backward of the
    whole model under anomaly detection."""
    model = tiny_model(seed).train()
    ids = random_ids(seed, 2, 36)
    with torch.autograd.detect_anomaly():
        losses.compute(model, MicroBatch.lm(ids, labels_of(ids)))[1].loss.backward()


def test_hash_table_balanced_and_deterministic():
    """Hash routing table: k distinct experts per token, every expert serves floor or ceil
    of vocab*k/E tokens, identical on every call, different per layer."""
    for vocab, e, k in ((320, 8, 2), (129280, 256, 6), (1000, 7, 3)):
        t = balanced_hash_table(vocab, e, k, layer=1)
        assert t.shape == (vocab, k) and t.dtype == torch.long
        assert (t.sort(1).values.diff(dim=1) > 0).all(), "experts of a token must differ"
        counts = torch.bincount(t.flatten(), minlength=e)
        assert counts.max() - counts.min() <= 1
        assert torch.equal(t, balanced_hash_table(vocab, e, k, layer=1))
        assert not torch.equal(t, balanced_hash_table(vocab, e, k, layer=2))


def test_hash_layers_route_by_token_id(seed):
    """Hash layers pick experts from tid2eid, never from scores or bias."""
    model = tiny_model(seed)
    gate = model.layers[0].ffn.gate
    assert gate.is_hash and not hasattr(gate, "bias")
    x = torch.randn(10, 64)
    ids = torch.arange(10)
    idx1, w1, _ = gate(x, ids)
    with torch.no_grad():
        gate.weight.mul_(-3)
    idx2, w2, _ = gate(x, ids)
    assert torch.equal(idx1, gate.tid2eid[ids]) and torch.equal(idx1, idx2)
    assert_close(w1.sum(-1), torch.full((10,), model.config.routed_scaling_factor), atol=1e-5)


def test_router_bias_moves_toward_underloaded_experts(seed):
    """Aux-loss-free balancing: after training forwards, bias rises for experts below the
    mean load and falls for those above; counts reset after the update."""
    model = tiny_model(seed).train()
    ids = random_ids(seed, 2, 40)
    model(ids)
    gates = [m for m in model.modules() if isinstance(m, Gate) and not m.is_hash]
    loads = [g.expert_load.clone() for g in gates]
    before = [g.bias.clone() for g in gates]
    model.update_router_bias(0.01)
    for g, load, b in zip(gates, loads, before, strict=True):
        assert load.sum() > 0
        step = g.bias - b
        assert_close(step, 0.01 * torch.sign(load.mean() - load), atol=1e-7)
        assert g.expert_load.sum() == 0


def test_parameter_names_and_shapes_follow_deepseek():
    """Checkpoint compatibility: state_dict keys are DeepSeek's tensor names with its shapes
    (compressor only on compressed layers, indexer only on CSA, tid2eid only on hash
    layers, top-level hc_head_*, MTP block under mtp.0)."""
    cfg = DeepSeekV4Config.tiny()
    sd = DeepSeekV4ForCausalLM(cfg).state_dict()
    d, h, D, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    assert sd["embed.weight"].shape == (cfg.vocab_size, d) and sd["head.weight"].shape == (cfg.vocab_size, d)
    assert sd["hc_head_fn"].shape == (n, n * d) and "norm.weight" in sd
    for i in range(cfg.num_hidden_layers):
        r, p = cfg.compress_ratios[i], f"layers.{i}."
        assert sd[p + "attn.wo_a.weight"].shape == (cfg.o_groups * cfg.o_lora_rank, h * D // cfg.o_groups)
        assert sd[p + "attn.wq_b.weight"].shape == (h * D, cfg.q_lora_rank)
        assert sd[p + "attn.attn_sink"].dtype == torch.float32
        assert sd[p + "hc_attn_fn"].shape == (n * (n + 2), n * d)
        assert (p + "attn.compressor.ape" in sd) == (r > 0)
        assert (p + "attn.indexer.weights_proj.weight" in sd) == (r == 4)
        if r:
            coff = 2 if r == 4 else 1
            assert sd[p + "attn.compressor.ape"].shape == (r, coff * D)
        assert (p + "ffn.gate.tid2eid" in sd) == (i < cfg.num_hash_layers)
        assert (p + "ffn.gate.bias" in sd) == (i >= cfg.num_hash_layers)
        assert sd[p + f"ffn.experts.{cfg.n_routed_experts - 1}.w2.weight"].shape == (d, cfg.moe_intermediate_size)
        assert p + "ffn.shared_experts.w1.weight" in sd
    for k in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
              "ffn.gate.bias", "attn.wkv.weight"):
        assert "mtp.0." + k in sd, k
    assert not any(k.startswith("mtp.0.ffn.gate.tid2eid") for k in sd)


def test_routed_experts_are_stacked_parameters_under_deepseek_per_expert_names(seed):
    """Each MoE layer's routed experts are three stacked parameters, and everything outside the
    module sees DeepSeek's per-expert tensors: state_dict views of the right rows, the seeded
    init of each expert's own name (so any EP split starts from the same weights),
    load_state_dict writing the rows, and strict loads naming missing and foreign experts."""
    import zlib

    from plugins.deepseek_v4.parallel import ParallelContext

    cfg = DeepSeekV4Config.tiny()
    e, inter, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    model = DeepSeekV4ForCausalLM(cfg, seed=seed)
    params = dict(model.named_parameters())
    assert params["layers.1.ffn.experts.w1"].shape == (e, inter, d)
    assert params["layers.1.ffn.experts.w2"].shape == (e, d, inter)
    assert not any(".experts.0." in n for n in params), "no per-expert parameter is left"
    sd = model.state_dict()
    assert not any(k.endswith(".experts.w1") for k in sd)
    last = f"layers.1.ffn.experts.{e - 1}.w2.weight"
    assert torch.equal(sd[last], params["layers.1.ffn.experts.w2"][e - 1])
    # the init draws each expert from its own name's generator, as a per-expert tensor would
    name = "layers.2.ffn.experts.3.w3.weight"
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    assert torch.equal(sd[name], torch.randn(inter, d, generator=g) * cfg.initializer_range)
    # an EP rank holds the upper experts under their global names, with the same values
    half = DeepSeekV4ForCausalLM(cfg, seed=seed, ctx=ParallelContext(ep_size=2, ep_rank=1))
    hsd = half.state_dict()
    assert half.get_parameter("layers.1.ffn.experts.w1").shape == (e // 2, inter, d)
    assert f"layers.1.ffn.experts.{e // 2 - 1}.w1.weight" not in hsd
    for k in (f"layers.1.ffn.experts.{e // 2}.w1.weight", last):
        assert torch.equal(hsd[k], sd[k]), k
    # load_state_dict writes the rows; strict loads name what is missing or foreign
    other = DeepSeekV4ForCausalLM(cfg, seed=seed + 1)
    new = {k: v.clone() for k, v in sd.items()}
    new[last] = torch.randn(d, inter)
    other.load_state_dict(new)
    assert torch.equal(other.get_parameter("layers.1.ffn.experts.w2")[e - 1], new[last])
    assert torch.equal(other.get_parameter("layers.1.ffn.experts.w2")[0], sd["layers.1.ffn.experts.0.w2.weight"])
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.1\.ffn\.experts\.0\.w1\.weight"):
        other.load_state_dict({k: v for k, v in new.items() if k != "layers.1.ffn.experts.0.w1.weight"})
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*layers\.1\.ffn\.experts\.0\.w1\.weight"):
        half.load_state_dict(new)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.1\.ffn\.experts\.2\.w1\.weight"):
        other.load_state_dict({**new, "layers.1.ffn.experts.2.w1.weight": torch.zeros(inter + 1, d)})


def assert_same_step(m0: dict, g0: dict, m1: dict, g1: dict) -> None:
    """Two training steps' loss metrics and gradients are equal bit for bit (and finite)."""
    for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
        assert_finite(m0[k], m1[k], what=k)
        assert torch.equal(m0[k], m1[k]), k
    assert g0.keys() == g1.keys()
    for n in g0:
        assert_finite(g0[n], g1[n], what=n)
        assert torch.equal(g0[n], g1[n]), f"{n}: max diff {(g0[n] - g1[n]).abs().max():.3e}"


# Static against dynamic block counts (test_static_block_count_gives_the_same_step): the same
# sums over tensors of other shapes. Each compressed layer's attention softmax and weighted sum
# run over W + G keys a query, the entries' gradients are reduced over [B, G], and BLAS and
# PyTorch's reductions block them (and split them over threads) as the shape and the machine
# have it: the losses and gradients agree to fp32 rounding, not bit for bit (bit for bit on the
# 2-core AMD machine; on a 16-core Intel GPU host in none of 12 seeds: losses up to 1.6 eps apart,
# hc_head_fn's gradient 7.6e-10, its first parameter). Rounding measured, 12-20 seeds each: the
# 2-core AMD machine (1 or 2 threads) and the 16-core Intel one (1, 8 or 16 threads), static or
# dynamic, and the batch's two rows swapped (the same step summed in another order): losses moved
# by at most 1.9 eps relative, gradient elements by at most 7.8 eps * gmax, gmax the step's
# largest gradient element. Gradients are judged against gmax, not their own size: mHC's
# base/scale gradients are token sums that cancel to ~1e-4 of their terms, and their rounding
# reached 1.7e-4 of their own largest element. Planted: trailing entries visible to queries (two
# ways) moved the losses by >= 6.8e3 eps and some gradient by >= 7e5 eps * gmax.
EPS = torch.finfo(torch.float32).eps
STATIC_LOSS_RTOL = 32 * EPS  # 17x the rounding seen, 200x under the planted bugs
STATIC_GRAD_TOL = 64 * EPS  # times gmax: 8x the rounding seen, 1e4x under the planted bugs


def assert_same_step_to_rounding(m0: dict, g0: dict, m1: dict, g1: dict) -> None:
    """Two training steps' loss metrics and gradients are finite and agree to fp32 rounding
    (STATIC_LOSS_RTOL relative for the losses, STATIC_GRAD_TOL * gmax for gradient elements)."""
    for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
        assert_close(m1[k], m0[k], atol=0.0, rtol=STATIC_LOSS_RTOL, what=k)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert_finite(g0[n], g1[n], what=n)
    gmax = max(g.abs().max().item() for g in g0.values())
    assert gmax > 0
    for n in g0:
        assert_close(g1[n], g0[n], atol=STATIC_GRAD_TOL * gmax,
                     what=f"{n} (bound {STATIC_GRAD_TOL * gmax:.3e} = {STATIC_GRAD_TOL / EPS:.0f} eps * gmax)")


def test_recompute_gives_the_same_step_and_counts_loads_once(seed):
    """config.recompute keeps block inputs only and runs each block (MTP's too) again in the
    backward: losses, every gradient and the router's expert loads are those of the plain
    step, bit for bit; the blocks really run twice (else the test proves nothing)."""
    ids = random_ids(seed, 2, SEQ)
    runs = {}
    for recompute in (False, True):
        model = tiny_model(seed, recompute=recompute).train()
        calls = []
        for name, mod in model.named_modules():
            if isinstance(mod, Gate):
                mod.register_forward_hook(lambda m, a, o, name=name, calls=calls: calls.append(name))
        _, res = losses.compute(model, MicroBatch.lm(ids, labels_of(ids)))
        res.loss.backward()
        loads = {n: m.expert_load.clone() for n, m in model.named_modules() if isinstance(m, Gate) and not m.is_hash}
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runs[recompute] = (res.metrics, grads, loads, len(calls))
    (m0, g0, l0, c0), (m1, g1, l1, c1) = runs[False], runs[True]
    n_gates = c0
    assert c1 == 2 * n_gates, f"gates ran {c1} times with recompute, {n_gates} without"
    assert_same_step(m0, g0, m1, g1)
    for n in l0:
        assert l0[n].sum() > 0, n
        assert torch.equal(l0[n], l1[n]), f"{n}: loads {l0[n].tolist()} vs {l1[n].tolist()} with recompute"


def test_static_block_count_gives_the_same_step(seed, monkeypatch):
    """The GPU path's layout holds G = S // r compression blocks a row (static shapes: no wait
    for the GPU, CUDA graphs) instead of the most any row has: packed documents and padding
    leave trailing invalid entries, which no query may see. Bit for bit: what each query of
    each compressed layer sees, the dynamic count's entries then none of the trailing ones.
    The losses and every gradient are the dynamic count's to fp32 rounding (sums over tensors of
    other shapes: see STATIC_GRAD_TOL). Planted (each fails): the trailing slots left with their
    first token's document and end (a copy of the row's first block, visible); their validity
    dropped (slots starting at positions that start no block, visible); with the visibility
    checks taken out, the step comparison alone fails both (lm_loss 1e-4 to 3e-3 off)."""
    from plugins.deepseek_v4.layout import SequenceLayout

    ids = random_ids(seed, 2, SEQ)
    docs = torch.tensor([[0] * 30 + [1] * 33 + [-1] * 7, [0] * 9 + [1] * 61])
    mb = MicroBatch.lm(ids, torch.where(docs >= 0, labels_of(ids), IGNORE_INDEX), docs)
    build, visible = SequenceLayout.build.__func__, SequenceLayout.visible
    runs = []
    for static in (False, True):
        monkeypatch.setattr(SequenceLayout, "build", classmethod(
            lambda cls, *a, static=static, **k: build(cls, *a, **{**k, "static_blocks": static})))
        seen = []  # per compressed layer: (ratio, [B, S, G] entry g visible to query p)

        def record(layout, blocks, seen=seen):
            mask = visible(layout, blocks)
            seen.append((blocks.ratio, mask))
            return mask

        monkeypatch.setattr(SequenceLayout, "visible", record)
        model = tiny_model(seed).train()
        counts = []
        for mod in model.modules():
            if getattr(mod, "compressor", None) is not None and hasattr(mod, "ratio"):
                mod.register_forward_hook(lambda m, a, o, counts=counts: counts.append(a[1].layout.blocks(m.ratio)))
        _, res = losses.compute(model, MicroBatch.lm(mb.input_ids, mb.labels, mb.doc_ids))
        res.loss.backward()
        runs.append((res.metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, counts,
                     seen))
    (m0, g0, b0, v0), (m1, g1, b1, v1) = runs
    assert all(b.count == SEQ // b.ratio for b in b1) and any(x.count < y.count for x, y in zip(b0, b1, strict=True))
    assert len(v0) == len(v1) == len(b0)
    for (r, dyn), (_, sta) in zip(v0, v1, strict=True):
        g = dyn.shape[-1]
        assert torch.equal(sta[..., :g], dyn), \
            f"ratio {r}: {int((sta[..., :g] != dyn).sum())} (query, entry) pairs of the {g} dynamic slots differ"
        assert not sta[..., g:].any(), \
            f"ratio {r}: {int(sta[..., g:].sum())} (query, entry) pairs see one of the trailing invalid entries"
    assert_same_step_to_rounding(m0, g0, m1, g1)


def test_cuda_graphs_refuse_what_they_cannot_serve():
    """config.cuda_graphs: with recompute the config fails validation; off CUDA (or without
    the GPU kernels) the first training forward raises instead of silently running eagerly;
    a model split over ranks fails at construction."""
    from plugins.deepseek_v4.config import ConfigError
    from plugins.deepseek_v4.parallel import ParallelContext

    with pytest.raises(ConfigError, match="cuda_graphs"):
        DeepSeekV4Config.tiny(cuda_graphs=True, recompute=True)
    model = DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(cuda_graphs=True)).train()
    ids = random_ids(0, 1, SEQ)
    with pytest.raises(ValueError, match="need CUDA and the GPU kernels"):
        model(ids)
    with torch.no_grad():  # inference never graphs
        assert torch.isfinite(model(ids).logits).all()
    with pytest.raises(ValueError, match="tp=2"):
        DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(cuda_graphs=True), ctx=ParallelContext(tp_size=2), seed=None)


def test_a_traced_attention_layer_replays_its_output(seed):
    """log.trace's capture (forward.Trace) holds what replays the layer: its attention run on the
    captured input under the captured layout gives the captured output, for a CSA layer
    (indexer top-k) and an HCA layer, packed documents and padding; its q, K = V and chosen
    entries are the layer's own; tracing changes nothing of the forward."""
    from plugins.deepseek_v4.forward import Fwd, Trace
    from plugins.deepseek_v4.layout import SequenceLayout

    model = tiny_model(seed).eval()
    ids = random_ids(seed, 2, 48)
    doc = torch.tensor([[0] * 30 + [1] * 18, [0] * 41 + [-1] * 7])
    trace = Trace(frozenset({1, 2}))
    with torch.no_grad():
        plain = model(ids, doc_ids=doc).logits
        traced = model(ids, doc_ids=doc, trace=trace).logits
    assert torch.equal(plain, traced), "tracing changed the forward"
    assert sorted(trace.captured) == [1, 2] and all(len(v) == 1 for v in trace.captured.values())
    for layer, (cap,) in trace.captured.items():
        attn = model.layers[layer].attn
        layout = SequenceLayout(doc=cap["doc"], pos=cap["pos"])
        with torch.no_grad():
            out = attn(cap["input"], Fwd(layout, model._ropes(layout.pos)))
        assert torch.isfinite(cap["output"]).all() and cap["chosen"].any()
        assert torch.equal(out, cap["output"]), f"layer {layer}: the capture does not replay the output"
        assert all(cap[k].shape[:2] == ids.shape for k in ("q", "kv", "lse"))
        assert torch.equal(cap["rows"], torch.arange(48))  # one rank: every position's query
    csa, hca = trace.captured[1][0]["chosen"], trace.captured[2][0]["chosen"]
    assert csa.sum(-1).max() == model.config.index_topk, "the CSA capture is not the indexer's top-k"
    assert hca.any() and hca.sum(-1).max() <= 48 // 16  # HCA: every visible entry (blocks of 16)
