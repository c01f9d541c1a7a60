"""Tests for plugins.deepseek_v4.ops against independent float64 oracles written from DSV4.md.

Gradient strategy. Every op except `grouped_out_proj` computes in fp32 internally by design
(`.float()`, DSV4.md sections 3-5 and pitfall 9), so a float64 `torch.autograd.gradcheck` on
the op itself cannot pass at its default tolerances (its finite differences would see fp32
rounding). For those ops the test compares the op's autograd gradient (vector-Jacobian product
with a fresh random cotangent) against the gradient of a float64 re-implementation written here
from the DSV4.md formula, and that oracle is itself gradchecked in float64, so the op's gradient
is tied to finite differences of the spec formula. Tolerance: inputs are rounded to fp32
(unit roundoff 6e-8) and each op does O(10-100) dependent flops per element, so agreement to
1e-5 of the gradient's largest magnitude (~100x fp32 roundoff) is what a correct fp32
implementation achieves; a wrong formula (e.g. rotate_half(g)*sin instead of
rotate_half(g*sin), a missing transpose) is off by O(1). `grouped_out_proj` keeps its input
dtype, so it gets a real float64 gradcheck.

All random inputs come from a fresh seed per test (printed, and quoted in every assertion
message) and are asymmetric: non-square shapes, RoPE angles from random positions and random
frequencies, non-symmetric mHC comb matrices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from plugins.deepseek_v4 import ops
from plugins.deepseek_v4.config import DeepSeekV4Config, YarnScaling
from plugins.deepseek_v4.layout import SequenceLayout

pytestmark = pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")

F64 = torch.float64
# fp32-internal op vs float64 oracle: relative to the largest magnitude of the reference
# (see the module docstring for the justification).
FP32_REL = 1e-5


# ----------------------------------------------------------------------------------------------------------
# fresh randomness and finiteness-first comparisons


@dataclass
class Rng:
    seed: int
    gen: torch.Generator

    def tag(self, what: str) -> str:
        return f"{what} [seed={self.seed}]"

    def randn(self, *shape: int, std: float = 1.0, dtype: torch.dtype = F64) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, dtype=F64) * std).to(dtype)

    def uniform(self, *shape: int, lo: float = 0.0, hi: float = 1.0, dtype: torch.dtype = F64) -> torch.Tensor:
        return (lo + (hi - lo) * torch.rand(*shape, generator=self.gen, dtype=F64)).to(dtype)

    def randint(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.gen)

    def bern(self, p: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen) < p


@pytest.fixture
def rng(seed: int) -> Rng:
    """On conftest's seed (printed; MILES_TEST_SEED=<it> replays a failure)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    return Rng(seed, gen)


def assert_finite(t: torch.Tensor, msg: str) -> None:
    assert torch.isfinite(t).all(), f"{msg}: {int((~torch.isfinite(t)).sum())} non-finite values"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, msg: str) -> None:
    """|actual - expected| <= atol + rtol*|expected| elementwise, after asserting both all-finite
    (a NaN must never pass as 'close', DSV4.md pitfall 4)."""
    assert_finite(actual, f"{msg} (actual)")
    assert_finite(expected, f"{msg} (expected)")
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise AssertionError(f"{msg}: max|diff| {err.max().item():.3e} (atol {atol:.1e}, rtol {rtol:.1e}); "
                             f"first bad index {where}: {a[tuple(where)].item()!r} vs {e[tuple(where)].item()!r}")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    """Bitwise equality, finiteness first."""
    if actual.dtype != torch.bool:
        assert_finite(actual, f"{msg} (actual)")
        assert_finite(expected, f"{msg} (expected)")
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{msg}: tensors differ"


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, msg: str,
                     scale: float = 0.0) -> None:
    """Agreement to `rel` of max(the reference's largest magnitude, `scale`), and elementwise rtol
    `rel`. The reference must not be all-zero, or the comparison could not fail."""
    assert_finite(expected, f"{msg} (expected)")
    own = expected.detach().abs().max().item()
    assert own > 0, f"{msg}: reference is identically zero, the check would be vacuous"
    assert_close(actual, expected, atol=rel * max(own, scale), rtol=rel, msg=msg)


def _as_tuple(x) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_against_oracle(rng: Rng, op: Callable, oracle: Callable, inputs: Sequence[torch.Tensor],
                         names: Sequence[str], rel: float = FP32_REL, out_rel: float | None = None,
                         gradcheck_oracle: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward outputs and gradients (for the inputs that require grad) of `op` vs the float64
    `oracle`, under anomaly mode; the oracle is gradchecked in float64 (fast mode) first.
    Returns (op grads, oracle grads)."""
    with torch.autograd.detect_anomaly():
        if gradcheck_oracle:
            ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
            assert torch.autograd.gradcheck(lambda *a: oracle(*a), ref_in, fast_mode=True), \
                rng.tag("oracle gradcheck")
        op_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        outs, refs = _as_tuple(op(*op_in)), _as_tuple(oracle(*ref_in))
        assert len(outs) == len(refs)
        loss_op = torch.zeros((), dtype=F64)
        loss_ref = torch.zeros((), dtype=F64)
        for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
            assert_rel_close(o, r, out_rel or rel, rng.tag(f"forward output {i}"))
            cot = rng.randn(*r.shape)
            loss_op = loss_op + (o.double() * cot).sum()
            loss_ref = loss_ref + (r * cot).sum()
        diff_op = [t for t in op_in if t.requires_grad]
        diff_ref = [t for t in ref_in if t.requires_grad]
        g_op = torch.autograd.grad(loss_op, diff_op)
        g_ref = torch.autograd.grad(loss_ref, diff_ref)
    diff = [(n, t) for n, t in zip(names, inputs, strict=True) if t.requires_grad]
    # A gradient that is a reduction over the batch (a scale, a bias, the sink) can cancel to far
    # below the size of its terms, and fp32 rounding is relative to the terms: the largest
    # gradient entry in the call bounds the term size (all inputs here are O(1)).
    problem_scale = max(g.abs().max().item() for g in g_ref)
    for (name, t), a, b in zip(diff, g_op, g_ref, strict=True):
        assert a.dtype == t.dtype, rng.tag(f"grad {name} dtype {a.dtype} != input dtype {t.dtype}")
        assert_rel_close(a, b, rel, rng.tag(f"grad wrt {name}"), scale=problem_scale)
    return list(g_op), list(g_ref)


# ----------------------------------------------------------------------------------------------------------
# float64 oracles, written from DSV4.md (not from ops.py)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def ref_rope(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Complex view of interleaved pairs (x[2i] + i x[2i+1]) on the last 2*angles.shape[-1]
    dims, multiplied by e^{+-i angle}; the prefix passes through."""
    rd = 2 * angles.shape[-1]
    head, tail = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd:]
    z = torch.view_as_complex(tail.reshape(*tail.shape[:-1], rd // 2, 2).contiguous())
    rot = torch.polar(torch.ones_like(angles), -angles if inverse else angles)
    return torch.cat((head, torch.view_as_real(z * rot).flatten(-2)), dim=-1)


def sylvester_hadamard(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n): the Sylvester matrix, built bit by bit."""
    idx = torch.arange(n)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(F64) / math.sqrt(n)


def ref_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    m = e / e.sum(-1, keepdim=True) + eps  # row softmax + eps
    m = m / (m.sum(-2, keepdim=True) + eps)  # column normalisation
    for _ in range(iters - 1):  # (iters - 1) x (row, column)
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def ref_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = x.reshape(*x.shape[:-2], -1)
    return (flat @ fn.transpose(0, 1)) / torch.sqrt((flat * flat).mean(-1, keepdim=True) + eps)


def ref_hc_pre(x, fn, base, scale, norm_eps, hc_eps, iters):
    n = x.shape[-2]
    mix = ref_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mix.shape[:-1], n, n)
    comb = ref_sinkhorn(logits, iters, hc_eps)
    u = sum(pre[..., i, None] * x[..., i, :] for i in range(n))
    return u, post, comb


def ref_hc_post(f, x, post, comb):
    """X'_j = post_j F + sum_i comb[i, j] X_i, as an explicit loop."""
    n = x.shape[-2]
    outs = []
    for j in range(n):
        acc = post[..., j, None] * f
        for i in range(n):
            acc = acc + comb[..., i, j, None] * x[..., i, :]
        outs.append(acc)
    return torch.stack(outs, dim=-2)


def ref_hc_head(x, fn, base, scale, norm_eps, hc_eps):
    n = x.shape[-2]
    pre = torch.sigmoid(ref_mixes(x, fn, norm_eps) * scale[0] + base) + hc_eps
    return sum(pre[..., i, None] * x[..., i, :] for i in range(n))


def ref_compress_pool(c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.amax(-2, keepdim=True))
    return (e / e.sum(-2, keepdim=True) * c).sum(-2)


def ref_sparse_attention(q, kv, mask, sink, scale):
    """Explicit per-(batch, query, head) loop: o = sum_j e^{s_j} kv_j / (sum_j e^{s_j} + e^{sink})."""
    b_, s_, h_, d_ = q.shape
    outs, probs = [], torch.zeros(b_, h_, s_, kv.shape[1], dtype=q.dtype)
    for b in range(b_):
        for s in range(s_):
            idx = mask[b, s].nonzero().flatten()
            keys = kv[b, idx]  # [n, D], n may be 0
            for h in range(h_):
                e = torch.exp((keys @ q[b, s, h]) * scale)  # [n]
                den = e.sum() + torch.exp(sink[h])
                outs.append((e[:, None] * keys).sum(0) / den)
                probs[b, h, s, idx] = (e / den).detach()
    return torch.stack(outs).reshape(b_, s_, h_, d_), probs


def ref_indexer_scores(q, k, w):
    h_ = q.shape[2]
    return sum(w[:, :, h, None] * torch.relu(q[:, :, h, :] @ k.transpose(1, 2)) for h in range(h_))


def ref_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: visible indices ordered by (score descending, index ascending), first k."""
    out = torch.zeros_like(visible)
    flat_s, flat_v, flat_o = scores.reshape(-1, scores.shape[-1]), visible.reshape(-1, scores.shape[-1]), \
        out.view(-1, scores.shape[-1])
    for r in range(flat_s.shape[0]):
        cand = [g for g in range(flat_s.shape[1]) if flat_v[r, g]]
        cand.sort(key=lambda g: (-flat_s[r, g].item(), g))
        for g in cand[:k]:
            flat_o[r, g] = True
    return out


def ref_clamped_swiglu(g, u, limit):
    gc = torch.where(g > limit, torch.full_like(g, limit), g)
    uc = torch.where(u > limit, torch.full_like(u, limit), torch.where(u < -limit, torch.full_like(u, -limit), u))
    return gc * torch.sigmoid(gc) * uc


def ref_grouped_out_proj(o, wo_a, groups):
    b, s = o.shape[:2]
    flat = o.reshape(b, s, -1)
    k = flat.shape[-1] // groups
    r = wo_a.shape[0] // groups
    return torch.cat([flat[..., g * k:(g + 1) * k] @ wo_a[g * r:(g + 1) * r].transpose(0, 1)
                      for g in range(groups)], dim=-1)


def random_angles(rng: Rng, *shape: int, half: int) -> torch.Tensor:
    """Angles pos * freq from random integer positions and random frequencies, so cos/sin differ
    across pairs and between the two halves of every rotation."""
    pos = rng.randint(0, 5000, *shape).to(F64)
    freq = rng.uniform(half, lo=1e-4, hi=1.0)
    return pos[..., None] * freq


def yarn_oracle(rope_dim: int, theta: float, y: YarnScaling) -> tuple[torch.Tensor, int, float]:
    """YaRN frequency blend (DeepSeek's, no mscale): the correction dim for r rotations over the
    original context is d*ln(L/(2 pi r)) / (2 ln theta); dims below the beta_fast one keep their
    frequency, dims above the beta_slow one are divided by `factor`, linear ramp in between."""
    i = torch.arange(rope_dim // 2, dtype=F64)
    base = theta ** (-2 * i / rope_dim)

    def corr(rot: float) -> float:
        return rope_dim * math.log(y.original_max_position_embeddings / (2 * math.pi * rot)) / (2 * math.log(theta))

    lo = max(math.floor(corr(y.beta_fast)), 0)
    hi = min(math.ceil(corr(y.beta_slow)), rope_dim - 1)
    if hi == lo:
        hi += 0.001
    ramp = ((i - lo) / (hi - lo)).clamp(0, 1)
    return base * (1 - ramp) + base / y.factor * ramp, lo, hi


# ----------------------------------------------------------------------------------------------------------
# rms_norm


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_oracle_and_grads(rng: Rng, with_weight: bool) -> None:
    """Guards a wrong RMSNorm formula or backward (mean vs sum, eps outside the sqrt, weight
    gradient missing). fp32-internal op, so gradients are compared to a float64 oracle."""
    # Rows of very different magnitude: for the small ones mean(x^2) ~ eps, so where eps enters
    # (inside the rsqrt) is visible.
    x = (rng.randn(3, 5, 12) * 10.0 ** rng.uniform(3, 5, 1, lo=-4.0, hi=1.0)).requires_grad_()
    w = rng.uniform(12, lo=0.5, hi=1.5).requires_grad_() if with_weight else None
    eps = 1e-6
    if with_weight:
        check_against_oracle(rng, lambda a, b: ops.rms_norm(a, b, eps), lambda a, b: ref_rms_norm(a, b, eps),
                             [x, w], ["x", "weight"])
    else:
        check_against_oracle(rng, lambda a: ops.rms_norm(a, None, eps), lambda a: ref_rms_norm(a, None, eps),
                             [x], ["x"])


# ----------------------------------------------------------------------------------------------------------
# RoPE


@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_complex_oracle_and_grads(rng: Rng, inverse: bool) -> None:
    """Guards a wrong RoPE rotation or backward (rotate_half(g)*sin instead of rotate_half(g*sin),
    wrong sign of the inverse, rotating the non-rope prefix, half-split instead of interleaved
    pairs) against a complex-number oracle, with angles from random positions and frequencies.
    fp32-internal op: gradients vs the float64 complex oracle."""
    b, s, h, d, rd = 2, 3, 2, 14, 8  # 6 non-rope dims, rope on the last 8
    ang = random_angles(rng, b, s, 1, half=rd // 2)  # broadcast over heads
    cos, sin = ang.cos().float(), ang.sin().float()
    assert (cos[..., 0] - cos[..., 1]).abs().max() > 1e-2, rng.tag("precondition: pairs must differ")
    x = rng.randn(b, s, h, d).requires_grad_()
    check_against_oracle(rng, lambda t: ops.apply_rope(t, cos, sin, inverse=inverse),
                         lambda t: ref_rope(t, ang, inverse=inverse), [x], ["x"])


def test_apply_rope_inverse_undoes_forward_and_keeps_prefix(rng: Rng) -> None:
    """Guards inverse RoPE not being the conjugate rotation (attention outputs would carry a
    residual rotation) and any change to the non-rope prefix (must pass through bitwise)."""
    d, rd = 20, 12
    ang = random_angles(rng, 4, 7, half=rd // 2)
    cos, sin = ang.cos().float(), ang.sin().float()
    x = rng.randn(4, 7, d, dtype=torch.float32)
    y = ops.apply_rope(x, cos, sin)
    back = ops.apply_rope(y, cos, sin, inverse=True)
    assert_close(back, x, atol=1e-5, rtol=1e-5, msg=rng.tag("inverse(rope(x)) == x"))
    assert_equal(y[..., : d - rd], x[..., : d - rd], rng.tag("rope must not touch the prefix"))
    assert (y[..., d - rd:] - x[..., d - rd:]).abs().max() > 1e-2, rng.tag("rope must rotate the last dims")
    # Rotation preserves the norm of every pair.
    pair_norm = lambda t: t[..., d - rd:].unflatten(-1, (rd // 2, 2)).norm(dim=-1)  # noqa: E731
    assert_close(pair_norm(y), pair_norm(x), atol=1e-5, rtol=1e-5, msg=rng.tag("pair norms"))


def test_rope_inv_freq_plain_is_theta_power(rng: Rng) -> None:
    """Guards a wrong base frequency formula: without YaRN inv_freq[i] = theta^(-2i/d)
    (SWA layers use theta 10000 and no YaRN, DSV4.md section 3)."""
    random_case = (2 * int(rng.randint(2, 40)), float(rng.uniform(1, lo=1e3, hi=1e6)))
    for rope_dim, theta in ((64, 10000.0), (16, 160000.0), random_case):
        got = ops.rope_inv_freq(rope_dim, theta, None)
        assert got.dtype == torch.float32 and got.shape == (rope_dim // 2,)
        want = torch.tensor([theta ** (-2 * i / rope_dim) for i in range(rope_dim // 2)], dtype=F64)
        assert_close(got, want, atol=0, rtol=1e-6, msg=rng.tag(f"inv_freq d={rope_dim} theta={theta}"))


def test_rope_inv_freq_yarn_blends_only_low_frequencies(rng: Rng) -> None:
    """Guards YaRN applied wrongly (to all dims, to the high-frequency dims, inverted ramp, or
    with an mscale): the first (high-frequency) dims keep theta^(-2i/d), the last dims are
    divided by the factor, with a monotone ramp between (V4 compressed-layer settings, plus a
    fresh random factor)."""
    rope_dim, theta = 64, 160000.0
    factor = float(rng.uniform(1, lo=2.0, hi=64.0))
    for y in (YarnScaling(16.0, 65536, 32.0, 1.0), YarnScaling(factor, 65536, 32.0, 1.0)):
        got = ops.rope_inv_freq(rope_dim, theta, y).double()
        want, lo, hi = yarn_oracle(rope_dim, theta, y)
        plain = torch.tensor([theta ** (-2 * i / rope_dim) for i in range(rope_dim // 2)], dtype=F64)
        assert 1 <= lo < hi < rope_dim // 2 - 1, rng.tag(f"precondition: both regions non-empty ({lo}, {hi})")
        tag = rng.tag(f"yarn factor {y.factor}")
        assert_close(got[: lo + 1], plain[: lo + 1], atol=0, rtol=1e-6, msg=tag + " high-frequency dims unchanged")
        assert_close(got[int(math.ceil(hi)):], plain[int(math.ceil(hi)):] / y.factor, atol=0, rtol=1e-6,
                     msg=tag + " low-frequency dims divided by factor")
        ratio = got / plain
        assert (ratio[1:] <= ratio[:-1] * (1 + 1e-6)).all(), tag + " ramp must be monotone"
        assert_close(got, want, atol=0, rtol=1e-6, msg=tag + " full blend")
    # factor 1 is a no-op, and the tiny preset's YaRN (rope dim 16) still keeps dim 0.
    assert_close(ops.rope_inv_freq(rope_dim, theta, YarnScaling(1.0, 65536, 32.0, 1.0)).double(),
                 yarn_oracle(rope_dim, theta, YarnScaling(1.0, 65536, 32.0, 1.0))[0], atol=0, rtol=1e-6,
                 msg=rng.tag("factor 1"))
    tiny = DeepSeekV4Config.tiny()
    got = ops.rope_inv_freq(tiny.qk_rope_head_dim, tiny.compress_rope_theta, tiny.rope_scaling).double()
    want = yarn_oracle(tiny.qk_rope_head_dim, tiny.compress_rope_theta, tiny.rope_scaling)[0]
    assert_close(got, want, atol=0, rtol=1e-6, msg=rng.tag("tiny preset yarn"))


@pytest.mark.parametrize("piece", [4, ops.ADD_ROWS_PIECE])
@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_embedding_adds_each_ids_rows_into_main_grad_once(rng: Rng, dev: str, piece: int, monkeypatch) -> None:
    """ops.embedding: the forward is weight[ids]; with a main_grad (the trainer) the weight
    gradient is added into it (float64's index_add to fp32 rounding, rows of absent ids keep
    their bits, the same bits again on a second run) and weight.grad stays None; without one,
    F.embedding's gradient bit for bit. ids repeat (one id 20 times in a run, others
    scattered) as a batch's common tokens do; in pieces of 4 rows too (runs of several pieces).
    On CUDA too (the GPU suite): its index_add_ adds atomically."""
    monkeypatch.setattr(ops, "ADD_ROWS_PIECE", piece)
    v, d = 37, 24
    ids = torch.cat((rng.randint(0, 9, 30), torch.full((20,), 11), rng.randint(0, v - 5, 30))).reshape(2, 40)
    w0 = rng.randn(v, d, dtype=torch.bfloat16)
    g = rng.randn(2, 40, d, dtype=torch.bfloat16)
    base = rng.randn(v, d, dtype=torch.float32)
    ref = base.double().index_add(0, ids.flatten(), g.reshape(-1, d).double())
    ids, w0, g, base, ref = (t.to(dev) for t in (ids, w0, g, base, ref))
    absent = torch.ones(v, dtype=torch.bool, device=dev)
    absent[ids.flatten()] = False
    assert absent.any(), rng.tag("some rows must stay untouched for the test to check them")
    mains = []
    for _ in range(2):
        w = w0.clone().requires_grad_()
        w.main_grad = base.clone()
        out = ops.embedding(ids, w)
        assert_equal(out.detach(), w0[ids], rng.tag("forward"))
        out.backward(g)
        assert w.grad is None, rng.tag("the gradient went to main_grad")
        assert_close(w.main_grad, ref.float(), atol=1e-5, rtol=1e-6, msg=rng.tag("main_grad"))
        assert_equal(w.main_grad[absent], base[absent], rng.tag("rows of absent ids"))
        mains.append(w.main_grad)
    assert_equal(mains[1], mains[0], rng.tag("a second run"))
    w, w_ref = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    ops.embedding(ids, w).backward(g)
    F.embedding(ids, w_ref).backward(g)
    assert_equal(w.grad, w_ref.grad, rng.tag("without main_grad: F.embedding's gradient"))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("op", ["linear", "fp32_linear", "unrope_out_proj"])
@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_projections_add_their_weight_gradient_into_main_grad(rng: Rng, dev: str, op: str, recompute: bool) -> None:
    """ops.linear (the replicated projections: wq_a, wkv, the indexer's, MTP's e/h_proj),
    ops.fp32_linear (compressors, the router's gate) and ops.unrope_out_proj (wo_a), bf16, on a
    weight with a main_grad (the trainer): over two micro-batches each weight gradient is added
    into it summed in fp32 (float64's sums to 1e-5; a gradient rounded to bf16 before its add,
    as DDP's hook added them, is ~1e-3 off), weight.grad stays None and the weight is announced
    once a backward (main_grad_ready); the input gradient is bit for bit the one without a
    main_grad, where the weight gradient comes back in the weight's dtype as before. Under
    recompute too (torch's non-reentrant checkpoint, as config.recompute runs a block: the
    backward's saved weight is a detached copy without main_grad; planted, a lookup there
    returns a bf16 w.grad). On CUDA where GPUs are visible: the GEMMs add in their epilogue."""
    b, s, d, n, h, hd, groups = 2, 9, 24, 40, 4, 6, 2
    ang = random_angles(rng, b, s, 1, half=2)
    cos, sin = ang.cos().float().to(dev), ang.sin().float().to(dev)
    if op == "unrope_out_proj":
        xs = [rng.randn(b, s, h, hd, dtype=torch.bfloat16) for _ in range(2)]
        w0 = rng.randn(groups * 5, h * hd // groups, dtype=torch.bfloat16)
        fn = lambda x, w: ops.unrope_out_proj(x, cos, sin, w, groups)  # noqa: E731

        def wgrad64(x, g):  # the rotated o the backward multiplies (bf16, as the op's), in float64
            og = ops.apply_rope(x, cos, sin, inverse=True).double().reshape(b * s, groups, -1)
            gg = g.double().reshape(b * s, groups, -1)
            return torch.einsum("tgr,tgk->grk", gg, og).reshape(w0.shape)
    else:
        xs = [rng.randn(b, s, d, dtype=torch.bfloat16) for _ in range(2)]
        w0 = rng.randn(n, d, dtype=torch.bfloat16) * d ** -0.5
        fn = ops.linear if op == "linear" else (lambda x, w: ops.fp32_linear(x, w, dev == "cuda"))  # noqa: E731

        def wgrad64(x, g):
            return g.double().reshape(-1, n).t() @ x.double().reshape(-1, d)
    xs, w0 = [x.to(dev) for x in xs], w0.to(dev)
    gs = [rng.randn(*fn(xs[0], w0).shape, dtype=torch.float32).to(dev).to(fn(xs[0], w0).dtype) for _ in xs]
    base = rng.randn(*w0.shape, dtype=torch.float32).to(dev)
    w = w0.clone().requires_grad_()
    w.main_grad, announced = base.clone(), []
    w.main_grad_ready = lambda: announced.append(1)
    plain = w0.clone().requires_grad_()
    want = base.double()
    run = fn
    if recompute:
        def run(x, w):
            return torch.utils.checkpoint.checkpoint(lambda y: fn(y, w), x, use_reentrant=False)
    for i, (x, g) in enumerate(zip(xs, gs, strict=True)):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        run(xa, w).backward(g)
        assert w.grad is None, rng.tag(f"{op}: the weight gradient went to main_grad")
        assert len(announced) == i + 1, rng.tag(f"{op}: the weight announced once a backward")
        fn(xb, plain).backward(g)
        assert_equal(xa.grad, xb.grad, rng.tag(f"{op}: the input gradient as without main_grad"))
        want = want + wgrad64(x, g)
    assert_close(w.main_grad, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5, msg=rng.tag(f"{op} main_grad"))
    assert plain.grad.dtype == w0.dtype, rng.tag(f"{op}: without main_grad the gradient in the weight's dtype")
    assert_close(plain.grad, want - base.double(), atol=1e-2 * want.abs().max().item(), rtol=1e-2,
                 msg=rng.tag(f"{op}: without main_grad"))


def test_rope_cos_sin_matches_angles(rng: Rng) -> None:
    """Guards cos/sin computed at the wrong positions/frequencies or in low precision (angles
    pos*inv_freq must be formed in float64: positions reach 1M)."""
    inv = rng.uniform(8, lo=1e-5, hi=1.0, dtype=torch.float32)
    pos = rng.randint(0, 1_048_576, 3, 5)
    cos, sin = ops.rope_cos_sin(pos, inv)
    ang = pos.to(F64)[..., None] * inv.double()
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (3, 5, 8)
    assert_close(cos, ang.cos(), atol=1e-6, rtol=0, msg=rng.tag("cos"))
    assert_close(sin, ang.sin(), atol=1e-6, rtol=0, msg=rng.tag("sin"))


# ----------------------------------------------------------------------------------------------------------
# Hadamard


def test_hadamard_is_orthonormal_sylvester(rng: Rng) -> None:
    """Guards a non-orthonormal or non-Sylvester rotation (indexer q/k would be rescaled or
    permuted) and a cached matrix that a caller's in-place edit could corrupt."""
    for n in (1, 2, 8, 64, 128):
        h = ops.hadamard(torch.eye(n, dtype=torch.float32))  # rows of I @ H = H
        assert_close(h, sylvester_hadamard(n), atol=1e-7, rtol=0, msg=rng.tag(f"Sylvester n={n}"))
        assert_close(h.double() @ h.double().T, torch.eye(n, dtype=F64), atol=1e-6, rtol=0,
                     msg=rng.tag(f"H H^T = I n={n}"))
        h.mul_(3.0)  # a caller mutating the result must not reach the cached matrix
        assert_close(ops.hadamard(torch.eye(n)), sylvester_hadamard(n), atol=1e-7, rtol=0,
                     msg=rng.tag(f"cache intact n={n}"))
    x = rng.randn(3, 5, 16, dtype=torch.float32)
    assert_close(ops.hadamard(ops.hadamard(x)), x, atol=1e-5, rtol=1e-5, msg=rng.tag("H is an involution"))
    assert_close(ops.hadamard(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5, msg=rng.tag("norm kept"))
    with pytest.raises(ValueError, match="power of two"):
        ops.hadamard(torch.ones(2, 12))


def test_hadamard_grads(rng: Rng) -> None:
    """Guards a wrong Hadamard backward (fp32-internal op: gradient vs x @ H in float64)."""
    x = rng.randn(2, 3, 16).requires_grad_()
    h = sylvester_hadamard(16)
    check_against_oracle(rng, ops.hadamard, lambda t: t @ h, [x], ["x"])


# ----------------------------------------------------------------------------------------------------------
# mHC


def test_sinkhorn_matches_oracle_and_is_doubly_stochastic(rng: Rng) -> None:
    """Guards a wrong Sinkhorn schedule (no softmax + eps start, wrong order of row/column
    steps, wrong iteration count) and its backward; after 20 steps columns sum to 1 (last step)
    and rows to ~1. fp32-internal op: gradient vs float64 oracle."""
    logits = rng.randn(3, 5, 4, 4).requires_grad_()
    check_against_oracle(rng, lambda t: ops.sinkhorn(t, 20, 1e-6), lambda t: ref_sinkhorn(t, 20, 1e-6),
                         [logits], ["logits"])
    m = ops.sinkhorn(logits.detach(), 20, 1e-6)
    assert_finite(m, rng.tag("sinkhorn"))
    assert (m > 0).all(), rng.tag("entries positive (softmax + eps)")
    ones = torch.ones(3, 5, 4, dtype=F64)
    assert_close(m.sum(-2), ones, atol=1e-5, rtol=0, msg=rng.tag("column sums"))
    # 20 steps on std-1 logits leave rows within 8e-3 of 1 in the worst of 2M draws (measured;
    # typically < 1e-3), so 2e-2 cannot flake, yet a schedule that skips row steps fails it.
    assert_close(m.sum(-1), ones, atol=2e-2, rtol=0, msg=rng.tag("row sums"))
    m1 = ops.sinkhorn(logits.detach(), 1, 1e-6)  # one step = softmax + eps then column-normalise
    sm = torch.softmax(logits.detach(), -1) + 1e-6
    assert_close(m1, sm / (sm.sum(-2, keepdim=True) + 1e-6), atol=1e-6, rtol=1e-5, msg=rng.tag("iters=1"))


def _hc_inputs(rng: Rng, b: int, s: int, n: int, d: int):
    m = n * (n + 2)
    x = rng.randn(b, s, n, d)
    fn = rng.randn(m, n * d, std=1 / math.sqrt(n * d))
    base = rng.randn(m, std=0.5)
    scale = rng.uniform(3, lo=0.5, hi=1.5)
    return x, fn, base, scale


def test_hc_pre_matches_oracle_and_grads(rng: Rng) -> None:
    """Guards wrong mHC pre-mixing: mixes normalisation, the three weight groups (pre, post,
    comb) and their scales/bases, and the gradients of all three outputs wrt x, fn, base, scale.
    fp32-internal op (DSV4.md: mHC in fp32): gradients vs float64 oracle."""
    x, fn, base, scale = (t.requires_grad_() for t in _hc_inputs(rng, 2, 3, 4, 6))
    check_against_oracle(rng, lambda *a: ops.hc_pre(*a, 1e-6, 1e-6, 20), lambda *a: ref_hc_pre(*a, 1e-6, 1e-6, 20),
                         [x, fn, base, scale], ["x", "fn", "base", "scale"], rel=2e-5)


def test_hc_pre_weights_are_sigmoid_plus_eps_and_post_times_two(rng: Rng) -> None:
    """Guards a missing '+ eps' on the pre weights, a missing factor 2 on post (post in (0, 2)),
    and swapped weight groups: with one-hot streams u reveals pre_i directly."""
    n, d, hc_eps = 4, 7, 0.1  # a large eps makes its presence visible in fp32
    amp = rng.uniform(2, 3, n, lo=0.5, hi=2.0)
    x = torch.zeros(2, 3, n, d, dtype=F64)  # stream i is one-hot in coordinate i
    for i in range(n):
        x[..., i, i] = amp[..., i]
    _, fn, base, scale = _hc_inputs(rng, 2, 3, n, d)
    base[0] = -300.0  # sigmoid = 0 exactly: pre_0 must be eps alone
    base[n] = 12.0  # post_0 -> ~2
    base[n + 1] = -12.0  # post_1 -> ~0
    u, post, comb = ops.hc_pre(x, fn, base, scale, 1e-6, hc_eps, 20)
    mix = ref_mixes(x, fn, 1e-6)
    pre_want = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    assert_close(u[..., :n] / amp, pre_want, atol=1e-6, rtol=1e-5, msg=rng.tag("pre = sigmoid(.) + eps"))
    assert_close(u[..., 0] / amp[..., 0], torch.full((2, 3), hc_eps, dtype=F64), atol=1e-7, rtol=0,
                 msg=rng.tag("saturated pre is exactly eps"))
    assert_equal(u[..., n:], torch.zeros(2, 3, d - n, dtype=F64), rng.tag("u only mixes the streams"))
    post_want = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    assert_close(post, post_want, atol=1e-6, rtol=1e-5, msg=rng.tag("post = 2 sigmoid(.)"))
    # fp32 sigmoid is 1.0 exactly past ~16.6: post reaches 2 itself
    assert ((post > 0) & (post <= 2)).all() and post[..., 0].min() > 1.9, rng.tag("post in (0, 2], reaches ~2")
    assert post.dtype == comb.dtype == torch.float32, rng.tag("post/comb stay fp32")
    assert_close(comb.sum(-2), torch.ones(2, 3, n, dtype=F64), atol=0.25, rtol=0,
                 msg=rng.tag("comb columns ~1 (eps 0.1)"))


def test_hc_post_uses_comb_transposed(rng: Rng) -> None:
    """Guards the comb orientation bug that shipped in two frameworks: X'_j = post_j F +
    sum_i comb[i, j] X_i (comb TRANSPOSED), checked against an explicit loop with a deliberately
    non-symmetric comb; plus gradients wrt f, x, post, comb (fp32-internal op: vs float64 oracle)."""
    b, s, n, d = 2, 3, 4, 5
    f = rng.randn(b, s, d).requires_grad_()
    x = rng.randn(b, s, n, d).requires_grad_()
    # post and comb come from hc_pre in fp32 (DSV4.md: mHC weights stay fp32)
    post = (2 * torch.sigmoid(rng.randn(b, s, n))).float().requires_grad_()  # in (0, 2)
    comb = rng.uniform(b, s, n, n, lo=0.0, hi=1.0)
    comb[..., 0, 1] += 1.0  # strongly non-symmetric
    comb = comb.float().requires_grad_()
    assert (comb - comb.transpose(-1, -2)).abs().max() > 0.5, rng.tag("precondition: comb non-symmetric")
    check_against_oracle(rng, ops.hc_post, ref_hc_post, [f, x, post, comb], ["f", "x", "post", "comb"])
    out = ops.hc_post(f.detach(), x.detach(), post.detach(), comb.detach())
    wrong = ref_hc_post(f.detach(), x.detach(), post.detach().double(), comb.detach().double().transpose(-1, -2))
    assert (out.double() - wrong).abs().max() > 1e-2, rng.tag("precondition: orientation must matter")


@pytest.mark.parametrize("hc_eps", [1e-6, 0.1])
def test_hc_head_matches_oracle_and_grads(rng: Rng, hc_eps: float) -> None:
    """Guards a wrong head collapse (sigmoid(mix*scale + base) + eps weights, no Sinkhorn) and its
    gradients wrt x, fn, base, scale; a large eps makes a missing '+ eps' visible in fp32.
    fp32-internal op: vs float64 oracle."""
    b, s, n, d = 2, 3, 4, 6
    x = rng.randn(b, s, n, d).requires_grad_()
    fn = rng.randn(n, n * d, std=1 / math.sqrt(n * d)).requires_grad_()
    base = rng.randn(n, std=0.5).requires_grad_()
    scale = rng.uniform(1, lo=0.5, hi=1.5).requires_grad_()
    check_against_oracle(rng, lambda *a: ops.hc_head(*a, 1e-6, hc_eps), lambda *a: ref_hc_head(*a, 1e-6, hc_eps),
                         [x, fn, base, scale], ["x", "fn", "base", "scale"])


# ----------------------------------------------------------------------------------------------------------
# compressor pooling


def test_compress_pool_matches_oracle_with_absent_slots(rng: Rng) -> None:
    """Guards the gated pooling (softmax over slots per channel) and its gradients, including
    slots with a -inf gate logit (block 0's absent 'previous' half in CSA, DSV4.md section 3):
    they must get exactly zero weight and exactly zero, finite gradients. fp32-internal op."""
    b, g, slots, d = 2, 3, 8, 5
    c = rng.randn(b, g, slots, d)
    z = rng.randn(b, g, slots, d)
    z[0, 0, :4] = float("-inf")  # CSA block 0: previous half absent
    z[1, 2, 3, 1] = float("-inf")  # a single absent slot in one channel
    c.requires_grad_()
    z.requires_grad_()
    (gc, gz), _ = check_against_oracle(rng, ops.compress_pool, ref_compress_pool, [c, z], ["c", "z"])
    absent = torch.isinf(z.detach())
    assert_equal(gc[absent], torch.zeros(int(absent.sum()), dtype=F64), rng.tag("grad c at absent slot"))
    assert_equal(gz[absent], torch.zeros(int(absent.sum()), dtype=F64), rng.tag("grad z at absent slot"))
    out = ops.compress_pool(c.detach(), z.detach())
    assert out.dtype == torch.float32, rng.tag("pooled entries are fp32")
    # Block 0 with the previous half absent pools only its own tokens.
    assert_close(out[0, 0], ref_compress_pool(c.detach()[0, 0, 4:], z.detach()[0, 0, 4:]), atol=1e-6,
                 rtol=1e-5, msg=rng.tag("absent half ignored"))


# ----------------------------------------------------------------------------------------------------------
# sparse attention


def _attention_inputs(rng: Rng, dtype=F64):
    b, s, t, h, d = 2, 5, 7, 3, 6
    q = rng.randn(b, s, h, d, dtype=dtype)
    kv = rng.randn(b, t, d, dtype=dtype)
    sink = rng.randn(h, dtype=torch.float32)
    mask = rng.bern(0.5, b, s, t)
    mask.scatter_(-1, rng.randint(0, t, b, s, 1), True)  # every row non-empty ...
    mask[0, 1] = False  # ... except exactly these two  # fully empty rows
    mask[1, 4] = False
    mask[1, 0] = True  # and a full one
    return q, kv, mask, sink, d ** -0.5


def test_sparse_attention_matches_loop_oracle_and_grads(rng: Rng) -> None:
    """Guards the attention core: sink in the denominator only, masking, 1/sqrt(D) scale, MQA
    with K = V, probs layout [B, H, S, T]; gradients wrt q, kv and sink (sink is fp32 and the op
    computes in fp32, so: vs an explicit float64 per-query loop). Includes fully empty rows."""
    q, kv, mask, sink, scale = _attention_inputs(rng)
    sink.requires_grad_()  # attn_sink is an fp32 parameter
    q.requires_grad_()
    kv.requires_grad_()
    check_against_oracle(rng, lambda a, b_, c: ops.sparse_attention(a, b_, mask, c, scale)[0],
                         lambda a, b_, c: ref_sparse_attention(a, b_, mask, c, scale)[0],
                         [q, kv, sink], ["q", "kv", "sink"])
    o, probs = ops.sparse_attention(q.detach(), kv.detach(), mask, sink.detach(), scale, return_probs=True)
    _, probs_ref = ref_sparse_attention(q.detach(), kv.detach(), mask, sink.detach(), scale)
    assert probs.shape == (2, 3, 5, 7) and probs.dtype == torch.float32
    assert_close(probs, probs_ref, atol=1e-6, rtol=1e-5, msg=rng.tag("probs"))
    assert_equal(probs.masked_select(~mask[:, None].expand_as(probs)),
                 torch.zeros(int((~mask[:, None].expand_as(probs)).sum())), rng.tag("masked probs exactly 0"))
    sink_p = torch.sigmoid(sink.detach().view(1, 3, 1).float() - torch.logsumexp(
        torch.einsum("bshd,btd->bhst", q.detach(), kv.detach()).float().mul(scale)
        .masked_fill(~mask[:, None], float("-inf")), -1))
    assert_close(probs.sum(-1) + sink_p, torch.ones(2, 3, 5), atol=1e-5, rtol=0,
                 msg=rng.tag("key probs + sink prob = 1"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_empty_row_is_zero_with_finite_grads(rng: Rng, dtype: torch.dtype) -> None:
    """Guards NaN from fully masked rows (max = -inf, DSV4.md pitfall 1): such a row's output is
    exactly zero, its probs are zero, and all gradients (q, kv, sink) are finite; the empty
    row's q gradient is exactly zero."""
    q, kv, mask, sink, scale = _attention_inputs(rng, dtype=dtype)
    q.requires_grad_()
    kv.requires_grad_()
    sink.requires_grad_()
    with torch.autograd.detect_anomaly():
        o, probs = ops.sparse_attention(q, kv, mask, sink, scale, return_probs=True)
        (o.float() * rng.randn(*o.shape, dtype=torch.float32)).sum().backward()
    empty = ~mask.any(-1)
    assert empty.sum() == 2, rng.tag("precondition: two empty rows")
    assert_finite(o.float(), rng.tag("o"))
    assert_equal(o[empty], torch.zeros_like(o[empty]), rng.tag("empty row output exactly zero"))
    assert_equal(probs.permute(0, 2, 1, 3)[empty], torch.zeros(2, 3, 7), rng.tag("empty row probs zero"))
    for name, t in (("q", q), ("kv", kv), ("sink", sink)):
        assert t.grad is not None and t.grad.dtype == t.dtype, rng.tag(f"grad {name}")
        assert_finite(t.grad.float(), rng.tag(f"grad {name}"))
    assert_equal(q.grad[empty], torch.zeros_like(q.grad[empty]), rng.tag("empty row q grad"))
    assert q.grad[~empty].abs().max() > 0, rng.tag("non-empty rows do get gradient")


# ----------------------------------------------------------------------------------------------------------
# indexer


def test_indexer_scores_matches_oracle_and_grads(rng: Rng) -> None:
    """Guards the lightning-indexer score sum_h w_h relu(q_h . k_g) (relu per head before the
    weighted sum, not after) and its gradients. fp32-internal op: vs float64 oracle; q is redrawn
    until no dot product sits within 1e-3 of the relu kink."""
    b, s, h, d, g = 2, 7, 3, 8, 5
    k = rng.randn(b, g, d)
    for _ in range(100):
        q = rng.randn(b, s, h, d)
        if torch.einsum("bshd,bgd->bshg", q, k).abs().min() > 1e-3:
            break
    else:
        raise AssertionError(rng.tag("could not draw q away from the relu kink"))
    w = rng.randn(b, s, h)
    dots = torch.einsum("bshd,bgd->bshg", q, k)
    assert (dots > 0).any() and (dots < 0).any(), rng.tag("precondition: relu must be active and inactive")
    for chunk in (ops.INDEXER_CHUNK_ELEMENTS, b * h * g * 3, 1):  # one chunk; 3 rows (uneven); 1 row
        check_against_oracle(rng, lambda *a, c=chunk: ops.indexer_scores(*a, chunk_elements=c), ref_indexer_scores,
                             [q.requires_grad_(), k.requires_grad_(), w.requires_grad_()], ["q", "k", "w"])


def test_indexer_scores_bounded_by_visibility(rng: Rng) -> None:
    """Guards the scores' bound: SequenceLayout.entry_bound over packed documents and padding is
    the count of complete blocks ending at or before each query, so no visible entry lies at or
    past it, and it is one past the last visible entry wherever the query's document has one;
    scores under it are the unbounded scores below it and exactly 0 past it, with no gradient
    through the entries past it."""
    b, s, h, d, r = 2, 23, 3, 8, 3
    doc_ids = torch.tensor([[0] * 10 + [1] * 8 + [-1] * 5, [4] * 4 + [5] * 19])
    layout = SequenceLayout.build(b, s, torch.device("cpu"), doc_ids=doc_ids)
    blocks = layout.blocks(r)
    g = blocks.count
    visible = layout.visible(blocks)  # [B, S, G]
    hi = layout.entry_bound(blocks)
    want = torch.tensor([[int(((blocks.end[i] <= p) & blocks.valid[i]).sum()) for p in range(s)] for i in range(b)])
    assert hi.dtype == torch.int32 and hi.shape == (b, s)
    assert_equal(hi, want.to(torch.int32), rng.tag("bound = complete blocks ending at or before the query"))
    seen = torch.arange(g) < hi[..., None]
    assert not (visible & ~seen).any(), rng.tag("a visible entry at or past the bound")
    last = torch.where(visible, torch.arange(1, g + 1), 0).amax(-1)
    has = visible.any(-1)
    assert has.any() and (~has & (hi > 0)).any(), rng.tag("precondition: rows with and without visible entries")
    assert_equal(hi[has], last[has].to(torch.int32), rng.tag("tight where the document has an entry"))
    q, k, w = rng.randn(b, s, h, d), rng.randn(b, g, d), rng.randn(b, s, h)
    cot = rng.randn(b, s, g)
    outs = []
    for bound in (None, hi):
        ins = [t.clone().requires_grad_() for t in (q, k, w)]
        out = ops.indexer_scores(*ins, bound)
        (out * (cot * seen)).sum().backward()
        outs.append((out.detach(), [t.grad for t in ins]))
    (full, full_grads), (got, grads) = outs
    assert_finite(got, rng.tag("bounded scores"))
    assert_equal(got, torch.where(seen, full, 0.0), rng.tag("bounded = unbounded below the bound, 0 past"))
    for a, e, name in zip(grads, full_grads, "qkw", strict=True):
        assert_equal(a, e, rng.tag(f"d{name}: only the entries below the bound"))
    ins = [t.clone().requires_grad_() for t in (q, k, w)]
    (ops.indexer_scores(*ins, hi) * ~seen).sum().backward()
    assert not any(t.grad.any() for t in ins), rng.tag("no gradient through entries past the bound")


def test_topk_select_picks_largest_visible(rng: Rng) -> None:
    """Guards top-k selecting an invisible (future) block, missing a larger visible one, or
    returning more than k; against a sort-based oracle on fresh scores."""
    b, s, g = 3, 6, 11
    scores = rng.randn(b, s, g, dtype=torch.float32)
    visible = rng.bern(0.6, b, s, g)
    visible[0, 0] = False  # a row with nothing visible (p < r)
    visible[1, 2] = True  # a row with everything visible (k >= G must take all)
    scores = torch.where(visible, scores, scores + 10.0)  # invisible entries score highest
    for k in (1, 3, g, g + 4):
        got = ops.topk_select(scores, visible, k)
        assert got.dtype == torch.bool and got.shape == (b, s, g)
        assert_equal(got, ref_topk(scores, visible, k), rng.tag(f"top-{k} set"))
        assert not (got & ~visible).any(), rng.tag(f"top-{k} picked an invisible entry")
        assert_equal(got.sum(-1), visible.sum(-1).clamp(max=k), rng.tag(f"top-{k} count = min(k, visible)"))
    assert_equal(ops.topk_select(scores, visible, g + 4), visible, rng.tag("k > visible selects exactly visible"))
    assert not ops.topk_select(scores, visible, 0).any(), rng.tag("k = 0 selects nothing")


def test_topk_select_ties_go_to_lower_index(rng: Rng) -> None:
    """Guards nondeterministic tie-breaking (full forward and token-by-token decode would pick
    different blocks): equal scores resolve to the lower index."""
    assert_equal(ops.topk_select(torch.ones(1, 1, 6), torch.ones(1, 1, 6, dtype=torch.bool), 2),
                 torch.tensor([[[True, True, False, False, False, False]]]), "all tied -> first two")
    vis = torch.tensor([[[False, True, True, True, True, True]]])
    assert_equal(ops.topk_select(torch.tensor([[[9.0, 1.0, 2.0, 1.0, 2.0, 1.0]]]), vis, 3),
                 torch.tensor([[[False, True, True, False, True, False]]]), "ties among equals -> lower index")
    scores = rng.randint(0, 3, 4, 5, 16).float()  # many ties
    visible = rng.bern(0.7, 4, 5, 16)
    for k in (1, 2, 5, 9):
        assert_equal(ops.topk_select(scores, visible, k), ref_topk(scores, visible, k), rng.tag(f"ties top-{k}"))


def test_indexer_causality_rows_before_first_block(rng: Rng) -> None:
    """Guards pitfall 1 on the indexer path: compressed block g is visible to query p iff
    g < floor((p+1)/r), so rows p < r-1 see no block; top-k picks nothing there and attention
    over the picked blocks alone gives zeros with finite gradients, never NaN."""
    r, seq, d = 4, 13, 8
    layout = SequenceLayout.build(1, seq, torch.device("cpu"))
    blocks = layout.blocks(r)
    visible = layout.visible(blocks)
    want = torch.tensor([[g < (p + 1) // r for g in range(blocks.count)] for p in range(seq)])
    assert blocks.count == seq // r
    assert_equal(visible[0], want, rng.tag("visibility g < floor((p+1)/r)"))
    scores = rng.randn(1, seq, blocks.count, dtype=torch.float32)
    chosen = ops.topk_select(scores, visible, 2)
    assert not chosen[0, : r - 1].any(), rng.tag("rows before the first complete block pick nothing")
    q = rng.randn(1, seq, 2, d, dtype=torch.float32).requires_grad_()
    entries = rng.randn(1, blocks.count, d, dtype=torch.float32).requires_grad_()
    with torch.autograd.detect_anomaly():
        o, _ = ops.sparse_attention(q, entries, chosen, torch.zeros(2), d ** -0.5)
        o.sum().backward()
    assert_equal(o[0, : r - 1], torch.zeros(r - 1, 2, d), rng.tag("no visible block -> zeros"))
    assert_finite(q.grad, rng.tag("q grad"))
    assert_finite(entries.grad, rng.tag("entries grad"))


# ----------------------------------------------------------------------------------------------------------
# MoE pieces


def test_sqrtsoftplus_matches_oracle_and_grads(rng: Rng) -> None:
    """Guards the router score s = sqrt(softplus(logits)) (not sigmoid/softmax) and its gradient.
    fp32-internal op: vs float64 oracle."""
    x = rng.uniform(4, 9, lo=-12.0, hi=12.0).requires_grad_()
    check_against_oracle(rng, ops.sqrtsoftplus, lambda t: torch.sqrt(torch.log1p(torch.exp(t))), [x], ["logits"])
    assert ops.sqrtsoftplus(x.detach().to(torch.bfloat16)).dtype == torch.float32, "router scores stay fp32"


def test_clamped_swiglu_matches_oracle_and_zero_grad_beyond_limit(rng: Rng) -> None:
    """Guards the V4 expert clamp: silu(min(g, 10)) * clamp(u, -10, 10) (g clamped from above only,
    u on both sides) and its gradient, which is exactly zero where the input is beyond the limit.
    Inputs kept >= 0.1 away from the clamp kinks. fp32-internal op: vs float64 oracle."""
    limit = 10.0

    def away_from_kinks(t: torch.Tensor) -> torch.Tensor:
        for kink in (limit, -limit):
            near = (t - kink).abs() < 0.1
            t = torch.where(near, t + 0.25, t)
        return t

    g = away_from_kinks(rng.uniform(6, 10, lo=-16.0, hi=16.0))
    u = away_from_kinks(rng.uniform(6, 10, lo=-16.0, hi=16.0))
    g[0, :3] = torch.tensor([10.5, 13.0, -14.0])  # make sure every region is populated
    u[0, :3] = torch.tensor([11.0, -12.0, 3.0])
    (gg, gu), _ = check_against_oracle(rng, lambda a, b: ops.clamped_swiglu(a, b, limit),
                                       lambda a, b: ref_clamped_swiglu(a, b, limit),
                                       [g.requires_grad_(), u.requires_grad_()], ["g", "u"])
    g, u = g.detach(), u.detach()
    assert_equal(gg[g > limit], torch.zeros(int((g > limit).sum()), dtype=F64), rng.tag("no grad for g > limit"))
    assert_equal(gu[u.abs() > limit], torch.zeros(int((u.abs() > limit).sum()), dtype=F64),
                 rng.tag("no grad for |u| > limit"))
    assert (gg[g < -limit] != 0).all(), rng.tag("g is not clamped from below (silu tail keeps a gradient)")
    out = ops.clamped_swiglu(g, u, limit)
    assert_close(out, F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit), atol=1e-5, rtol=1e-5,
                 msg=rng.tag("silu(min(g,10)) * clamp(u,-10,10)"))


def test_grouped_out_proj_gradcheck_and_oracle(rng: Rng) -> None:
    """Guards the grouped low-rank output projection (group g uses rows g*R..(g+1)*R of wo_a and
    the g-th slice of the flattened heads). This op keeps its input dtype, so a true float64
    gradcheck runs on it directly (under anomaly mode)."""
    b, s, h, d, groups, r = 2, 3, 4, 3, 2, 5
    o = rng.randn(b, s, h, d).requires_grad_()
    wo_a = rng.randn(groups * r, h * d // groups).requires_grad_()
    out = ops.grouped_out_proj(o, wo_a, groups)
    assert out.dtype == F64 and out.shape == (b, s, groups * r)
    assert_close(out, ref_grouped_out_proj(o, wo_a, groups), atol=1e-12, rtol=1e-12, msg=rng.tag("forward"))
    with torch.autograd.detect_anomaly():
        assert torch.autograd.gradcheck(lambda a, w: ops.grouped_out_proj(a, w, groups), (o, wo_a)), \
            rng.tag("gradcheck")


def test_unrope_out_proj_matches_the_rotation_then_the_projection(rng: Rng) -> None:
    """Guards the attention output's way out (inverse RoPE, then the grouped projection) as one
    function that keeps o and rotates it again in its backward: output and gradients of o and
    wo_a against the float64 complex-rotation oracle composed with the grouped projection (a
    backward rotating the wrong way, or using o unrotated for wo_a's gradient, is off by O(1))."""
    b, s, h, d, rd, groups, r = 2, 3, 4, 6, 4, 2, 5
    ang = random_angles(rng, b, s, 1, half=rd // 2)  # broadcast over heads
    cos, sin = ang.cos().float(), ang.sin().float()
    o = rng.randn(b, s, h, d).requires_grad_()
    wo_a = rng.randn(groups * r, h * d // groups).requires_grad_()
    check_against_oracle(rng, lambda a, w: ops.unrope_out_proj(a, cos, sin, w, groups),
                         lambda a, w: ref_grouped_out_proj(ref_rope(a, ang, inverse=True), w, groups),
                         [o, wo_a], ["o", "wo_a"])


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_unrope_out_proj_puts_o_back_as_it_was(rng: Rng, dev: str, fused: bool, strided: bool) -> None:
    """Guards o's RoPE columns rotated in place for the projection's GEMMs and put back after
    (ops._unroped): o, which the attention core keeps for its own backward, holds its bits after
    the forward and after the backward; an op upstream that kept o (exp keeps its output)
    takes its gradient from those bits without autograd's version check tripping; and output
    and gradients equal the rotated copy's composition. Planted, once each: no put-back (o's
    rope columns stay rotated, the upstream gradient off by O(1)); the put-back through o, not
    o.data (the version check trips). fused: the rope kernel (Triton's interpreter on CPU).
    strided: o a transposed view (no in-place kernel for it: a rotated copy, o untouched)."""
    if fused:
        pytest.importorskip("triton")
        if dev == "cpu" and torch.cuda.is_available():
            pytest.skip("a GPU is visible: Triton compiles for it, no interpreter for CPU tensors")
    b, s, h, d, rd, groups, r = 2, 5, 4, 10, 4, 2, 3
    ang = random_angles(rng, b, s, 1, half=rd // 2)
    cos, sin = ang.cos().float().to(dev), ang.sin().float().to(dev)
    a = rng.randn(b, s, h, d, std=0.5, dtype=torch.float32).to(dev)
    w0 = rng.randn(groups * r, h * d // groups, dtype=torch.float32).to(dev)
    cot = rng.randn(b, s, groups * r, dtype=torch.float32).to(dev)
    grads, outs = [], []
    for way in ("in place", "rotated copy"):
        x, w = a.clone().requires_grad_(), w0.clone().requires_grad_()
        o = torch.exp(x)  # keeps o for its backward
        if strided:  # the same values as a [B, S, H, D] view of a [B, S, D, H] tensor
            o = torch.exp(x.transpose(-1, -2).contiguous()).transpose(-1, -2)
            assert not o.is_contiguous()
        bits = o.detach().clone()
        if way == "in place":
            y = ops.unrope_out_proj(o, cos, sin, w, groups, fused)
            assert_equal(o.detach(), bits, rng.tag("o after the forward"))
        else:
            y = ops.grouped_out_proj(ops.apply_rope(o, cos, sin, inverse=True, fused=fused), w, groups)
        (y * cot).sum().backward()
        assert_equal(o.detach(), bits, rng.tag(f"{way}: o after the backward"))
        outs.append(y.detach())
        grads.append((x.grad, w.grad))
    assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5, msg=rng.tag("output"))
    for name, g, g_ref in zip(("x (through exp's kept o)", "wo_a"), grads[0], grads[1], strict=True):
        assert_close(g, g_ref, atol=1e-5 * g_ref.abs().max().item(), rtol=1e-5, msg=rng.tag(f"grad {name}"))


def test_norm_rope_matches_the_norm_then_the_rotation(rng: Rng) -> None:
    """Guards the attention's q way in (weightless RMSNorm, then RoPE) as one function that keeps
    its output and rstd, not the norm's input: output and the input gradient against the float64
    norm composed with the complex-rotation oracle (a backward that forgets to rotate the output
    or the gradient back, or drops the projection onto the sphere's tangent, is off by O(1)).
    Rows of different scales: rstd differs per row."""
    b, s, h, d, rd = 2, 3, 4, 12, 8
    ang = random_angles(rng, b, s, 1, half=rd // 2)  # broadcast over heads
    cos, sin = ang.cos().float(), ang.sin().float()
    x = (rng.randn(b, s, h, d) * rng.uniform(b, s, h, 1, lo=0.2, hi=5.0)).requires_grad_()
    check_against_oracle(rng, lambda a: ops.norm_rope(a, cos, sin, 1e-6),
                         lambda a: ref_rope(ref_rms_norm(a, None, 1e-6), ang), [x], ["x"])


@pytest.mark.parametrize("window", [1, 5, 64])
def test_window_index_lists_exactly_the_window_mask(rng: Rng, window: int) -> None:
    """Guards the kernels' index form of the sliding window (built without an [S, S] mask):
    for packed documents with padding on both sides, the keys it lists per query are exactly
    those window_mask marks (same document, k <= q, q - k < window), each once."""
    b, s = 3, 41
    doc = torch.full((b, s), -1, dtype=torch.long)
    for r in range(b):
        cuts = sorted(rng.randint(1, s - 1, 3).tolist())
        lo, hi = cuts[0] - 1, cuts[-1] + 1  # padding before lo and from hi on
        doc[r, lo:hi] = torch.tensor([sum(i >= c for c in cuts[1:-1]) for i in range(lo, hi)])
    layout = SequenceLayout.build(b, s, torch.device("cpu"), doc_ids=doc)
    idx = layout.window_index(window)
    assert idx.shape == (b, s, window)
    mask = torch.zeros(b, s, s + 1, dtype=torch.bool).scatter(-1, torch.where(idx >= 0, idx, s), True)[..., :s]
    assert_equal(mask, layout.window_mask(window), rng.tag("window_index == window_mask"))
    counts = (idx >= 0).sum(-1)
    assert_equal(counts, layout.window_mask(window).sum(-1), rng.tag("each key listed once"))


def _expert_inputs(rng: Rng, n: int, k: int, d: int, inter: int, n_experts: int, n_local: int, dtype,
                   idle: int = -1):
    """Each token picks k distinct experts at random, never expert `idle`."""
    allowed = torch.tensor([e for e in range(n_experts) if e != idle])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=rng.gen)[:k]] for _ in range(n)])
    w = [rng.randn(n_local, inter, d, std=0.3, dtype=dtype), rng.randn(n_local, inter, d, std=0.3, dtype=dtype),
         rng.randn(n_local, d, inter, std=0.3, dtype=dtype)]
    return (rng.randn(n, d, dtype=dtype), idx, rng.uniform(n, k, lo=0.1, hi=1.0, dtype=torch.float32), *w)


@pytest.mark.parametrize("first,n_local,n_experts", [(0, 6, 6), (2, 3, 8)])
def test_routed_experts_match_per_token_loop(rng: Rng, first: int, n_local: int, n_experts: int) -> None:
    """Guards the grouped expert dispatch (pairs sorted into padded expert groups and summed
    back per token): output and every gradient equal a plain loop over (token, slot) pairs,
    w2(weight * clamped_swiglu(w1 x, w3 x)) for slots whose expert is local (first..first+E-1;
    the second case is an EP rank holding experts 2-4 of 8); a local expert without tokens
    gets a zero gradient. fp32 (the reference dispatch; same flops, different order)."""
    n, k, d, inter, limit = 23, 3, 16, 24, 1.5
    for _ in range(100):  # inputs whose w1 x, w3 x stay 1e-4 off the clamp's kinks at +-limit: the two
        # sums round differently, and a value within that of a kink can take the other side's gradient
        x, idx, wt, w1, w3, w2 = _expert_inputs(rng, n, k, d, inter, n_experts, n_local, torch.float32,
                                                idle=first + 1)
        e = idx - first
        local, e = (e >= 0) & (e < n_local), e.clamp(0, n_local - 1)
        pre = torch.stack([torch.einsum("tjid,td->tji", w[e], x)[local] for w in (w1, w3)])
        if ((pre.abs() - limit).abs() > 1e-4).all():
            break
    ins = [t.requires_grad_() for t in (x, wt, w1, w3, w2)]
    out = ops.routed_experts(ins[0], idx, ins[1], *ins[2:], first, limit, all_local=n_local == n_experts)
    ref = torch.zeros(n, d)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j]) - first
            if 0 <= e < n_local:
                h = ops.clamped_swiglu(w1[e] @ x[t], w3[e] @ x[t], limit) * wt[t, j]
                ref[t] = ref[t] + w2[e] @ h
    cot = rng.randn(n, d, dtype=torch.float32)
    got = torch.autograd.grad((out * cot).sum(), ins)
    exp = torch.autograd.grad((ref * cot).sum(), ins)
    assert_rel_close(out, ref, FP32_REL, rng.tag("routed experts forward"))
    for g, e, name in zip(got, exp, ["x", "weight", "w1", "w3", "w2"], strict=True):
        assert_rel_close(g, e, FP32_REL, rng.tag(f"d{name}"))
    assert (idx != first + 1).all(), "local expert 1 was meant to get no tokens"
    assert_equal(got[2][1], torch.zeros(inter, d), rng.tag("expert without tokens: zero gradient"))


def test_routed_experts_grouped_gemm_matches_loop(rng: Rng) -> None:
    """Guards the fused path (one torch._grouped_mm per projection over the padded groups,
    bf16) against the per-group loop: forward and gradients within bf16 rounding."""
    n, k, d, inter, ne = 37, 2, 32, 48, 5
    x, idx, wt, w1, w3, w2 = _expert_inputs(rng, n, k, d, inter, ne, ne, torch.bfloat16)
    runs = []
    for fused in (False, True):
        ins = [t.detach().clone().requires_grad_() for t in (x, wt, w1, w3, w2)]
        out = ops.routed_experts(ins[0], idx, ins[1], *ins[2:], 0, 7.0, fused=fused)
        out.square().sum().backward()
        runs.append([out.detach()] + [t.grad for t in ins])
    for a, b, name in zip(*runs, ["out", "x", "weight", "w1", "w3", "w2"], strict=True):
        assert_rel_close(a.float(), b.float(), 3e-2, rng.tag(f"grouped GEMM vs loop: {name}"))


def test_add_cast_is_add_then_cast_bit_for_bit(rng: Rng) -> None:
    """Guards the MoE's one-pass sum (fp32 routed output + bf16 shared expert output, stored
    bf16): forward and both gradients bit-equal to (a + b).to(bf16) through autograd; the
    sum is taken in fp32 (a bf16 add would round a first: the planted check below)."""
    bf = torch.bfloat16
    a = rng.randn(37, 24, dtype=torch.float32) * 3
    b = rng.randn(37, 24, dtype=bf)
    g = rng.randn(37, 24, dtype=bf)
    runs = []
    for fn in (ops.add_cast, lambda x, y, dt: (x + y).to(dt)):
        ins = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        out = fn(*ins, bf)
        out.backward(g)
        runs.append((out, *(t.grad for t in ins)))
    for got, want, name in zip(*runs, ["out", "a's gradient", "b's gradient"], strict=True):
        assert_finite(got, rng.tag(name))
        assert got.dtype == want.dtype and torch.equal(got, want), rng.tag(name)
    assert not torch.equal(runs[0][0], a.to(bf) + b), rng.tag("precondition: a bf16 add rounds differently")
    with pytest.raises(ValueError, match="add_cast"):
        ops.add_cast(a, b[:, :1], bf)


# ----------------------------------------------------------------------------------------------------------
# dtype preservation (DSV4.md pitfall 3)


def test_bf16_inputs_give_bf16_outputs(rng: Rng) -> None:
    """Guards an op that computes in fp32 and forgets to cast back (a dtype lost in one op turns
    the whole model fp32 or breaks kernels): bf16 in -> bf16 out for rms_norm, apply_rope,
    hadamard, hc_pre's u, hc_post, sparse_attention and grouped_out_proj; values agree with the
    fp32 computation to bf16 precision (2^-8 relative)."""
    bf = torch.bfloat16
    x = rng.randn(2, 3, 4, 16, dtype=bf)
    cases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    w = rng.uniform(16, lo=0.5, hi=1.5, dtype=bf)
    cases["rms_norm"] = (ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.float(), w.float(), 1e-6))
    cases["rms_norm fp32 weight"] = (ops.rms_norm(x, w.float(), 1e-6), ops.rms_norm(x.float(), w.float(), 1e-6))
    ang = random_angles(rng, 2, 3, 1, half=4)
    cos, sin = ang.cos().float(), ang.sin().float()
    cases["apply_rope"] = (ops.apply_rope(x, cos, sin), ops.apply_rope(x.float(), cos, sin))
    cases["apply_rope inverse"] = (ops.apply_rope(x, cos, sin, True), ops.apply_rope(x.float(), cos, sin, True))
    cases["hadamard"] = (ops.hadamard(x), ops.hadamard(x.float()))
    hx, fn, base, scale = _hc_inputs(rng, 2, 3, 4, 16)
    fn, base, scale = fn.float(), base.float(), scale.float()  # mHC parameters are fp32
    u, post, comb = ops.hc_pre(hx.to(bf), fn, base, scale, 1e-6, 1e-6, 20)
    cases["hc_pre u"] = (u, ops.hc_pre(hx.to(bf).float(), fn, base, scale, 1e-6, 1e-6, 20)[0])
    f = rng.randn(2, 3, 16, dtype=bf)
    cases["hc_post"] = (ops.hc_post(f, hx.to(bf), post, comb), ops.hc_post(f.float(), hx.to(bf).float(), post, comb))
    q, kv, mask, sink, sc = _attention_inputs(rng, dtype=bf)
    cases["sparse_attention"] = (ops.sparse_attention(q, kv, mask, sink, sc)[0],
                                 ops.sparse_attention(q.float(), kv.float(), mask, sink, sc)[0])
    wo = rng.randn(2 * 5, 2 * 6 // 2, std=0.3, dtype=bf)
    o = rng.randn(2, 5, 2, 6, dtype=bf)
    cases["grouped_out_proj"] = (ops.grouped_out_proj(o, wo, 2), ops.grouped_out_proj(o.float(), wo.float(), 2))
    for name, (got, ref) in cases.items():
        assert got.dtype == bf, rng.tag(f"{name}: bf16 input returned {got.dtype}")
        assert ref.dtype == torch.float32
        assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2, msg=rng.tag(name))
    assert post.dtype == comb.dtype == torch.float32, rng.tag("mHC post/comb stay fp32")


# ----------------------------------------------------------------------------------------------------------
# no in-place writes into inputs or saved tensors (DSV4.md pitfall 2) that outlive the op (unrope_out_proj
# rotates o's RoPE columns for its GEMMs and puts their bits back: its own test above)


def _op_cases(rng: Rng) -> dict[str, tuple[Callable, list[torch.Tensor]]]:
    """Each op with fp32 inputs; differentiable inputs are NON-leaf tensors (so an in-place write
    would not be refused by autograd and must be caught by the version/value check)."""
    ang = random_angles(rng, 2, 3, 1, half=4)
    cos, sin = ang.cos().float(), ang.sin().float()
    hx, fn, base, scale = (t.float() for t in _hc_inputs(rng, 2, 3, 4, 8))
    q, kv, mask, sink, sc = _attention_inputs(rng, dtype=torch.float32)
    f32 = lambda *shape: rng.randn(*shape, dtype=torch.float32)  # noqa: E731
    z = f32(2, 3, 8, 5)
    z[0, 0, :4] = float("-inf")
    comb = ops.sinkhorn(f32(2, 3, 4, 4), 20, 1e-6)
    return {
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-6), [f32(2, 3, 16), f32(16)]),
        "rms_norm_noweight": (lambda x: ops.rms_norm(x, None, 1e-6), [f32(2, 3, 16)]),
        "apply_rope": (lambda x, c, s: ops.apply_rope(x, c, s), [f32(2, 3, 2, 12), cos, sin]),
        "apply_rope_inverse": (lambda x, c, s: ops.apply_rope(x, c, s, True), [f32(2, 3, 2, 12), cos, sin]),
        "hadamard": (ops.hadamard, [f32(2, 3, 16)]),
        "sinkhorn": (lambda t: ops.sinkhorn(t, 20, 1e-6), [f32(2, 3, 4, 4)]),
        "hc_pre": (lambda *a: ops.hc_pre(*a, 1e-6, 1e-6, 20), [hx, fn, base, scale]),
        "hc_post": (ops.hc_post, [f32(2, 3, 8), hx, 2 * torch.sigmoid(f32(2, 3, 4)), comb]),
        "hc_head": (lambda *a: ops.hc_head(*a, 1e-6, 1e-6), [hx, fn[:4], base[:4], scale[:1]]),
        "compress_pool": (ops.compress_pool, [f32(2, 3, 8, 5), z]),
        "sparse_attention": (lambda a, b, s_: ops.sparse_attention(a, b, mask, s_, sc, return_probs=True),
                             [q, kv, sink]),
        "indexer_scores": (ops.indexer_scores, [f32(2, 4, 3, 8), f32(2, 5, 8), f32(2, 4, 3)]),
        "sqrtsoftplus": (ops.sqrtsoftplus, [f32(4, 9)]),
        "clamped_swiglu": (lambda g, u: ops.clamped_swiglu(g, u, 10.0), [f32(4, 9) * 8, f32(4, 9) * 8]),
        "grouped_out_proj": (lambda o, w: ops.grouped_out_proj(o, w, 2), [f32(2, 3, 4, 6), f32(10, 12)]),
        "unrope_out_proj": (lambda o, w: ops.unrope_out_proj(o, cos, sin, w, 2),  # the tables: constants
                            [f32(2, 3, 2, 12), f32(10, 12)]),
        "norm_rope": (lambda x: ops.norm_rope(x, cos, sin, 1e-6), [f32(2, 3, 2, 12)]),
    }


OP_NAMES = ["rms_norm", "rms_norm_noweight", "apply_rope", "apply_rope_inverse", "hadamard", "sinkhorn", "hc_pre",
            "hc_post", "hc_head", "compress_pool", "sparse_attention", "indexer_scores", "sqrtsoftplus",
            "clamped_swiglu", "grouped_out_proj", "unrope_out_proj", "norm_rope"]


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_never_writes_into_inputs(rng: Rng, name: str) -> None:
    """Guards in-place writes into inputs or into tensors autograd saved (in-place RoPE on a view
    corrupted saved tensors in a real framework): forward + backward under anomaly mode must
    succeed with finite gradients, and every input keeps its values and its version counter."""
    fn, raw = _op_cases(rng)[name]
    assert set(OP_NAMES) == set(_op_cases(rng)), "every op case is exercised"
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in raw]
    inputs = [t * 1 if t.requires_grad else t for t in leaves]  # non-leaf: in-place would not be refused
    before = [t.detach().clone() for t in inputs]
    versions = [t._version for t in inputs]
    with torch.autograd.detect_anomaly():
        outs = [o for o in _as_tuple(fn(*inputs)) if o is not None]
        loss = sum((o.double().masked_fill(~torch.isfinite(o), 0) * torch.randn(o.shape, generator=rng.gen,
                                                                                 dtype=F64)).sum() for o in outs)
        loss.backward()
    for i, (t, b, v) in enumerate(zip(inputs, before, versions, strict=True)):
        assert t._version == v, rng.tag(f"{name}: input {i} was modified in place")
        assert torch.equal(t.detach(), b), rng.tag(f"{name}: input {i} values changed")
    for i, leaf in enumerate(leaves):
        if leaf.requires_grad:
            assert leaf.grad is not None, rng.tag(f"{name}: input {i} got no gradient")
            assert_finite(leaf.grad, rng.tag(f"{name}: grad of input {i}"))


def test_op_chain_forward_backward_leaves_inputs_intact(rng: Rng) -> None:
    """Guards in-place corruption that only shows in a chain (a later op writing into an earlier
    op's saved output): a small mHC + attention + indexer + MoE chain built from every op runs
    forward and backward under anomaly mode; all gradients are finite and non-zero and every
    input tensor is bitwise unchanged with an unchanged version counter."""
    b, s, n, d, h, hd, rd = 1, 16, 4, 16, 2, 16, 8
    f32 = lambda *shape, std=1.0: rng.randn(*shape, std=std, dtype=torch.float32)  # noqa: E731
    params = {
        "x": f32(b, s, n, d), "hc_fn": f32(n * (n + 2), n * d, std=0.1), "hc_base": f32(n * (n + 2), std=0.5),
        "hc_scale": f32(3, std=0.3) + 1, "norm_w": f32(d, std=0.1) + 1, "wq": f32(h * hd, d, std=0.3),
        "wkv": f32(hd, d, std=0.3), "sink": f32(h), "wo_a": f32(2 * 6, h * hd // 2, std=0.3),
        "wo_b": f32(d, 12, std=0.3), "wi": f32(h, d, std=0.3), "wz": f32(4, d, std=0.3),
        "w1": f32(12, d, std=0.5), "w3": f32(12, d, std=0.5), "head_fn": f32(n, n * d, std=0.1),
        "head_base": f32(n, std=0.5), "head_scale": f32(1, std=0.3) + 1,
    }
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    ang = random_angles(rng, b, s, half=rd // 2)
    cos, sin = ang.cos().float(), ang.sin().float()
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool))[None]
    fixed = [cos, sin, mask]
    inputs = {k: v * 1 for k, v in leaves.items()}  # non-leaf views of the leaves
    snap = {k: v.detach().clone() for k, v in inputs.items()}
    snap_fixed = [t.clone() for t in fixed]
    ver = {k: v._version for k, v in inputs.items()}
    ver_fixed = [t._version for t in fixed]
    p = inputs
    with torch.autograd.detect_anomaly():
        u, post, comb = ops.hc_pre(p["x"], p["hc_fn"], p["hc_base"], p["hc_scale"], 1e-6, 1e-6, 20)
        xn = ops.rms_norm(u, p["norm_w"], 1e-6)
        q = ops.rms_norm((xn @ p["wq"].T).unflatten(-1, (h, hd)), None, 1e-6)
        q = ops.apply_rope(q, cos[:, :, None], sin[:, :, None])
        kv = ops.apply_rope(ops.rms_norm(xn @ p["wkv"].T, None, 1e-6), cos, sin)
        # compressed entries (ratio 4, HCA-style) and an indexer over them
        blocks = (xn @ p["wz"].T).unflatten(1, (s // 4, 4))  # [B, G, 4, 4] gate logits
        entries = ops.compress_pool(xn.unflatten(1, (s // 4, 4))[..., :hd], blocks.repeat(1, 1, 1, hd // 4))
        keys_i = ops.hadamard(entries)
        q_i = ops.hadamard(q)
        scores = ops.indexer_scores(q_i, keys_i, xn @ p["wi"].T)
        visible = torch.tensor([[[g < (t + 1) // 4 for g in range(s // 4)] for t in range(s)]])
        chosen = ops.topk_select(scores.detach(), visible, 1)
        keys = torch.cat((kv, entries.to(kv.dtype)), 1)
        o, _ = ops.sparse_attention(q, keys, torch.cat((mask, chosen), -1), p["sink"], hd ** -0.5)
        o = ops.apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
        attn = ops.grouped_out_proj(o, p["wo_a"], 2) @ p["wo_b"].T
        xs = ops.hc_post(attn, p["x"], post, comb)
        gate = ops.sqrtsoftplus(xn @ p["w1"][:4].T)
        moe = ops.clamped_swiglu(xn @ p["w1"].T, xn @ p["w3"].T, 10.0) @ p["w1"] * gate.mean(-1, keepdim=True)
        y = ops.hc_head(xs, p["head_fn"], p["head_base"], p["head_scale"], 1e-6, 1e-6) + moe
        # stand-in for the indexer's auxiliary loss (top-k itself has no gradient)
        aux = (scores * visible * torch.randn(scores.shape, generator=rng.gen)).sum()
        ((y * torch.randn(y.shape, generator=rng.gen)).sum() + 1e-2 * aux).backward()
    for k, t in inputs.items():
        assert t._version == ver[k], rng.tag(f"{k} modified in place")
        assert torch.equal(t.detach(), snap[k]), rng.tag(f"{k} values changed")
    for i, t in enumerate(fixed):
        assert t._version == ver_fixed[i] and torch.equal(t, snap_fixed[i]), rng.tag(f"fixed input {i} changed")
    for k, leaf in leaves.items():
        assert leaf.grad is not None, rng.tag(f"{k}: no gradient")
        assert_finite(leaf.grad, rng.tag(f"{k} grad"))
        assert leaf.grad.abs().max() > 0, rng.tag(f"{k}: gradient identically zero")


def test_sqrtsoftplus_gradient_finite_for_extreme_logits() -> None:
    """Guards a NaN router gradient: fp32 softplus underflows to 0 below about -104 and
    sqrt'(0) is infinite, so one extreme logit would poison the gate weights."""
    x = torch.tensor([-1e4, -200.0, -104.0, -50.0, 0.0, 30.0], requires_grad=True)
    ops.sqrtsoftplus(x).sum().backward()
    assert torch.isfinite(x.grad).all(), x.grad
    assert (x.grad >= 0).all()


def test_sorts_in_narrow_key_types_give_the_int64_order(rng: Rng) -> None:
    """The index sorts run on the narrowest integer keys that hold them (layout.sort_key_dtype:
    fewer radix passes): the routing's expert groups (stable: token order within a group) and
    the layout's compression blocks give what int64 keys give; mask_to_index (a search over the
    mask's running count, no sort) gives what a sort of int64 keys gives, rows with fewer keys
    than the bound padded with -1."""
    from plugins.deepseek_v4.layout import sort_key_dtype

    assert [sort_key_dtype(n) for n in (1, 2 ** 15, 2 ** 15 + 1, 2 ** 31, 2 ** 31 + 1)] == [
        torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]
    # every row between 41 and 119 keys (a Bernoulli mask's rows fell outside now and then):
    # rank < count over a random order of the 300 slots
    counts = rng.randint(41, 120, 2, 9, 1)
    mask = rng.uniform(2, 9, 300).argsort(-1).argsort(-1) < counts
    t = mask.shape[-1]
    ar = torch.arange(t)
    want = torch.where(mask, ar, t + ar).sort(dim=-1).indices[..., :120]
    assert torch.equal(ops.mask_to_index(mask, 120), torch.where(mask.gather(-1, want), want, -1))
    assert (mask.sum(-1) < 120).all() and (mask.sum(-1) > 40).all()  # every row padded at 120, cut at 40
    assert torch.equal(ops.mask_to_index(mask, 40), want[..., :40])
    assert torch.equal(ops.mask_to_index(mask), ops.mask_to_index(mask, int(mask.sum(-1).max())))
    idx = rng.randint(0, 40, 200, 6)  # experts 10..29 local, others elsewhere: key 20
    pairs, rows, offs, counts, m = ops.expert_rows(idx, 10, 20, all_local=False, align=1)
    flat = idx.flatten() - 10
    key = torch.where((flat >= 0) & (flat < 20), flat, 20)
    order = torch.sort(key, stable=True).indices
    assert torch.equal(pairs, order[:pairs.numel()]) and pairs.numel() == int((key < 20).sum())
    assert torch.equal(counts, torch.bincount(key, minlength=21)[:20])
    doc = torch.cat([torch.full((1, 37), 0), torch.full((1, 64), 1), torch.full((1, 27), 2)], 1)
    pos = torch.cat([torch.arange(37), torch.arange(64), torch.arange(27)])[None]
    blocks = SequenceLayout(doc=doc, pos=pos).blocks(4)
    assert blocks.start[blocks.valid].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 32] + [
        37 + 4 * i for i in range(16)] + [101 + 4 * i for i in range(6)]
