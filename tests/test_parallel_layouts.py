"""Every parallel layout computes what one process computes.

The tiny DeepSeek-V4 model (all features: SWA/CSA/HCA attention, indexer + KL loss, hash
and learned MoE, mHC, MTP) runs in TrainWorker Ray actors of a real local Ray cluster under
Megatron-core on CPU/gloo: each parallel axis alone on 2 ranks (TP=2, PP=2, EP=2, CP=2,
DP=2) and the combinations real DeepSeek-V4 recipes use on 4 ranks (TP2xPP2, TP2xEP2,
CP2xTP2, PP2xDP2, EP2xDP2). Against the single-process model on the same global batch:
- per-token logprobs of every rank's tokens, every loss (lm, MTP, indexer, policy), and
  every gradient as training reduces it: read from Megatron DDP's gradient buffers after its
  own reduction, the part each rank's DistributedOptimizer shard owns (TP shards against the
  matching slice; experts on their EP rank; layers on their pipeline stage);
- two optimizer steps as training runs them (AdamW, eps 1e-8, weight decay, clipping,
  different micro-batch splits): the same losses and grad norms, Adam's first and second
  moments of every shard, the parameters and router biases;
- exported weights are exactly the single-process state.

Every learned router picks the same experts as one process for every token.

On a machine with enough GPUs the same suite runs with nccl in bf16 (Triton attention kernels);
`--bf16` runs that mode on CPU (gloo; make test-all). There a layout's error against the fp32
single-process reference may be at most 4x the largest error of one process in bf16 (or 5% of
the reference): of the bf16 model and of copies re-rounded by about one bf16 ulp (_single_bf16
says why) for step 0's losses, logprobs, gradients and the policy loss, of a one-rank bf16
trainer for the training steps' losses and grad norms. A router may pick otherwise on a few
near ties; those experts' gradients are not compared, nor the block's FFN mixing parameters'
(hc_ffn_*; _check_routes says why). Planted in bf16 (tp2), each fails: K = V gradient not
summed over TP (575 misses), router weights' gradient not summed over TP (15; again 15 with
the hc_ffn_* skip).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, random_ids, without_near_ties

pytest.importorskip("megatron.core")

from miles.train import losses  # noqa: E402
from miles.train.batching import MicroBatch  # noqa: E402
from miles.train.inspect import routes  # noqa: E402
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM  # noqa: E402
from plugins.deepseek_v4.model import IGNORE_INDEX  # noqa: E402
from plugins.deepseek_v4.parallel import ParallelContext  # noqa: E402

# Collectives sum partial products in another order than one process: logits, logprobs and
# gradients of this fp32 model differ by ~1e-7 relative; 1e-5 absolute is the target
# and leaves 100x margin, while every mutation tried (see the test docstrings) moves them by
# >= 1e-3.
ATOL = 1e-5
# The optimizer as training runs it (job defaults: AdamW, eps 1e-8, clipping at 1). With eps
# this small an element's update is about lr * sign(gradient): see _check_optimizer for how
# near-zero gradients are judged.
LR, EPS, WD, CLIP, STEPS = 1e-2, 1e-8, 0.1, 1.0, 2
BATCH, SEQ = 4, 32  # SEQ spans 2 CSA/HCA windows (16) and splits into 2 CP chunks of 16

# (ranks, parallel sizes); the rest of the world is data parallel.
LAYOUTS = {"tp2": (2, {"tp": 2}), "pp2": (2, {"pp": 2}), "ep2": (2, {"ep": 2}), "cp2": (2, {"cp": 2}),
           "dp2": (2, {}),
           "tp2pp2": (4, {"tp": 2, "pp": 2}), "tp2ep2": (4, {"tp": 2, "ep": 2}), "cp2tp2": (4, {"cp": 2, "tp": 2}),
           "pp2dp2": (4, {"pp": 2}), "ep2dp2": (4, {"ep": 2})}

# Every run checks all ten, the five combined ones included (on the 2-core machine each takes
# 11-17 s, about 70 s together; a date-based subset made CI's verdict depend on the day).
COMBINED = [k for k, (world, _) in LAYOUTS.items() if world == 4]
# The combined layouts train with config.recompute: each block's forward, its collectives
# included, runs again in the backward, and everything below must still hold.
RECOMPUTE = set(COMBINED)
GPUS = torch.cuda.device_count()
GPU = GPUS >= 2  # bf16 on the GPUs (nccl), else fp32 on CPU (gloo) unless --bf16
WORST: dict[str, tuple] = {}  # bf16, this layout: per quantity, the largest error / one process's, and where
MISSES: list[str] = []  # bf16, this layout: every comparison over its bound (all reported at its end)


def _resources(world: int) -> dict | None:
    """One GPU per rank where there are GPUs; four ranks share the fixture's 2 CPUs."""
    cpus = {"CPU": min(1.0, 2 / world)}
    return {**cpus, "GPU": 1} if GPU else cpus


def _batch(seed: int, step: int = 0) -> MicroBatch:
    """4 rows with ragged supervision (per-rank and per-chunk counts of every loss term
    differ): row 0 packs two documents (20 + 12 tokens: the second starts inside CP rank 1's
    chunk, where MTP and the indexer restart), row 1 trains only its last 11 positions, row 2
    ends in 6 positions of padding, row 3 trains all but its first 5 (a prompt)."""
    ids = random_ids(seed + 101 * step, BATCH, SEQ)
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    docs[0, 20:] = 1
    docs[2, 26:] = -1
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    lab[0, 19] = IGNORE_INDEX  # a document's last token has no target inside it
    lab[2, 25:] = IGNORE_INDEX
    mask = (lab != IGNORE_INDEX).float()
    mask[1, :20] = 0
    mask[3, :5] = 0
    return MicroBatch(ids, lab, mask, docs)


# Every option of the policy loss on: clip-higher, dual clip, truncated IS, KL (k3).
POLICY = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0, "tis_cap": 1.5, "kl_coef": 0.1, "temperature": 0.8}


def _policy_batch(seed: int, logprobs: torch.Tensor) -> MicroBatch:
    """_batch(seed) as RL data: per-row advantages of both signs; old, rollout and reference
    log-probs scattered around the model's own (so some ratios leave the clip range, some
    truncated-IS weights reach the cap); GRPO's per-sequence weights (rows as sequences)."""
    from miles.algo.losses import response_weights

    mb = _batch(seed, 0)
    g = torch.Generator().manual_seed(seed + 7)
    m = mb.loss_mask

    def near(scale: float) -> torch.Tensor:
        return (logprobs + scale * torch.randn(m.shape, generator=g)) * m
    adv = (torch.randn(BATCH, 1, generator=g) + torch.tensor([[0.7], [-0.9], [0.3], [-0.2]])).expand_as(m) * m
    return MicroBatch(mb.input_ids, mb.labels, m, mb.doc_ids, advantages=adv.contiguous(), old_logprobs=near(0.3),
                      rollout_logprobs=near(0.5), ref_logprobs=near(0.4),
                      token_weights=(torch.tensor(response_weights([int(n) for n in m.sum(1)], "seq_mean_token_mean",
                                                                   m.shape[1]))[:, None] * m).float())


def _cuts(x: dict) -> list[tuple[int, int]]:
    """This replica's micro-batches (row ranges of the global batch). One replica takes all 4
    sequences as micro-batches of 1 and 3; with DP=2 rank 0 takes 2 micro-batches of 1 and
    rank 1 one of 2; with DP=4 each rank one row. Under EP every rank runs the expert exchange
    of each micro-batch, so the ranks take equal counts (2 of 1 each)."""
    dp, r = x["dp"], x["dp_rank"]
    if dp == 1:
        return [(0, 1), (1, 4)]
    if dp == 4:
        return [(r, r + 1)]
    if x["ep"] > 1:
        return [(0, 1), (1, 2)] if r == 0 else [(2, 3), (3, 4)]
    return [(0, 1), (1, 2)] if r == 0 else [(2, 4)]


def _cols(x: dict) -> slice | torch.Tensor:
    """The sequence positions this rank's CP chunk holds."""
    return ParallelContext(cp_size=x["cp"], cp_rank=x["cp_rank"]).seq_chunk(SEQ)


def _split(mb: MicroBatch, x: dict) -> list[MicroBatch]:
    return [mb.rows(a, b) for a, b in _cuts(x)]


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Megatron's optimizer skips weight decay on 1-D tensors and biases."""
    return p.dim() == 1 or name.endswith(".bias")


def _grads(model: DeepSeekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """Every gradient under DeepSeek's names (per routed expert), as the workers report them."""
    return dict(model.deepseek_named((k, p.grad.clone()) for k, p in model.named_parameters() if p.grad is not None))


def _single_process(seed: int, cfg: DeepSeekV4Config, parts: list[tuple[int, int]]) -> dict:
    """One process: logprobs, losses and gradients at step 0 (LM and policy loss), then the
    gradients, parameters and Adam's moments after each of STEPS AdamW steps (the workers'
    optimizer: lr, eps, weight decay and its exemptions, clipping), each step's batch taken as
    the micro-batches `parts` (row ranges, gradients accumulated)."""
    model = DeepSeekV4ForCausalLM(cfg, seed=seed).train()
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": WD},
                             {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=EPS)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with routes(model) as picked:
        _, res = losses.compute(model, _batch(seed, 0))
    policy_batch = _policy_batch(seed, res.logprobs)
    _, res = losses.compute(model, policy_batch, name="policy", options=POLICY)
    res.loss.backward()
    policy = {"batch": policy_batch, "losses": {k: v.item() for k, v in res.metrics.items()},
              "grads": _grads(model)}
    model.zero_grad(set_to_none=True)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = _batch(seed, step)
        norm = {k: v.clamp_min(1) for k, v in losses.counts(model, batch).items()}  # the global counts
        metrics, logprobs = {}, []
        for a, b in parts:
            _, res = losses.compute(model, batch.rows(a, b), norm=norm)
            res.loss.backward()
            metrics = {k: metrics.get(k, 0.0) + v.item() for k, v in res.metrics.items()}
            logprobs.append(res.logprobs.detach())
        rec = {"losses": metrics, "logprobs": torch.cat(logprobs),
               "grads": _grads(model),
               "grad_norm": torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()}
        opt.step()
        model.update_router_bias()
        rec["state"] = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [dict(model.deepseek_named((n, opt.state[p][m].clone()) for n, p in named))
                   for m in ("exp_avg", "exp_avg_sq")]
        rec["moments"] = {n: (m1, moments[1][n]) for n, m1 in moments[0].items()}
        steps.append(rec)
    return {"init": init, "policy": policy, "steps": steps, "routes": {k: v[0] for k, v in picked.items()}}


@pytest.fixture(scope="module")
def reference(request, ray_cluster):
    """The single-process run (each step's batch as one micro-batch); in bf16 (on GPUs, or
    --bf16), one process's bf16 errors as the yardstick of a layout's: the model's losses,
    logprobs, gradients and policy metrics, and a one-rank trainer's steps."""
    seed = 1234
    cfg = DeepSeekV4Config.tiny()
    ref = _single_process(seed, cfg, [(0, BATCH)])
    bf16 = GPU or request.config.getoption("--bf16")
    single16 = _single_bf16(seed, cfg, ref["policy"]["batch"]) if bf16 else None
    return {"seed": seed, "cfg": cfg, "dtype": torch.bfloat16 if bf16 else torch.float32, "single16": single16, **ref}


DRAWS = 3  # re-rounded bf16 copies of the model beside the plain one: the yardstick's spread


def _single_bf16(seed: int, cfg: DeepSeekV4Config, policy_batch: MicroBatch) -> dict:
    """One process in bf16, the yardstick of a layout's bf16 error. `draws`: step 0's losses,
    logprobs and gradients and the policy loss's metrics and gradients, of the bf16 model and
    of DRAWS copies whose every weight is multiplied by (1 + u / 256), u uniform in [-1, 1]
    (about one bf16 rounding: models bf16 cannot tell apart); `steps`: STEPS training steps
    of a one-rank trainer. Why the copies: a layout rounds its partial sums elsewhere, and
    where a quantity is fragile under rounding (a gradient summed from terms that cancel; an
    expert or indexer entry chosen by a near tie of scores) one process's error is one small
    draw of a wide spread; the copies measure that spread per quantity."""
    from miles.cluster.train_group import TrainGroup

    dev = torch.device("cuda" if GPU else "cpu")
    draws = []
    for i in range(DRAWS + 1):
        m16 = DeepSeekV4ForCausalLM(cfg, dtype=torch.bfloat16, seed=seed).train().to(dev)
        if i:
            g = torch.Generator().manual_seed(seed + i)
            with torch.no_grad():
                for p in m16.parameters():
                    p.mul_(1 + (torch.rand(p.shape, generator=g) * 2 - 1).to(dev) / 256)
        _, res = losses.compute(m16, _batch(seed, 0).to(dev))
        res.loss.backward()
        d = {"losses": {k: v.item() for k, v in res.metrics.items()}, "logprobs": res.logprobs.float().cpu(),
             "grads": {k: g.float().cpu() for k, g in _grads(m16).items()}}
        m16.zero_grad(set_to_none=True)
        _, res = losses.compute(m16, policy_batch.to(dev), name="policy", options=POLICY)
        res.loss.backward()
        draws.append({**d, "policy": {k: v.item() for k, v in res.metrics.items()},
                      "policy_grads": {k: g.float().cpu() for k, g in _grads(m16).items()}})
    group = TrainGroup(1, resources=_resources(1))
    try:
        group.call("build_model", cfg.to_dict(), seed, dtype="bfloat16")
        group.call("setup_training", LR, eps=EPS, weight_decay=WD, clip_grad=CLIP, decay="constant")
        x = group.layout[0]
        steps = [group.call("train_step", _split(_batch(seed, step), x))[0] for step in range(STEPS)]
    finally:
        group.shutdown()
    return {"draws": draws, "steps": steps}


def _yard(s16: dict | None, *path) -> list | None:
    """The bf16 draws' values at path (e.g. "grads", name), or None in fp32."""
    if s16 is None:
        return None
    out = []
    for d in s16["draws"]:
        for k in path:
            d = d[k]
        out.append(d)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, single16: list | None, what: str) -> None:
    """fp32 (`single16` None): max-abs <= ATOL. bf16 (`single16`: one process's bf16 values,
    plain and re-rounded): relative error at most 4x the largest of theirs (or 5e-2).
    bf16 misses are collected in MISSES and reported together at the layout's end."""
    if single16 is None:
        assert_close(got, want, atol=ATOL, what=what)
        return
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"non-finite values {what}"
    scale = want.norm().clamp_min(1e-12)
    err = ((got - want).norm() / scale).item()
    bases = [((torch.as_tensor(s).double() - want).norm() / scale).item() for s in single16]
    base = max(bases)
    # A layout adds bf16 roundings one process does not make (each TP rank's partial
    # row-parallel output, all-reduced partial gradients, CP/EP partial sums); 4x the spread
    # of one process's bf16 errors leaves room for that and still catches structural bugs
    # (a missing sum, a wrong shard: O(1) errors); subtle ones are the fp32 suite's job.
    if err > max(4 * base, 5e-2):
        MISSES.append(f"{what}: relative error {err:.3e} vs one process's bf16 {bases[0]:.3e} "
                      f"(re-rounded: {', '.join(f'{b:.3e}' for b in bases[1:])})")
    key = what.split(" ")[0] + " " + ("grad" if " grad " in what else what.split(" ")[-1])
    WORST[key] = max(WORST.get(key, (0.0,)), (err / max(base, 1e-12), what, f"{err:.2e}", f"{base:.2e}"))


def _tp_part(t: torch.Tensor, dim: int | None, x: dict) -> torch.Tensor:
    """This rank's TP shard of a full single-process tensor (dim None: not split)."""
    return t if dim is None else t.chunk(x["tp"], dim)[x["tp_rank"]]


def _check_grads(grads: dict[str, torch.Tensor], grads16: list[dict] | None, x: dict, r: dict, who: str,
                 skip: tuple[str, ...] = ()) -> None:
    """Each owned part of each reduced gradient (start, end in the flattened TP-local tensor)
    against the same elements of the single-process gradient (bf16: and of one process's bf16
    gradients `grads16`, one dict per draw); names starting with one of `skip` (experts a
    router flip gave other tokens, bf16 only) are not compared."""
    def part(full: dict[str, torch.Tensor], k: str, a: int, b: int) -> torch.Tensor:
        return _tp_part(full[k], r["dims"][k], x).reshape(-1)[a:b]

    for k, (a, b, g) in r["grads"].items():
        if not k.startswith(skip):
            _close(g, part(grads, k, a, b), grads16 and [part(d, k, a, b) for d in grads16], f"{who} grad {k}")


def _check_coverage(ranks: list[dict], lay: list[dict], want: set[str], name: str) -> None:
    """Nothing silently missing: every parameter's gradient is owned, element for element, by
    some rank's optimizer shard (per TP part); together the ranks hold every parameter."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    numel: dict[tuple[str, int], int] = {}
    for x, r in zip(lay, ranks, strict=True):
        for k, (a, b, _) in r["grads"].items():
            key = (k, x["tp_rank"] if r["dims"][k] is not None else 0)
            spans.setdefault(key, []).append((a, b))
            numel[key] = r["numel"][k]
    assert {k for k, _ in spans} == want, f"{name}: gradients missing for {sorted(want - {k for k, _ in spans})[:5]}"
    for key, parts in spans.items():
        end = 0
        for a, b in sorted(parts):
            assert a <= end, f"{name}: elements {end}..{a} of {key[0]} are owned by no rank"
            end = max(end, b)
        assert end == numel[key], f"{name}: {key[0]} owned up to element {end} of {numel[key]}"


def _check_routes(reference, lay: list[dict], ranks: list[dict], name: str) -> tuple[str, ...]:
    """Every learned router picks, for every token, the experts one process picks (each
    layer's picks gathered from the ranks holding it, by micro-batch rows and CP columns; TP
    peers, which hold the same tokens, pick alike). fp32: every token. bf16: a near tie
    between two experts' scores can fall either way under another rounding: one expert gains
    the token, one loses it and the kept one's normalised weight changes (their gradients move
    by O(1): not a bug, and not comparable), so up to 1 token in 20 per layer may differ (a
    wrong router differs on most); the names of the experts involved are returned, their
    gradients to be skipped, with the block's FFN mixing parameters (hc_ffn_*): their gradient
    sums the sublayer's output times the streams' gradient over the tokens, and where those
    terms cancel (one process's own bf16 error is already 8-10% for mtp.0.hc_ffn_base) the
    flipped token's O(1) change is O(1) of the sum (H100, ep2 and dp2: 5.9x one process's error
    in runs with a flip in mtp.0.ffn, 1.0x in runs without)."""
    want = reference["routes"]  # {MoE layer: experts [B, S, k]}
    got = {layer: torch.full_like(v, -1) for layer, v in want.items()}
    for x, r in zip(lay, ranks, strict=True):
        cols = _cols(x)
        for layer, picks in r["routes"].items():
            assert len(picks) == len(_cuts(x)), f"{name} rank {x['rank']} {layer}: {len(picks)} forwards recorded"
            for (a, b), p in zip(_cuts(x), picks, strict=True):
                seen = got[layer][a:b, cols]
                assert ((seen == -1) | (seen == p)).all(), f"{name} {layer}: ranks holding the same tokens disagree"
                got[layer][a:b, cols] = p
    skip = set()
    for layer, g in got.items():
        assert (g >= 0).all(), f"{name} {layer}: no rank routed some tokens"
        moved = (g != want[layer]).any(-1).nonzero().tolist()  # [[row, col], ...]
        if reference["single16"] is None:
            assert not moved, f"{name} {layer}: tokens {moved[:5]} routed to other experts than one process"
            continue
        assert len(moved) <= g[..., 0].numel() // 20, f"{name} {layer}: {len(moved)} tokens routed otherwise"
        for i, j in moved:
            experts = set(g[i, j].tolist()) | set(want[layer][i, j].tolist())  # a kept one's weight moved too
            skip |= {f"{layer}.experts.{e}." for e in experts} | {f"{layer.removesuffix('.ffn')}.hc_ffn_"}
            print(f"{name} {layer}: token ({i}, {j}) routed to {g[i, j].tolist()}, one process "
                  f"{want[layer][i, j].tolist()}: experts {sorted(experts)} and the block's hc_ffn_* not compared")
    return tuple(sorted(skip))


def _check_forward_backward(reference, lay: list[dict], ranks: list[dict], name: str) -> tuple[str, ...]:
    """Routes, losses, logprobs and gradients of step 0; returns the experts not compared."""
    ref, s16 = reference["steps"][0], reference["single16"]
    skip = _check_routes(reference, lay, ranks, name)
    for x, r in zip(lay, ranks, strict=True):
        who = f"{name} rank {x['rank']}"
        assert r["losses"].keys() == ref["losses"].keys(), f"{who}: reported {sorted(r['losses'])}"
        for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
            if s16:
                _close(torch.tensor(r["losses"][k]), torch.tensor(ref["losses"][k]), _yard(s16, "losses", k),
                       f"{who} {k}")
            else:
                assert r["losses"][k] == pytest.approx(ref["losses"][k], rel=1e-5, abs=1e-7), f"{who} {k} loss"
        last_stage = x["pp_rank"] == x["pp"] - 1
        assert bool(r["logprobs"]) == last_stage, f"{who}: logprobs belong to the last stage only"
        cols = _cols(x)
        for (a, b), lp in zip(_cuts(x), r["logprobs"], strict=True) if last_stage else ():
            _close(lp, ref["logprobs"][a:b, cols], s16 and [t[a:b, cols] for t in _yard(s16, "logprobs")],
                   f"{who} logprobs")
        _check_grads(ref["grads"], _yard(s16, "grads"), x, r, who, skip)
    _check_coverage(ranks, lay, set(ref["grads"]), name)
    return skip


def _expected_names(x: dict, names: list[str], cfg: DeepSeekV4Config) -> set[str]:
    """The parameters a rank holds: its pipeline stage's layers (the embedding on the first
    stage, and on the last for MTP; head, final norm and MTP on the last), and of the routed
    experts those of its EP rank."""
    stage = ParallelContext(pp_size=x["pp"], pp_rank=x["pp_rank"]).stage_layers(cfg.num_hidden_layers)
    per_rank = cfg.n_routed_experts // x["ep"]
    first, last = x["pp_rank"] == 0, x["pp_rank"] == x["pp"] - 1
    out = set()
    for n in names:
        parts = n.split(".")
        if parts[0] == "layers" and int(parts[1]) not in stage:
            continue
        if parts[0] in ("mtp", "head", "norm") or parts[0].startswith("hc_head"):
            if not last:
                continue
        if parts[0] == "embed" and not (first or last):
            continue
        if "experts" in parts and int(parts[parts.index("experts") + 1]) // per_rank != x["ep_rank"]:
            continue
        out.add(n)
    return out


def _check_sharding(reference, lay: list[dict], ranks: list[dict], name: str) -> None:
    """The layout really split the model (a silent fallback to one rank fails here): each
    rank holds exactly its stage's layers and its EP rank's experts, TP splits tensors."""
    names = list(reference["steps"][0]["grads"])
    for x, r in zip(lay, ranks, strict=True):
        held = set(r["numel"])
        want = _expected_names(x, names, reference["cfg"])
        assert held == want, f"{name} rank {x['rank']}: holds {sorted(held ^ want)[:4]} wrongly"
        if x["tp"] > 1:
            split = sum(d is not None for d in r["dims"].values())
            assert split > 20, f"{name} rank {x['rank']}: only {split} tensors split over TP"


def _check_adamw_step(step: int, lay: list[dict], grads: list[dict], grad_norm: float, before: list[dict],
                      shards: list[dict], after: list[dict], name: str) -> None:
    """One optimizer step of the layout equals AdamW (eps 1e-8, weight decay but not on 1-D
    tensors, clipping by the global norm) applied, in float64 by this test, to the layout's own
    reduced gradients (`grads`: the owned parts of DDP's buffers for this step's batch):
    Adam's moments m and v of every owned shard and the parameters after the step.

    Why against the layout's own gradients, not one process's parameters: with eps 1e-8 an
    element's first update is lr * g / (|g| + eps), lr * sign(g) wherever |g| >> eps, so where
    a gradient is itself fp32 summation noise (this model's mHC fn/base/scale gradients are
    ~1e-8, sums of terms that cancel) the order of a sum decides a whole update of lr, and the
    parameters it moves change every later gradient. The gradients' parity with one process is
    checked apart (_check_forward_backward; the losses and grad norms of every step below);
    here the update given those gradients is checked to fp32 rounding: m within 1e-6 of its
    two terms' sizes, sqrt(v) (what the update divides by, linear in g like m) within 1e-6
    relative or 1e-22 (v of a gradient below 1e-19 is under fp32's normal range), parameters
    within 1e-6 of the sizes of the decayed weight and the update. A moment not reduced over
    its data-parallel group, a shard at the wrong offset or a lost weight decay is O(1) on many
    elements."""
    b1, b2, t = 0.9, 0.999, step + 1
    clip = min(1.0, CLIP / (grad_norm + 1e-6))
    for x, g, p0, sh, p1 in zip(lay, grads, before, shards, after, strict=True):
        assert sh.keys() == g["grads"].keys(), f"{name} rank {x['rank']}: optimizer shards differ from gradients"
        for k, st in sh.items():
            a, b, gk = g["grads"][k]
            assert (st["start"], st["end"]) == (a, b), f"{name} rank {x['rank']} {k}: shard moved"
            gk = gk.double() * clip
            m0, v0 = (torch.zeros_like(gk), torch.zeros_like(gk)) if step == 0 else (
                PREV[(name, x["rank"], k)])
            m, v = b1 * m0 + (1 - b1) * gk, b2 * v0 + (1 - b2) * gk * gk
            PREV[(name, x["rank"], k)] = (st["exp_avg"].double(), st["exp_avg_sq"].double())
            wd = 0.0 if _no_decay(k, p0[k]) else WD
            w0 = p0[k].double().reshape(-1)[a:b]
            # The update from the shard's own fp32 moments (checked just below against m and v).
            ms, vs = st["exp_avg"].double(), st["exp_avg_sq"].double()
            upd = LR * (ms / (1 - b1**t)) / (vs.sqrt() / math.sqrt(1 - b2**t) + EPS)
            w = w0 * (1 - LR * wd) - upd
            who = f"{name} rank {x['rank']} step {t} {k}"
            # Bounds relative to the sizes of the summands (m's two terms may cancel).
            _close_to(st["exp_avg"], m, 1e-6 * (b1 * m0.abs() + (1 - b1) * gk.abs()), f"{who} exp_avg")
            _close_to(st["exp_avg_sq"].sqrt(), v.sqrt(), 1e-6 * v.sqrt() + 1e-22, f"{who} sqrt(exp_avg_sq)")
            _close_to(p1[k].reshape(-1)[a:b], w, 1e-6 * (w0.abs() + upd.abs()) + 1e-12, f"{who} parameter")


def _close_to(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"non-finite values {what}"
    err = (got.double() - want).abs()
    i = int((err - bound).argmax())
    assert (err <= bound).all(), f"{what}: error {err[i]:.3e} > {bound[i]:.3e} at element {i}"


PREV: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # each shard's moments after the previous step


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(ray_cluster, reference, name):
    """Guards (each mutation was run and fails this test): K = V gradient not summed over TP;
    the indexer target summed over local heads only; a pipeline stage's indexer loss not
    back-propagated; the MTP embedding gradient not summed over stages; expert outputs not
    summed back over EP; the MTP shift not crossing a CP chunk; router loads not summed
    over DP x CP; micro-batches normalised locally; the label's logit not summed over TP ranks
    (vocabulary-parallel log-probabilities). Combined layouts (each run, each fails its
    layout): a later pipeline stage taking a TP rank's partial output as the whole (tp2pp2);
    experts placed by the TP rank instead of the EP rank (tp2ep2); the CP chunks gathered in
    reverse order under TP (cp2tp2); the embedding gradient not summed over the stages on DP
    rank 1 (pp2dp2); router loads summed over the expert-data-parallel group only (ep2dp2);
    DP rank 1's Adam second moment not that of the reduced gradient (pp2dp2)."""
    from miles.cluster.train_group import TrainGroup

    world, sizes = LAYOUTS[name]
    if GPU and GPUS < world:
        pytest.skip(f"{world} ranks need {world} GPUs here ({GPUS} visible)")
    seed, cfg = reference["seed"], reference["cfg"]
    MISSES.clear()
    WORST.clear()
    group = TrainGroup(world, resources=_resources(world), **sizes)
    try:
        lay = group.layout
        assert [x["dp"] for x in lay] == [world // math.prod(v for k, v in sizes.items() if k != "ep")] * world, \
            "the layout silently fell back to fewer ranks"
        group.call("build_model", {**cfg.to_dict(), "recompute": name in RECOMPUTE}, seed,
                   dtype=str(reference["dtype"]).removeprefix("torch."))
        group.call("setup_training", LR, eps=EPS, weight_decay=WD, clip_grad=CLIP, decay="constant")
        batch = _batch(seed, 0)
        ranks = group.call_each("inspect", [("step_gradients", _split(batch, x)) for x in lay])
        _check_sharding(reference, lay, ranks, name)
        skip = _check_forward_backward(reference, lay, ranks, name)  # the policy pass routes alike
        dims = [r["dims"] for r in ranks]

        # The forward-only path (old/reference logprobs in RL) gives the same per-token
        # logprobs, whole sequences (CP chunks gathered), from the last stage only.
        fwd = group.call_each("forward_logprobs", [(_split(batch, x),) for x in lay])
        for x, lps in zip(lay, fwd, strict=True):
            assert (lps is not None) == (x["pp_rank"] == x["pp"] - 1)
            s16 = reference["single16"]
            for (a, b), lp in zip(_cuts(x), lps, strict=True) if lps else ():
                _close(lp, reference["steps"][0]["logprobs"][a:b], s16 and [t[a:b] for t in _yard(s16, "logprobs")],
                       f"{name} forward_logprobs")

        # The policy loss (every option on) through the same schedules: losses and gradients.
        group.call("set_loss", "policy", POLICY)
        pol, s16 = reference["policy"], reference["single16"]
        ranks = group.call_each("inspect", [("step_gradients", _split(pol["batch"], x)) for x in lay])
        for x, r in zip(lay, ranks, strict=True):
            who = f"{name} rank {x['rank']} policy"
            assert r["losses"].keys() == pol["losses"].keys(), f"{who}: metrics {sorted(r['losses'])}"
            for k, v in pol["losses"].items():
                if s16:
                    _close(torch.tensor(r["losses"][k]), torch.tensor(v), _yard(s16, "policy", k), f"{who} {k}")
                else:
                    assert r["losses"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), f"{who} {k}"
            _check_grads(pol["grads"], _yard(s16, "policy_grads"), x, r, who, skip)
        _check_coverage(ranks, lay, set(pol["grads"]), f"{name} policy")
        group.call("set_loss", "lm")

        exported = {}
        for bucket in group.export_weights(bucket_bytes=1 << 16):
            assert not exported.keys() & bucket.keys(), "a tensor was exported twice"
            exported.update(bucket)
        assert exported.keys() == reference["init"].keys()
        for k, v in reference["init"].items():
            assert torch.equal(exported[k], v.to(exported[k].dtype)), f"{name}: exported {k} differs"

        before = [{k: _tp_part(v, d.get(k), x) for k, v in reference["init"].items() if k in d}
                  for x, d in zip(lay, dims, strict=True)]
        for step in range(STEPS):
            mbs = [_split(_batch(seed, step), x) for x in lay]
            # The gradients this step will apply (the same pass as the step's own: deterministic).
            grads = group.call_each("inspect", [("step_gradients", m) for m in mbs])
            logs = group.call_each("train_step", [(m,) for m in mbs])
            ref = reference["steps"][step]
            for x, log in zip(lay, logs, strict=True):
                who = f"{name} rank {x['rank']} step {step}"
                if s16:  # against a one-rank bf16 trainer's same step
                    for k, want in (("loss", ref["losses"]["loss"]), ("grad_norm", ref["grad_norm"])):
                        _close(torch.tensor(log[k]), torch.tensor(want), [s16["steps"][step][k]], f"{who} {k}")
                else:
                    assert log["loss"] == pytest.approx(ref["losses"]["loss"], rel=1e-5), f"{who} loss"
                    assert log["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), f"{who} grad norm"
            if s16:
                continue  # bf16 parameters after Adam steps: compared through the losses above
            after = group.call("inspect", "model_state")
            for x, st in zip(lay, after, strict=True):  # aux-loss-free balancing: global loads, sign updates
                for k in (k for k in st if k.endswith("gate.bias")):
                    assert torch.equal(st[k], ref["state"][k]), f"{name} rank {x['rank']} step {step + 1} {k}"
            _check_adamw_step(step, lay, grads, logs[0]["grad_norm"], before, group.call("inspect", "optimizer_shards"),
                              after, name)
            before = after
        # Where gradients are summed over ranks (DP x CP > 1) their reduction overlaps the
        # backward: on a step after the first, every bucket group (dense and expert) began its
        # reduce-scatter before the backward ended. An op that adds into main_grad without
        # announcing it (ops.main_grad_written; planted: the head's) leaves its bucket to the end.
        for x, ov in zip(lay, group.call("inspect", "reduction_overlap"), strict=True):
            if x["dp"] * x["cp"] > 1:
                assert ov is not None and ov[1] > 0 and ov[0] == ov[1], \
                    f"{name} rank {x['rank']}: {ov and ov[0]} of {ov and ov[1]} bucket groups reduced in the backward"
            else:
                assert ov is None, f"{name} rank {x['rank']}: an overlapped reduction on one data-parallel rank"
    finally:
        group.shutdown()
    if reference["single16"]:
        print(f"\n{name}: worst layout / single-process bf16 error ratios:")
        for key, (ratio, what, err, base) in sorted(WORST.items()):
            print(f"  {key}: {ratio:.2f}x at {what} ({err} vs {base})")
    assert not MISSES, f"{len(MISSES)} comparisons over their bound:\n" + "\n".join(MISSES)


def test_one_micro_batch_of_8_equals_8_micro_batches_of_1(ray_cluster, seed):
    """Guards aux losses (MTP, indexer) or the LM loss scaled per micro-batch instead of per
    global batch: two single-rank trainers, one taking the 8 sequences as 1 micro-batch and
    one as 8 micro-batches of 1, report the same losses and grad norms and end with the same
    parameters and router biases after 2 steps. (Ids are drawn again where the trainers'
    weights meet a near tie: a batch of 8 and one of 1 round otherwise.)"""
    from miles.cluster.train_group import TrainGroup

    cfg = DeepSeekV4Config.tiny()
    groups = [TrainGroup(1, resources=_resources(1)), TrainGroup(1, resources=_resources(1))]
    try:
        for g in groups:
            g.call("build_model", cfg.to_dict(), seed)
            # eps 1 keeps the 2 steps' parameters linear in the gradients: this test is about
            # loss normalisation; the optimizer at eps 1e-8 is checked by the layout test.
            g.call("setup_training", LR, eps=1.0, decay="constant")
        logs = []
        local = DeepSeekV4ForCausalLM(cfg).eval()  # the trainers' weights, for ids without a near tie
        for step in range(STEPS):
            local.load_state_dict({k: v for b in groups[0].export_weights() for k, v in b.items()})
            gen = torch.Generator().manual_seed(seed + 10 * step)
            ids = without_near_ties(local, lambda gen=gen: torch.randint(0, 320, (8, 29), generator=gen))
            lab = torch.roll(ids, -1, 1)
            lab[:, -1] = IGNORE_INDEX
            lab[2, :11] = IGNORE_INDEX
            mb = MicroBatch.lm(ids, lab)
            whole = groups[0].workers[0].train_step.remote([mb])
            split = groups[1].workers[0].train_step.remote([mb.rows(i, i + 1) for i in range(8)])
            logs.append(ray_cluster.get([whole, split]))
        states = [g.call("inspect", "model_state")[0] for g in groups]
    finally:
        for g in groups:
            g.shutdown()
    for whole, split in logs:
        for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss", "grad_norm"):
            assert split[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7), k
    for k, v in states[0].items():
        assert_close(states[1][k].float(), v.float(), atol=1e-6, rtol=1e-5, what=k)


def test_a_loss_that_reaches_other_parameters_keeps_the_overlapped_reduction(ray_cluster, seed):
    """DP=2 with the reduction overlapped: Megatron starts a bucket's reduce-scatter when this
    step's per-parameter ready counts equal the first step's. Turning MTP off mid-run changes
    them (the MTP block gets no gradient, the shared head is counted once, not twice), and
    back on again: every step still ends with one reduced gradient (the same finite grad norm
    on both ranks; the sums themselves are the parity tests' above). With MTP on every bucket
    group's reduction begins inside the backward, again from the second step after turning it
    back on (with it off the MTP block's groups may wait for the backward's end: a parameter no
    backward reaches is counted there, late, never early). Planted: without relearn_counts the
    first MTP-less step fails in finish_grad_sync."""
    from miles.cluster.train_group import TrainGroup

    group = TrainGroup(2, resources=_resources(2))
    try:
        group.call("build_model", DeepSeekV4Config.tiny().to_dict(), seed)
        group.call("set_loss", "lm")
        group.call("setup_training", LR, decay="constant")
        batch = _batch(seed, 0)
        halves = [[batch.rows(0, 2)], [batch.rows(2, 4)]]
        for mtp in (0.3, 0.0, 0.3):
            group.call("set_loss", "lm", mtp=mtp)
            for _ in range(2):
                logs = group.call_each("train_step", [(h,) for h in halves])
                assert all(math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in logs)
                assert logs[0]["grad_norm"] == pytest.approx(logs[1]["grad_norm"], rel=1e-6)
            assert ("mtp_loss" in logs[0]) == (mtp > 0)
            for ov in group.call("inspect", "reduction_overlap"):
                assert ov is not None and ov[1] > 0 and (ov[0] == ov[1] or mtp == 0), f"mtp {mtp}: {ov}"
    finally:
        group.shutdown()


def test_sleep_and_wake_up_free_and_restore_everything(ray_cluster, seed):
    """Colocation: sleep() releases every storage of the training state (weights, DDP
    buffers, optimizer moments: at least 4 fp32 copies of the parameters) and wake_up()
    restores all of it bit for bit (same digest), after which training goes on."""
    from miles.cluster.train_group import TrainGroup

    cfg = DeepSeekV4Config.tiny()
    group = TrainGroup(1, resources=_resources(1))
    try:
        group.call("build_model", cfg.to_dict(), seed)
        group.call("setup_training", LR, eps=EPS, weight_decay=WD, clip_grad=CLIP, decay="constant")
        first = group.call("train_step", [_batch(seed, 0)])[0]
        resident, digest = group.call("inspect", "resident_bytes")[0], group.call("inspect", "state_digest")[0]
        n_params = sum(p.numel() for p in DeepSeekV4ForCausalLM(cfg, seed=None).parameters())
        assert resident >= 4 * n_params * 4, "weights, gradients and two Adam moments (fp32)"
        assert group.call("sleep")[0] == resident
        assert group.call("inspect", "resident_bytes")[0] == 0
        with pytest.raises(Exception, match="called twice"):
            group.call("sleep")
        group.call("wake_up")
        assert group.call("inspect", "resident_bytes")[0] == resident
        assert group.call("inspect", "state_digest")[0] == digest, "wake_up did not restore the training state"
        second = group.call("train_step", [_batch(seed, 0)])[0]
    finally:
        group.shutdown()
    assert second["loss"] < first["loss"], "training goes on from the restored state"
