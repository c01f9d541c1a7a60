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

On a machine with enough GPUs the same suite runs with nccl in bf16 (Triton attention kernels):
there a layout's error against the fp32 single-process reference may be at most 4x the
single-process bf16 run's own error (or 5% of the reference, whichever is larger), and the
losses and grad norms of the training steps agree within 2% / 5%.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
from conftest import assert_close, random_ids

pytest.importorskip("megatron.core")

from miles.train import losses  # noqa: E402
from miles.train.batching import MicroBatch  # noqa: E402
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

COMBINED = [k for k, (world, _) in LAYOUTS.items() if world == 4]
# The combined layouts train with config.recompute: each block's forward, its collectives
# included, runs again in the backward, and everything below must still hold.
RECOMPUTE = set(COMBINED)
PER_RUN = 2  # combined layouts per `make test` (each ~15 s on 2 cores), a different pair each day


def _rotation(today: int) -> set[str]:
    """The combined layouts a plain run checks on day `today`: PER_RUN consecutive ones, so
    every layout runs at least every few days; `make test-all` (--all-layouts) runs all."""
    start = today * PER_RUN % len(COMBINED)
    return {COMBINED[(start + i) % len(COMBINED)] for i in range(PER_RUN)}


GPUS = torch.cuda.device_count()
GPU = GPUS >= 2
DTYPE = torch.bfloat16 if GPU else torch.float32
WORST: dict[str, float] = {}  # GPU: largest (layout error / single-process bf16 error) per quantity


def _resources(world: int) -> dict | None:
    """One GPU per rank where there are GPUs; on CPU four ranks share the fixture's 2 CPUs."""
    if GPU:
        return {"CPU": 1, "GPU": 1}
    return {"CPU": min(1.0, 2 / world)}


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
POLICY = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0, "tis_cap": 1.5, "kl_coef": 0.1}


def _policy_batch(seed: int, logprobs: torch.Tensor) -> MicroBatch:
    """_batch(seed) as RL data: per-row advantages of both signs; old, rollout and reference
    log-probs scattered around the model's own (so some ratios leave the clip range, some
    truncated-IS weights reach the cap); GRPO's per-sequence weights (rows as sequences)."""
    from miles.algo.losses import aggregation_weights

    mb = _batch(seed, 0)
    g = torch.Generator().manual_seed(seed + 7)
    m = mb.loss_mask

    def near(scale: float) -> torch.Tensor:
        return (logprobs + scale * torch.randn(m.shape, generator=g)) * m
    adv = (torch.randn(BATCH, 1, generator=g) + torch.tensor([[0.7], [-0.9], [0.3], [-0.2]])).expand_as(m) * m
    return MicroBatch(mb.input_ids, mb.labels, m, mb.doc_ids, advantages=adv.contiguous(), old_logprobs=near(0.3),
                      rollout_logprobs=near(0.5), ref_logprobs=near(0.4),
                      token_weights=aggregation_weights(m, "seq_mean_token_mean").float())


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
    return {"init": init, "policy": policy, "steps": steps}


@pytest.fixture(scope="module")
def reference():
    """The single-process run (each step's batch as one micro-batch); on a GPU, one process's
    bf16 error as the yardstick of a layout's."""
    seed = 1234
    cfg = DeepSeekV4Config.tiny()
    ref = _single_process(seed, cfg, [(0, BATCH)])
    single16 = None
    if GPU:  # the single-process bf16 run: the yardstick for layouts' bf16 error
        m16 = DeepSeekV4ForCausalLM(cfg, dtype=DTYPE, seed=seed).train().cuda()
        _, res = losses.compute(m16, _batch(seed, 0).to(torch.device("cuda")))
        res.loss.backward()
        single16 = {"losses": {k: v.item() for k, v in res.metrics.items()}, "logprobs": res.logprobs.cpu(),
                    "grads": {k: g.float().cpu() for k, g in _grads(m16).items()}}
    return {"seed": seed, "cfg": cfg, "single16": single16, **ref}


def _close(got: torch.Tensor, want: torch.Tensor, single16: torch.Tensor | None, what: str) -> None:
    """fp32 (CPU): max-abs <= ATOL. bf16 (GPU): relative error at most 4x one process's (or 5e-2)."""
    if not GPU:
        assert_close(got, want, atol=ATOL, what=what)
        return
    got, want, single16 = got.double(), want.double(), single16.double()
    assert torch.isfinite(got).all(), f"non-finite values {what}"
    scale = want.norm().clamp_min(1e-12)
    err, base = ((got - want).norm() / scale).item(), ((single16 - want).norm() / scale).item()
    # A layout adds bf16 roundings one process does not make (each TP rank's partial
    # row-parallel output, all-reduced partial gradients, CP/EP partial sums), and sums that
    # cancel (the mHC base/scale gradients: 24 numbers summed over every token) amplify the
    # order: measured on 2 H200s, worst ratios 2-8x on tiny bases, <= 4.7e-2 relative. The
    # bound catches structural bugs (a missing sum, a wrong shard: O(1) errors); subtle ones
    # are the fp32 CPU suite's job.
    assert err <= max(4 * base, 5e-2), f"{what}: relative error {err:.3e} vs one process's bf16 {base:.3e}"
    key = what.split(" ")[0] + " " + ("grad" if " grad " in what else what.split(" ")[-1])
    WORST[key] = max(WORST.get(key, 0.0), err / max(base, 1e-12))


def _tp_part(t: torch.Tensor, dim: int | None, x: dict) -> torch.Tensor:
    """This rank's TP shard of a full single-process tensor (dim None: not split)."""
    return t if dim is None else t.chunk(x["tp"], dim)[x["tp_rank"]]


def _check_grads(grads: dict[str, torch.Tensor], s16: dict | None, x: dict, r: dict, who: str) -> None:
    """Each owned part of each reduced gradient (start, end in the flattened TP-local tensor)
    against the same elements of the single-process gradient."""
    for k, (a, b, g) in r["grads"].items():
        dim = r["dims"][k]
        want = _tp_part(grads[k], dim, x).reshape(-1)[a:b]
        _close(g, want, s16 and _tp_part(s16[k], dim, x).reshape(-1)[a:b], f"{who} grad {k}")


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


def _check_forward_backward(reference, lay: list[dict], ranks: list[dict], name: str) -> None:
    ref, s16 = reference["steps"][0], reference["single16"]
    for x, r in zip(lay, ranks, strict=True):
        who = f"{name} rank {x['rank']}"
        assert r["losses"].keys() == ref["losses"].keys(), f"{who}: reported {sorted(r['losses'])}"
        for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
            if GPU:
                _close(torch.tensor(r["losses"][k]), torch.tensor(ref["losses"][k]),
                       torch.tensor(s16["losses"][k]), f"{who} {k}")
            else:
                assert r["losses"][k] == pytest.approx(ref["losses"][k], rel=1e-5, abs=1e-7), f"{who} {k} loss"
        last_stage = x["pp_rank"] == x["pp"] - 1
        assert bool(r["logprobs"]) == last_stage, f"{who}: logprobs belong to the last stage only"
        cols = ParallelContext(cp_size=x["cp"], cp_rank=x["cp_rank"]).seq_chunk(SEQ)
        for (a, b), lp in zip(_cuts(x), r["logprobs"], strict=True) if last_stage else ():
            _close(lp, ref["logprobs"][a:b, cols], s16 and s16["logprobs"][a:b, cols], f"{who} logprobs")
        _check_grads(ref["grads"], s16 and s16["grads"], x, r, who)
    _check_coverage(ranks, lay, set(ref["grads"]), name)


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
def test_layout_matches_single_process(ray_cluster, reference, name, request):
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
    today = datetime.date.today().toordinal()
    if name in COMBINED and not request.config.getoption("--all-layouts") and name not in _rotation(today):
        pytest.skip(f"today's combined layouts are {sorted(_rotation(today))} (make test-all runs every one)")
    if GPU and GPUS < world:
        pytest.skip(f"{world} ranks need {world} GPUs here ({GPUS} visible)")
    seed, cfg = reference["seed"], reference["cfg"]
    group = TrainGroup(world, resources=_resources(world), **sizes)
    try:
        lay = group.layout
        assert [x["dp"] for x in lay] == [world // math.prod(v for k, v in sizes.items() if k != "ep")] * world, \
            "the layout silently fell back to fewer ranks"
        group.call("build_model", {**cfg.to_dict(), "recompute": name in RECOMPUTE}, seed,
                   dtype=str(DTYPE).removeprefix("torch."))
        group.call("setup_training", LR, eps=EPS, weight_decay=WD, clip_grad=CLIP, decay="constant")
        batch = _batch(seed, 0)
        ranks = group.call_each("inspect", [("step_gradients", _split(batch, x)) for x in lay])
        _check_sharding(reference, lay, ranks, name)
        _check_forward_backward(reference, lay, ranks, name)
        dims = [r["dims"] for r in ranks]

        # The forward-only path (old/reference logprobs in RL) gives the same per-token
        # logprobs, whole sequences (CP chunks gathered), from the last stage only.
        fwd = group.call_each("forward_logprobs", [(_split(batch, x),) for x in lay])
        for x, lps in zip(lay, fwd, strict=True):
            assert (lps is not None) == (x["pp_rank"] == x["pp"] - 1)
            s16 = reference["single16"]
            for (a, b), lp in zip(_cuts(x), lps, strict=True) if lps else ():
                _close(lp, reference["steps"][0]["logprobs"][a:b], s16 and s16["logprobs"][a:b],
                       f"{name} forward_logprobs")

        # The policy loss (every option on) through the same schedules: losses and gradients.
        group.call("set_loss", "policy", POLICY)
        pol = reference["policy"]
        ranks = group.call_each("inspect", [("step_gradients", _split(pol["batch"], x)) for x in lay])
        for x, r in zip(lay, ranks, strict=True):
            assert r["losses"].keys() == pol["losses"].keys(), f"{name}: policy metrics {sorted(r['losses'])}"
            for k, v in pol["losses"].items():
                assert r["losses"][k] == pytest.approx(v, rel=2e-2 if GPU else 1e-5, abs=1e-7), f"{name} policy {k}"
            if not GPU:
                _check_grads(pol["grads"], None, x, r, f"{name} rank {x['rank']} policy")
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
                assert log["loss"] == pytest.approx(ref["losses"]["loss"], rel=2e-2 if GPU else 1e-5), \
                    f"rank {x['rank']} step {step} loss"
                assert log["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2 if GPU else 1e-4), \
                    f"rank {x['rank']} step {step} grad norm"
            if GPU:
                continue  # bf16 parameters after Adam steps: compared through the losses above
            after = group.call("inspect", "model_state")
            for x, st in zip(lay, after, strict=True):  # aux-loss-free balancing: global loads, sign updates
                for k in (k for k in st if k.endswith("gate.bias")):
                    assert torch.equal(st[k], ref["state"][k]), f"{name} rank {x['rank']} step {step + 1} {k}"
            _check_adamw_step(step, lay, grads, logs[0]["grad_norm"], before, group.call("inspect", "optimizer_shards"),
                              after, name)
            before = after
    finally:
        group.shutdown()
    if GPU:
        print(f"{name}: worst layout/single-process bf16 error ratios {WORST}")


def test_the_rotation_covers_every_combined_layout():
    """A plain run skips no combined layout for more than a few days in a row."""
    seen = set().union(*(_rotation(day) for day in range(738000, 738000 + len(COMBINED))))
    assert seen == set(COMBINED) and all(len(_rotation(d)) == PER_RUN for d in range(738000, 738010))


def test_one_micro_batch_of_8_equals_8_micro_batches_of_1(ray_cluster, seed):
    """Guards aux losses (MTP, indexer) or the LM loss scaled per micro-batch instead of per
    global batch: two single-rank trainers, one taking the 8 sequences as 1 micro-batch and
    one as 8 micro-batches of 1, report the same losses and grad norms and end with the same
    parameters and router biases after 2 steps."""
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
        for step in range(STEPS):
            ids = random_ids(seed + 10 * step, 8, 29)
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
        resident, digest = group.call("resident_bytes")[0], group.call("state_digest")[0]
        n_params = sum(p.numel() for p in DeepSeekV4ForCausalLM(cfg, seed=None).parameters())
        assert resident >= 4 * n_params * 4, "weights, gradients and two Adam moments (fp32)"
        assert group.call("sleep")[0] == resident
        assert group.call("resident_bytes")[0] == 0
        with pytest.raises(Exception, match="called twice"):
            group.call("sleep")
        group.call("wake_up")
        assert group.call("resident_bytes")[0] == resident
        assert group.call("state_digest")[0] == digest, "wake_up did not restore the training state"
        second = group.call("train_step", [_batch(seed, 0)])[0]
    finally:
        group.shutdown()
    assert second["loss"] < first["loss"], "training goes on from the restored state"
