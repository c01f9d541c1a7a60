"""Triton sparse attention kernel vs the float64 gather reference.

Runs on CUDA (bf16, several shapes) and, without a GPU, under Triton's CPU interpreter
(fp32, small shapes), so the kernel logic is checked in CI too."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_finite

triton = pytest.importorskip("triton")  # CPU: conftest switched Triton to its interpreter

from plugins.deepseek_v4 import kernels, ops  # noqa: E402
from plugins.deepseek_v4.kernels import mhc  # noqa: E402
from plugins.deepseek_v4.kernels import sparse_attention as sa  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# bf16 inputs: errors of a few bf16 ulps (2^-8) relative to the output scale; fp32 (ieee
# dots in the interpreter): rounding only.
TOL = 2e-2 if CUDA else 2e-5
# (T, H, D, K, pool N): empty rows, T/K/H not multiples of the blocks, K < BLOCK_K, two head
# blocks of the H100 forward (H = 128), its smallest D half (D = 64)
SHAPES = ([(37, 24, 512, 640 + 3, 900), (300, 64, 512, 128 + 512, 1200), (64, 16, 128, 20, 80),
           (70, 128, 64, 45, 200)] if CUDA
          else [(9, 5, 64, 21, 40), (4, 16, 32, 7, 12)])


def make(seed: int, t: int, h: int, d: int, k: int, n: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).int()
    drop = torch.rand(t, k, generator=g) < 0.3
    idx[drop] = -1
    idx[0] = -1  # an empty row
    sink = torch.randn(h, generator=g)
    return q, kv, idx, sink


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert_finite(a, b)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(kernels, "POISON_OUTPUTS", True)


def test_compact_keeps_every_valid_slot_in_order(seed):
    """The attention kernels stop at each token's count of valid slots, so `compact` must keep
    every valid slot, in order, and put only empties after them (also from a strided view)."""
    g = torch.Generator().manual_seed(seed)
    for t, k, strided in ((7, 21, False), (3, 1, False), (5, 64 + 3, False), (6, 19, True)):
        idx = torch.randint(0, 100, (k, t) if strided else (t, k), generator=g, dtype=torch.int32)
        idx = idx.t() if strided else idx
        idx[torch.rand(t, k, generator=g) < 0.4] = -1
        idx[0] = -1
        out, cnt = sa.compact(idx.to(DEV))
        out, cnt = out.cpu(), cnt.cpu()
        for row, got, n in zip(idx, out, cnt, strict=True):
            kept = row[row >= 0]
            assert n == len(kept) and torch.equal(got[:n], kept) and (got[n:] == -1).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_kernel_matches_float64_reference(seed, shape, deterministic, chunked, monkeypatch):
    """Forward o and lse, and gradients of q, kv and sink, against float64 autograd through
    the gather reference; outputs start as NaN so an unwritten element fails; the empty row
    gives exactly zero output. `chunked`: the backward's scratch bound forces one token per
    chunk (every chunk boundary crossed)."""
    if chunked:
        monkeypatch.setattr(sa, "SCRATCH_BYTES", 1)
        monkeypatch.setattr(sa, "DETERMINISTIC_SCRATCH_BYTES", 1)
    t, h, d, k, n = shape
    q, kv, idx, sink = make(seed, *shape)
    scale = d ** -0.5
    ref_in = [x.double().requires_grad_() for x in (q, kv, sink)]
    o_ref, lse_ref = ops.sparse_attention_indexed(ref_in[0], ref_in[1], idx, ref_in[2], scale)
    do = torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed + 1))
    (o_ref * do.double()).sum().backward()
    args = [x.to(DEV, DTYPE).requires_grad_() for x in (q, kv)]
    sk = sink.to(DEV).requires_grad_()
    o, lse = sa.sparse_attention(args[0], args[1], idx.to(DEV), sk, scale, deterministic=deterministic)
    assert o.dtype == DTYPE and lse.dtype == torch.float32
    (o.float() * do.to(DEV)).sum().backward()
    assert rel(o.float().cpu(), o_ref) < TOL
    assert rel(lse.cpu(), lse_ref) < TOL
    assert torch.equal(o[0].float().cpu(), torch.zeros(h, d))
    for got, ref, name in ((args[0].grad, ref_in[0].grad, "dq"), (args[1].grad, ref_in[1].grad, "dkv"),
                           (sk.grad, ref_in[2].grad, "dsink")):
        assert rel(got.float().cpu(), ref) < 2 * TOL, name


def make_banded(seed: int, s: int, h: int, d: int, window: int, ratio: int, picks: int):
    """The model's kind of index sets: pool = [s raw keys ; s / ratio compressed entries];
    token p picks its window (p - window + 1 .. p) and `picks` random entries among the
    compressed ones it can see, so each key tile is picked by a narrow band of tokens (raw
    keys) or by tokens from some point on (compressed)."""
    g = torch.Generator().manual_seed(seed)
    n_c = s // ratio
    q, kv, sink = torch.randn(s, h, d, generator=g), torch.randn(s + n_c, d, generator=g), torch.randn(h, generator=g)
    p = torch.arange(s)
    win = p[:, None] - torch.arange(window)[None, :]
    visible = torch.arange(n_c)[None, :] < ((p + 1) // ratio)[:, None]
    score = torch.rand(s, n_c, generator=g).masked_fill(~visible, -1.0)
    top = score.topk(min(picks, n_c), dim=-1)
    idx = torch.cat((torch.where(win >= 0, win, -1), torch.where(top.values >= 0, top.indices + s, -1)), 1)
    return q, kv, idx.int(), sink


@pytest.mark.parametrize("deterministic", [False, True])
def test_key_major_kv_gradient_on_banded_index_sets(seed, deterministic, monkeypatch):
    """The kv-gradient kernel visits, per key tile, only the tokens between the first and last
    that pick one of its keys, split over programs: on the model's kind of index sets (narrow
    bands, and ranges starting mid-chunk), with small splits and chunks so that splits and
    chunks cut through the bands, every gradient matches float64."""
    s, h, d, window, ratio, picks = (700, 64, 128, 64, 4, 48) if CUDA else (48, 4, 32, 6, 4, 5)
    monkeypatch.setattr(sa, "TOKENS_PER_PROGRAM", 7)
    monkeypatch.setattr(sa, "DETERMINISTIC_TOKENS_PER_PROGRAM", 5)
    monkeypatch.setattr(sa, "SCRATCH_BYTES", (s // 3) * (window + picks) * 2 * h * DTYPE.itemsize)
    q, kv, idx, sink = make_banded(seed, s, h, d, window, ratio, picks)
    scale = d ** -0.5
    ref_in = [x.double().requires_grad_() for x in (q, kv, sink)]
    o_ref, _ = ops.sparse_attention_indexed(ref_in[0], ref_in[1], idx, ref_in[2], scale)
    do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (o_ref * do.double()).sum().backward()
    args = [x.to(DEV, DTYPE).requires_grad_() for x in (q, kv)]
    sk = sink.to(DEV).requires_grad_()
    o, _ = sa.sparse_attention(args[0], args[1], idx.to(DEV), sk, scale, deterministic=deterministic)
    (o.float() * do.to(DEV)).sum().backward()
    assert rel(o.float().cpu(), o_ref) < TOL
    for got, ref, name in ((args[0].grad, ref_in[0].grad, "dq"), (args[1].grad, ref_in[1].grad, "dkv"),
                           (sk.grad, ref_in[2].grad, "dsink")):
        assert rel(got.float().cpu(), ref) < 2 * TOL, name


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="H100 (sm_90) only")
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 64 == 0])
def test_h100_kernels_are_the_gluon_ones_and_agree_with_the_portable_ones(seed, shape):
    """On an H100 the bf16 forward and the backward's dq pass take the Gluon kernels (a silent
    fallback would leave them untested); o, lse and every gradient agree with the portable
    Triton kernels' within bf16 rounding."""
    q, kv, idx, sink = make(seed, *shape)
    q, kv, idx, sink = q.to(DEV, DTYPE), kv.to(DEV, DTYPE), idx.to(DEV), sink.to(DEV)
    do = torch.randn_like(q)
    assert sa._sm90.supported(q, kv, q, do)
    cidx, cnt = sa.compact(idx)
    scale = shape[2] ** -0.5
    results = []
    for sm90 in (True, False):
        opts = sa.AttentionOptions(sm90=sm90)
        o, lse = sa.sparse_attn_fwd(q, kv, cidx, cnt, sink, scale, opts)
        results.append((o, lse, *sa.sparse_attn_bwd(q, kv, cidx, cnt, sink, scale, o, lse, do, False, opts)))
    for name, got, portable in zip(("o", "lse", "dq", "dkv", "dsink"), *results, strict=True):
        assert rel(got.float(), portable.float()) < (1e-5 if name == "lse" else TOL), name


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="H100 (sm_90) only")
@pytest.mark.parametrize("case", [s for s in SHAPES if s[1] % 64 == 0] + ["banded"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_h100_gluon_kv_gradient_agrees_with_the_portable_one(seed, case, deterministic, monkeypatch):
    """The Gluon kv gradient (`AttentionOptions.sm90_kv_gradient`: the fast backward's by
    default; the deterministic backward keeps the portable kernel, so there the Gluon one is
    called in its place) on the same inputs as the portable kernel, with token splits of a few
    tokens so that they cut through each key tile's range: dkv agrees within bf16 rounding of
    fp32 sums taken in another order (a lost head block, token or key would be off by far
    more), dq and dsink (the same dq pass) are bit-identical, and the deterministic mode
    repeats its bits."""
    monkeypatch.setattr(sa, "TOKENS_PER_PROGRAM", 7)
    monkeypatch.setattr(sa, "DETERMINISTIC_TOKENS_PER_PROGRAM", 5)
    kernel, calls = sa.kv_gradient_into, []

    def spy(*args):  # the kernel the backward chose (its last argument), or the Gluon one forced
        calls.append(args[-1])
        kernel(*args[:-1], args[-1] or force[0])

    force = [False]
    monkeypatch.setattr(sa, "kv_gradient_into", spy)
    q, kv, idx, sink = make_banded(seed, 700, 64, 128, 64, 4, 48) if case == "banded" else make(seed, *case)
    q, kv, idx, sink = q.to(DEV, DTYPE), kv.to(DEV, DTYPE), idx.to(DEV), sink.to(DEV)
    do = torch.randn_like(q)
    cidx, cnt = sa.compact(idx)
    scale = q.shape[-1] ** -0.5
    o, lse = sa.sparse_attn_fwd(q, kv, cidx, cnt, sink, scale)
    runs = []
    for gluon in (True, True, False):
        force[0] = gluon and deterministic
        calls.clear()
        runs.append(sa.sparse_attn_bwd(q, kv, cidx, cnt, sink, scale, o, lse, do, deterministic,
                                       sa.AttentionOptions(sm90_kv_gradient=gluon)))
        assert calls and set(calls) == {gluon and not deterministic}  # Gluon: the fast backward's only
    assert sa.AttentionOptions().sm90_kv_gradient
    (dq, dkv, dsink), again, (dq_p, dkv_p, dsink_p) = runs
    assert rel(dkv.float(), dkv_p.float()) < 1e-2
    assert torch.equal(dq, dq_p) and torch.equal(dsink, dsink_p)
    if deterministic:
        assert torch.equal(dkv, again[1])


@pytest.mark.skipif(not CUDA, reason="the H100 forward's persistent grid")
@pytest.mark.parametrize("h", [64, 128])
def test_h100_forward_persistent_items_with_empty_and_short_rows(seed, h):
    """The H100 forward runs one program per SM over many (token, head block) items, loading
    each item's q during the item before and storing o while the next runs: rows with no key,
    one key, and counts at the 32-key block edges sit at random places in every program's run
    of items. o and lse against float64, outputs poisoned."""
    t, d, k, n = 1000, 512, 100, 700  # ~7.6 items per program on 132 SMs (x2 with two head blocks)
    g = torch.Generator().manual_seed(seed)
    q, kv, sink = torch.randn(t, h, d, generator=g), torch.randn(n, d, generator=g), torch.randn(h, generator=g)
    counts = torch.tensor([0, 1, 31, 32, 33, 64, 65, 100])[torch.randint(0, 8, (t,), generator=g)]
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]).int()
    idx[torch.arange(k)[None, :] >= counts[:, None]] = -1
    qd, kvd = q.to(DEV, DTYPE), kv.to(DEV, DTYPE)
    assert sa._sm90.supported(qd, kvd)
    cidx, cnt = sa.compact(idx.to(DEV))
    o, lse = sa.sparse_attn_fwd(qd, kvd, cidx, cnt, sink.to(DEV), d ** -0.5)
    o_ref, lse_ref = ops.sparse_attention_indexed(qd.double().cpu(), kvd.double().cpu(), idx, sink.double(), d ** -0.5)
    assert rel(o.float().cpu(), o_ref) < TOL
    assert rel(lse.cpu(), lse_ref) < 1e-5
    empty = counts == 0
    assert empty.any() and torch.equal(o[empty.to(DEV)].float().cpu(), torch.zeros(int(empty.sum()), h, d))


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_deterministic_backward_is_bitwise_repeatable(seed, shape):
    """Deterministic mode has no atomics: two backward passes give identical bits (on an H100
    the second shape, 64 heads, takes the Gluon kernels, the first the portable ones)."""
    q, kv, idx, sink = make(seed, *shape)
    grads = []
    for _ in range(2):
        a = [x.to(DEV, DTYPE).requires_grad_() for x in (q, kv)]
        s = sink.to(DEV).requires_grad_()
        o, _ = sa.sparse_attention(a[0], a[1], idx.to(DEV), s, q.shape[-1] ** -0.5, deterministic=True)
        o.float().square().sum().backward()
        grads.append([a[0].grad, a[1].grad, s.grad])
    for g1, g2 in zip(*grads, strict=True):
        assert torch.equal(g1, g2)


def _after_sleep(launch):
    """launch, queued behind a GPU-side sleep of a few ms on the current stream."""
    def run(*args, **kwargs):
        torch.cuda._sleep(5_000_000)
        return launch(*args, **kwargs)
    return run


class _Late:
    """A Triton kernel whose launches queue behind a sleep (`kernel[grid](...)` as before)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return _after_sleep(self.kernel[grid])


@pytest.mark.skipif(not CUDA, reason="the chunk overlap runs on CUDA streams only")
@pytest.mark.parametrize("late", ["kv", "dq"])
def test_overlapped_chunks_give_the_same_bits_as_sequential_ones(seed, late, monkeypatch):
    """With overlap_chunks (CUDA), chunk i's kv gradient runs on a side stream beside chunk
    i + 1's dq pass, with two scratch sets. Each stream in turn is made late (a sleep before
    each of its kernels), so the other runs ahead as far as the waits let it: a missing wait
    (a set overwritten while the kv gradient still reads it, or read before the dq pass wrote
    it) changes the bits of the deterministic backward."""
    if late == "kv":
        monkeypatch.setattr(sa, "_bwd_dkv", _Late(sa._bwd_dkv))
        monkeypatch.setattr(sa._sm90, "bwd_dkv_into", _after_sleep(sa._sm90.bwd_dkv_into))
    else:
        monkeypatch.setattr(sa, "_bwd_dq", _Late(sa._bwd_dq))
        monkeypatch.setattr(sa._sm90, "bwd_dq_into", _after_sleep(sa._sm90.bwd_dq_into))
    q, kv, idx, sink = make(seed, *SHAPES[1])
    # chunks of ~22 tokens: 14 chunks, each scratch set reused 7 times
    monkeypatch.setattr(sa, "SCRATCH_BYTES", 23 * idx.shape[1] * 2 * q.shape[1] * DTYPE.itemsize)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, DTYPE)
    grads = []
    for overlap in (False, True):
        a = [x.to(DEV, DTYPE).requires_grad_() for x in (q, kv)]
        s = sink.to(DEV).requires_grad_()
        o, _ = sa.sparse_attention(a[0], a[1], idx.to(DEV), s, q.shape[-1] ** -0.5, deterministic=True,
                                   options=sa.AttentionOptions(overlap_chunks=overlap))
        o.backward(do)
        grads.append([a[0].grad, a[1].grad, s.grad])
    for name, g1, g2 in zip(("dq", "dkv", "dsink"), *grads, strict=True):
        assert torch.isfinite(g1).all(), name
        assert torch.equal(g1, g2), name


def sinkhorn64(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn schedule of DSV4.md in float64 (oracle)."""
    m = torch.softmax(logits.double(), -1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


# (leading shape, n, iters): V4's n = 4 and 20 iterations; rows not a multiple of the block;
# n = 3 (padded tile); one iteration; no rows at all
SINKHORN_CASES = [((3, 67), 4, 20), ((5, 7), 3, 20), ((6,), 3, 6), ((19,), 4, 1), ((0, 4), 4, 20)]


@pytest.mark.parametrize("lead,n,iters", SINKHORN_CASES)
def test_sinkhorn_kernel_matches_float64_reference(seed, lead, n, iters):
    """Fused Sinkhorn forward and backward against float64 autograd of the same schedule:
    fp32 rounding only (the kernel is fp32 on every device), outputs NaN-poisoned first."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*lead, n, n, generator=g) * 2
    cot = torch.randn(*lead, n, n, generator=g)
    ref_in = logits.double().requires_grad_()
    ref = sinkhorn64(ref_in, iters, 1e-6)
    (ref * cot.double()).sum().backward()
    x = logits.to(DEV).requires_grad_()
    out = mhc.sinkhorn(x, iters, 1e-6)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    (out * cot.to(DEV)).sum().backward()
    if not logits.numel():
        assert x.grad.shape == logits.shape
        return
    # measured ~1e-7 / 2e-7 (as the fp32 PyTorch reference): fp32 rounding over 39 steps
    assert rel(out.cpu(), ref) < 1e-6
    assert rel(x.grad.cpu(), ref_in.grad) < 2e-6


def gates64(mm, nrm, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float, width: int) -> list:
    """hc_pre's gates (hc_head's with m = n) in float64 from the mixes' raw projection mm and
    the streams' norm: the formula of DSV4.md, written out (oracle)."""
    mix = mm * torch.rsqrt(nrm ** 2 / width + norm_eps)[..., None]
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    if mm.shape[-1] == n:
        return [pre]
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
    return [pre, post, sinkhorn64((mix[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)), iters, hc_eps)]


# (leading shape, n, iters, full): V4's n = 4 and 20 iterations; rows not a multiple of the
# block; n = 3 (padded tile); hc_head's gate (pre only); no rows at all
GATE_CASES = [((3, 67), 4, 20, True), ((5, 7), 3, 3, True), ((2, 45), 4, 1, False), ((0, 4), 4, 20, True)]


@pytest.mark.parametrize("lead,n,iters,full", GATE_CASES)
def test_hc_gates_kernel_matches_float64_reference(seed, lead, n, iters, full):
    """The fused mHC gates (normalisation of the mixes, the three sigmoid/Sinkhorn groups)
    against float64 autograd of the formula: every output (NaN-poisoned first) and the
    gradients of mm, the norm, base and scale (the last two summed over all rows, through the
    kernel's per-program partials). fp32 on every device: rounding only."""
    g = torch.Generator().manual_seed(seed)
    m, width = (n * (n + 2) if full else n), 24 * n
    mm = torch.randn(*lead, m, generator=g) * 3
    nrm = (torch.rand(*lead, generator=g) + 0.2) * width ** 0.5
    base = torch.randn(m, generator=g) * 0.5
    scale = torch.rand(3 if full else 1, generator=g) + 0.5
    ref_in = [t.double().requires_grad_() for t in (mm, nrm, base, scale)]
    refs = gates64(*ref_in, n, iters, 1e-6, 1e-6, width)
    cots = [torch.randn(r.shape, generator=g) for r in refs]
    sum((r * c.double()).sum() for r, c in zip(refs, cots, strict=True)).backward()
    ins = [t.to(DEV).requires_grad_() for t in (mm, nrm, base, scale)]
    outs = mhc.hc_gates(*ins, n, iters, 1e-6, 1e-6, width)
    if not full:
        assert outs[1].numel() == outs[2].numel() == 0
    outs = outs[:len(refs)]
    sum((o * c.to(DEV)).sum() for o, c in zip(outs, cots, strict=True)).backward()
    if not mm.numel():
        assert all(o.shape == r.shape for o, r in zip(outs, refs, strict=True))
        assert not ins[2].grad.any() and not ins[3].grad.any()
        return
    for o, r, name in zip(outs, refs, ["pre", "post", "comb"], strict=False):
        assert o.dtype == torch.float32
        assert rel(o.cpu(), r) < 1e-6, name
    assert rel(ins[0].grad.cpu(), ref_in[0].grad) < 2e-6, "mm"
    assert rel(ins[2].grad.cpu(), ref_in[2].grad) < 2e-6, "base"
    # measured up to 3.7e-6 in 60 seeds: each row's norm gradient sums m signed terms
    assert rel(ins[1].grad.cpu(), ref_in[1].grad) < 1e-5, "nrm"
    # A scale's gradient sums over every row, and its terms can cancel: the fp32 error is
    # relative to the summed size of the terms, sum |d mm * mm| / scale over its group.
    assert within_terms(ins[3].grad, ref_in[3].grad, scale_terms(ref_in[0].grad, mm, n, scale)) < 2e-6, "scale"


def scale_terms(dmm: torch.Tensor, mm: torch.Tensor, n: int, scale: torch.Tensor) -> torch.Tensor:
    """The summed size of the terms of each mHC scale's gradient: sum |d mm * mm| over the
    scale's group of columns and all rows, over the scale (d scale = sum d logit * mix)."""
    terms = (dmm * mm.double()).abs()  # [..., m]
    groups = [terms[..., :n], terms[..., n:2 * n], terms[..., 2 * n:]][:scale.numel()]
    return torch.stack([t.sum() for t in groups]) / scale.double()


def within_terms(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor) -> float:
    """Largest error of a summed quantity relative to the summed size of its terms."""
    assert_finite(got, want)
    return ((got.double().cpu() - want).abs() / terms.clamp_min(1e-300)).max().item()


# (leading shape, n, d, m): train_gpu's streams (K = 6144) with hc_pre's 24 columns; hc_head's
# 4; K and the rows not multiples of the tiles; rows spanning several backward row groups;
# no rows at all
MIXES_CASES = ([((2, 300), 4, 1536, 24), ((37,), 4, 1536, 4), ((3, 171), 3, 200, 15), ((0, 5), 4, 64, 24)]
               if CUDA else [((2, 21), 4, 20, 24), ((37,), 3, 7, 4), ((0, 5), 4, 8, 24)])


def _bf16_truncated(t: torch.Tensor) -> torch.Tensor:
    """t in bf16 rounded toward zero (via fp32), as Triton 3.6's interpreter stores bf16."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead,n,d,m", MIXES_CASES)
def test_stream_mixes_kernel_matches_float64_reference(seed, lead, n, d, m, dtype):
    """The gates' inputs mm = flat(X) @ fn^T and nrm = |flat(X)| in one pass, against float64
    autograd: both outputs (NaN-poisoned first), the streams' gradient (the projection's and
    the norm's terms together, in the streams' dtype) and fn's (summed over row groups). A zero
    row checks the norm's gradient there (0, as torch's). The outputs' and fn's dots are
    fp32-accurate (bf16 streams: the fp32 operand split into three exact bf16 pieces; fp32
    streams: tf32x3), so they are held to fp32 summation rounding on every device; bf16
    streams' dx dot takes two pieces of each operand (~2^-16), below dx's bf16 store."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n * d, generator=g).to(dtype).float()  # rounded once: both sides see it
    if x.numel():
        x.view(-1, n * d)[min(3, x.numel() // (n * d) - 1)] = 0.0
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    ref_in = [t.double().requires_grad_() for t in (x, fn)]
    mm_ref, nrm_ref = ref_in[0] @ ref_in[1].T, ref_in[0].norm(dim=-1)
    c_mm, c_nrm = torch.randn(mm_ref.shape, generator=g), torch.randn(nrm_ref.shape, generator=g)
    ((mm_ref * c_mm.double()).sum() + (nrm_ref * c_nrm.double()).sum()).backward()
    ins = [x.to(DEV, dtype).requires_grad_(), fn.to(DEV).requires_grad_()]
    mm, nrm = mhc.stream_mixes(*ins)
    assert mm.dtype == nrm.dtype == torch.float32 and mm.shape == mm_ref.shape and nrm.shape == nrm_ref.shape
    ((mm * c_mm.to(DEV)).sum() + (nrm * c_nrm.to(DEV)).sum()).backward()
    if not x.numel():
        assert not ins[1].grad.any()
        return
    # fp32 sums of K = n d (mm, nrm) or R (fn) terms: rounding grows like sqrt(terms) ulps
    # (1.4e-6 measured at K = 6144 on an H100, where a TF32 projection errs by ~5e-4)
    k_sum, r_sum = [max(1e-6, 2 * t ** 0.5 * 2.0 ** -24) for t in (n * d, x.numel() // (n * d))]
    assert rel(mm.cpu(), mm_ref) < k_sum, "mm"
    assert rel(nrm.cpu(), nrm_ref) < k_sum, "nrm"
    assert ins[0].grad.dtype == dtype
    if dtype == torch.bfloat16:
        # dx is accurate far past its one bf16 store, so nearly every element is the float64
        # gradient as that store rounds it: ~1% differ (measured, CPU); planted, fn rounded to
        # bf16 in dx's dot (~2^-9 off) moved 52-61%, and dx's dot as one product of the first
        # pieces (kernels.mhc._dot2x2) failed too. The interpreter's store truncates.
        want = (_bf16_truncated(ref_in[0].grad) if not CUDA else ref_in[0].grad.to(dtype)).float()
        assert (ins[0].grad.float().cpu() != want).float().mean() < 0.05, "x"
    assert rel(ins[0].grad.float().cpu(), ref_in[0].grad) < (2.0 ** -8 if dtype == torch.bfloat16 else 1e-6), "x"
    assert rel(ins[1].grad.cpu(), ref_in[1].grad) < r_sum, "fn"
    with pytest.raises(ValueError, match="stream_mixes"):
        mhc.stream_mixes(ins[0], ins[1][:, 1:])


# d: the model's (each of the backward's column blocks in one stream) and one that is not
@pytest.mark.parametrize("d", [1536, 200] if CUDA else [32, 40])
@pytest.mark.parametrize("full", [True, False])
def test_hc_pre_and_head_with_fused_gates_match_float64_reference(seed, full, d, monkeypatch):
    """ops.hc_pre / ops.hc_head on the kernels (kernels.mhc.pre_streams: the projection and
    norm, the gates, the stream sum as one autograd node whose x gradient takes both uses of
    x) against float64 autograd of the unfused formula, all gradients; with hc_pre, hc_post
    reads the streams hc_pre passes through, so x's gradient takes hc_post's too (added
    inside pre_streams' backward). The mixes' K is split in parts, which the gates sum (the
    GPU's tiles split it 8 ways; the interpreter's would not split it at all)."""
    from plugins.deepseek_v4.kernels import mhc
    from plugins.deepseek_v4.ops import hc_head, hc_post, hc_pre

    if not CUDA:
        monkeypatch.setattr(mhc, "MIX_FWD", dict(mhc.MIX_FWD, SPLIT=3))
    n = 4
    m = n * (n + 2) if full else n
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, n, d, generator=g).to(DTYPE).float()  # rounded once: both sides see the same x
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    base, scale = torch.randn(m, generator=g) * 0.5, torch.rand(3 if full else 1, generator=g) + 0.5
    ref_in = [t.double().requires_grad_() for t in (x, fn, base, scale)]
    flat = ref_in[0].flatten(-2)
    mm = flat @ ref_in[1].T
    mm.retain_grad()
    refs = gates64(mm, flat.norm(dim=-1), ref_in[2], ref_in[3], n, 20, 1e-6, 1e-6, n * d)
    u = torch.einsum("bsn,bsnd->bsd", refs[0], ref_in[0])
    f = torch.randn(2, 37, d, generator=g).to(DTYPE).float()  # the sublayer's output, for hc_post
    f64 = f.double().requires_grad_()
    refs = [u, *refs[1:]]
    if full:  # X'_j = post_j f + sum_i comb[i, j] X_i
        refs.append(refs[1][..., None] * f64[..., None, :] + torch.einsum("bsij,bsid->bsjd", refs[2], ref_in[0]))
    cots = [torch.randn(r.shape, generator=g) for r in refs]
    sum((r * c.double()).sum() for r, c in zip(refs, cots, strict=True)).backward()
    ins = [x.to(DEV, DTYPE).requires_grad_()] + [t.to(DEV).requires_grad_() for t in (fn, base, scale)]
    f_in = f.to(DEV, DTYPE).requires_grad_()
    if full:
        u, post, comb, xs = hc_pre(*ins, 1e-6, 1e-6, 20, fused=True, tf32=CUDA, gates=True, streams=True)
        outs = (u, post, comb, hc_post(f_in, xs, post, comb, fused=True))
    else:
        outs = (hc_head(*ins, 1e-6, 1e-6, fused=True, tf32=CUDA, gates=True),)
    sum((o.float() * c.to(DEV)).sum() for o, c in zip(outs, cots, strict=True)).backward()
    for o, r, name in zip(outs, refs, ["u", "post", "comb", "hc_post"], strict=False):
        assert_finite(o)
        assert rel(o.float().cpu(), r) < TOL, name
    if full:
        assert rel(f_in.grad.float().cpu(), f64.grad) < TOL, "f"
    for got, want, name in zip(ins[:3], ref_in[:3], ["x", "fn", "base"], strict=True):
        assert rel(got.grad.float().cpu(), want.grad) < TOL, name
    # a scale's gradient sums over all rows (see the kernel test)
    assert within_terms(ins[3].grad, ref_in[3].grad, scale_terms(mm.grad, mm.detach(), n, scale)) < TOL, "scale"


def test_pre_streams_of_non_contiguous_streams_match_and_free_their_graph(seed):
    """mhc.pre_streams on non-contiguous streams (its fourth output is then the node's own
    contiguous copy, not a view of the input): the same bits as on a contiguous copy, every
    output and gradient (the pass-through's too); and a graph dropped without a backward is
    freed (a saved view of that copy would hold the node through its base: a cycle)."""
    import gc
    import weakref

    n, d = 4, (1536 if CUDA else 40)
    g = torch.Generator().manual_seed(seed)
    xt = torch.randn(2, n, 37, d, generator=g).to(DEV, DTYPE)  # [B, n, S, d]
    fn = (torch.randn(n * (n + 2), n * d, generator=g) * (n * d) ** -0.5).to(DEV)
    base, scale = (torch.randn(n * (n + 2), generator=g) * 0.5).to(DEV), (torch.rand(3, generator=g) + 0.5).to(DEV)
    leaves = [xt.clone().requires_grad_(), xt.transpose(1, 2).contiguous().requires_grad_()]
    runs = []
    for i, leaf in enumerate(leaves):
        x = leaf.transpose(1, 2) if i == 0 else leaf  # [B, S, n, d]; the first not contiguous
        assert x.is_contiguous() == (i == 1)
        outs = mhc.pre_streams(x, fn, base, scale, 20, 1e-6, 1e-6)
        cots = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + j)).to(DEV)
                for j, o in enumerate(outs)]
        sum((o.float() * c).sum() for o, c in zip(outs, cots, strict=True)).backward()
        grad = leaf.grad.transpose(1, 2) if i == 0 else leaf.grad
        runs.append([*(o.detach() for o in outs), grad])
    for a, b, name in zip(*runs, ["u", "post", "comb", "streams", "x's gradient"], strict=True):
        assert_finite(a)
        assert torch.equal(a, b), name
    outs = mhc.pre_streams(leaves[0].transpose(1, 2), fn, base, scale, 20, 1e-6, 1e-6)
    copy = weakref.ref(outs[3])
    del outs
    gc.collect()
    assert copy() is None, "the graph of a forward without a backward stayed alive"


@pytest.mark.parametrize("n,d,k", [(300, 1536 + 40, 6), (37, 64, 2)] if CUDA else [(9, 40, 3), (5, 8, 1)])
def test_moe_row_moves_match_the_reference(seed, n, d, k):
    """kernels.moe against ops.take_rows and float64 sums: rows gathered bit for bit (zeros at
    -1, into another dtype too), each token's k slots summed in fp32, of one [M, d] tensor or of
    two (-1 slots add nothing; a token with none gives zeros); NaN-poisoned outputs, d not a
    multiple of the tile."""
    from plugins.deepseek_v4.kernels import moe

    g = torch.Generator().manual_seed(seed)
    m = n * k + 3
    y = torch.randn(m, d, generator=g).to(DEV, DTYPE)
    idx = torch.randint(-1, n, (m,), generator=g).to(DEV)
    x = torch.randn(n, d, generator=g).to(DEV, DTYPE)
    got = moe.gather_rows(x, idx)
    assert_finite(got)
    assert torch.equal(got, ops.take_rows(x, idx)) and not got[idx < 0].any()
    assert torch.equal(moe.gather_rows(x, idx, torch.float32), ops.take_rows(x, idx).float())
    rows = torch.randperm(m, generator=g)[:n * k].to(DEV)
    rows[torch.rand(n * k, generator=g).to(DEV) < 0.3] = -1
    rows[:k] = -1  # token 0 has no slot here
    y2 = torch.randn(m, d, generator=g).to(DEV, DTYPE)
    for dtype in (torch.float32, DTYPE):
        for also in (None, y2):  # two gradients of one [M, d] tensor, summed here
            s = moe.sum_rows(y, rows, k, dtype, also=also)
            assert s.dtype == dtype
            both = y.double() + (0 if also is None else also.double())
            want = ops.take_rows(both, rows).view(n, k, d).sum(1)
            assert rel(s.cpu(), want.cpu()) < (1e-6 if dtype == torch.float32 else TOL)
            assert not s[0].any()


@pytest.mark.parametrize("n,k,n_experts,first,align", [(64, 4, 32, 0, 16), (37, 6, 5, 10, 16), (1, 2, 3, 0, 16),
                                                        (50, 3, 7, 4, 1), (0, 4, 6, 0, 16)])
def test_expert_layout_kernel_gives_the_sorted_layouts_row_maps(seed, n, k, n_experts, first, align):
    """kernels.moe.expert_layout (a decoding step's MoE layout in one program) against
    ops.expert_rows and the row maps routed_experts derives from it: group ends, counts, the
    row count, each row's pair, token and routing weight (padding rows -1 and 0) and each
    pair's row, all bit for bit; experts with no pair (their one padded block), experts owning
    many; NaN / int-min poisoned outputs, so an unwritten element shows."""
    from plugins.deepseek_v4.kernels import moe

    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, n_experts - 1, (n, k), generator=g)  # the last expert gets no pair
    hot[: n // 2] = torch.randint(0, max(1, n_experts // 3), (n // 2, k), generator=g)  # skewed
    idx = (hot + first).to(DEV)
    weight = torch.rand(n, k, generator=g).to(DEV)
    assert moe.layout_fits(n * k, n_experts) and not moe.layout_fits(4096, 64)
    offs, counts, m, pair_of_row, token_of_row, row_of_pair, wg = moe.expert_layout(idx, weight, first, n_experts,
                                                                                    align)
    pairs, rows, w_offs, w_counts, w_m = ops.expert_rows(idx, first, n_experts, True, align)
    w_pair_of_row = torch.full((w_m,), -1, dtype=torch.long, device=DEV).index_copy_(0, rows, pairs)
    w_row_of_pair = torch.full((n * k,), -1, dtype=torch.long, device=DEV).index_copy_(0, pairs, rows)
    w_token_of_row = torch.where(w_pair_of_row >= 0, w_pair_of_row // k, -1)
    w_wg = ops.take_rows(weight.flatten().float(), w_pair_of_row)
    assert w_counts[-1] == 0 and (n * k < 2 * n_experts or w_counts.max() > 1)
    assert m == w_m
    for name, a, b in [("offs", offs, w_offs), ("counts", counts, w_counts),
                       ("pair_of_row", pair_of_row, w_pair_of_row), ("token_of_row", token_of_row, w_token_of_row),
                       ("row_of_pair", row_of_pair, w_row_of_pair), ("wg", wg, w_wg)]:
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a.tolist(), b.tolist())


@pytest.mark.skipif(not CUDA, reason="the grouped GEMMs need CUDA and bf16")
def test_routed_experts_without_a_gradient_equal_the_trained_path(seed):
    """Decoding's routed experts (no gradient wanted: the layout from kernels.moe.expert_layout)
    give bit for bit what the training path (expert_rows' sort, a gradient for the routing
    weights) gives on the same inputs."""
    g = torch.Generator().manual_seed(seed)
    n, k, e, d, inter = 64, 4, 32, 256, 128
    x = torch.randn(n, d, generator=g).to(DEV, torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEV)
    weight = torch.rand(n, k, generator=g).to(DEV)
    w1, w3 = (torch.randn(e, inter, d, generator=g).to(DEV, torch.bfloat16) * 0.05 for _ in range(2))
    w2 = torch.randn(e, d, inter, generator=g).to(DEV, torch.bfloat16) * 0.05
    args = (w1, w3, w2, 0, 7.0)
    trained = ops.routed_experts(x, idx, weight.clone().requires_grad_(), *args, fused=True, fused_elementwise=True)
    with torch.no_grad():
        decoding = ops.routed_experts(x, idx, weight, *args, fused=True, fused_elementwise=True)
    assert_finite(decoding)
    assert torch.equal(decoding, trained.detach())


@pytest.mark.parametrize("n,k,n_experts", [(300, 4, 8), (37, 2, 5)])
def test_grouped_expert_gemms_match_float64_reference(seed, n, k, n_experts):
    """The fused routed-expert path (bf16 grouped GEMMs over padded expert groups, the SwiGLU
    and row-move kernels) against float64 autograd of the per-expert formula: output and the
    gradients of x, routing weights and all three weight stacks; one expert gets no token
    (its gradient is 0)."""
    d, inter, limit = 64, 96, 10.0  # V4's limit: few values sit near the clamp kinks, whose bf16
    # rounding could flip a clamp (an exact O(1) gradient difference, not a kernel error)
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n_experts - 1, generator=g)[:k] for _ in range(n)])
    idx = idx + (idx >= 1).long()  # expert 1 gets no token
    x = torch.randn(n, d, generator=g)
    wt = torch.rand(n, k, generator=g) + 0.1
    w1, w3 = (torch.randn(n_experts, inter, d, generator=g) * 0.2 for _ in range(2))
    w2 = torch.randn(n_experts, d, inter, generator=g) * 0.2
    cot = torch.randn(n, d, generator=g)
    ref_in = [t.double().requires_grad_() for t in (x, wt, w1, w3, w2)]
    xr, wr, a1, a3, a2 = ref_in
    ref = torch.zeros(n, d, dtype=torch.float64)
    for e in range(n_experts):
        h = torch.nn.functional.silu((xr @ a1[e].T).clamp(max=limit)) * (xr @ a3[e].T).clamp(-limit, limit)
        ref = ref + (wr * (idx == e)).sum(1, keepdim=True) * (h @ a2[e].T)
    (ref * cot.double()).sum().backward()
    ins = [t.to(DEV, torch.bfloat16).requires_grad_() for t in (x, w1, w3, w2)]
    wk = wt.to(DEV).requires_grad_()
    out = ops.routed_experts(ins[0], idx.to(DEV), wk, *ins[1:], 0, limit, fused=True, fused_elementwise=True)
    assert out.dtype == torch.float32
    (out * cot.to(DEV)).sum().backward()
    assert rel(out.cpu(), ref) < 2e-2
    for got, want, name in zip([ins[0].grad, wk.grad, *(t.grad for t in ins[1:])],
                               [r.grad for r in ref_in], ["x", "weight", "w1", "w3", "w2"], strict=True):
        assert rel(got.float().cpu(), want) < 2e-2, name
    assert not ins[1].grad[1].any() and not ins[3].grad[1].any()


@pytest.mark.parametrize("recompute", [False, True])
def test_experts_way_in_as_one_node_sums_both_input_gradients_in_the_gather(seed, recompute):
    """ops._ExpertsIn (the gather into expert groups and both up-projections as one node, the
    two input gradients summed per slot inside the gather's backward) against the three nodes
    it replaces (_Dispatch, grouped_matmul twice: autograd adds the two [M, d] gradients): the
    same outputs bit for bit; x's gradient the float64 sum of the same bf16 GEMM gradients to
    bf16 rounding (a dropped w3 term is O(1) off, ~0.5 of the norm); w1's and w3's gradients added into their
    main_grad (float64 to fp32 rounding), w.grad None, each weight announced once a backward;
    under recompute too (the weights' main_grad found on the forward's weights); with x and w3
    needing none, w1's gradient alone, the same bits."""
    g = torch.Generator().manual_seed(seed)
    n, k, e, d, inter = (300, 4, 8, 64, 96) if CUDA else (37, 3, 5, 24, 40)
    x0 = torch.randn(n, d, generator=g).to(DEV, torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEV)
    w0 = [(torch.randn(e, inter, d, generator=g) * 0.2).to(DEV, torch.bfloat16) for _ in range(2)]
    cot = [torch.randn(n * k + 16 * e, inter, generator=g).to(DEV, torch.bfloat16) for _ in range(2)]
    main0 = [torch.randn(e, inter, d, generator=g).to(DEV) for _ in range(2)]
    pairs, rows, offs, counts, m = ops.expert_rows(idx, 0, e, True)
    pair_of_row = torch.full((m,), -1, dtype=torch.long, device=DEV).index_copy_(0, rows, pairs)
    row_of_pair = torch.full((n * k,), -1, dtype=torch.long, device=DEV).index_copy_(0, pairs, rows)
    token_of_row = torch.where(pair_of_row >= 0, pair_of_row // k, -1)
    dg, du = (c[:m] for c in cot)

    def one(x, w1, w3):
        return ops._ExpertsIn.apply(x, w1, w3, token_of_row, row_of_pair, offs, k)

    def three(x, w1, w3):
        return ops.experts_in_nodes(x, w1, w3, token_of_row, row_of_pair, offs, counts, k, True, True)

    runs = {}
    for name, fn in (("one", one), ("three", three)):
        x = x0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in w0]
        announced = [0, 0]
        for i, w in enumerate(ws):
            w.main_grad = main0[i].clone()
            w.main_grad_ready = (lambda i=i, seen=announced: seen.__setitem__(i, seen[i] + 1))
        outs = (torch.utils.checkpoint.checkpoint(fn, x, *ws, use_reentrant=False) if recompute else fn(x, *ws))
        torch.autograd.backward(outs, [dg, du])
        assert all(w.grad is None for w in ws) and announced == [1, 1], (name, announced)
        runs[name] = (outs, x.grad, [w.main_grad for w in ws])
    # x without a gradient and w3 frozen: w1's alone, into its main_grad
    w1 = w0[0].clone().requires_grad_()
    w1.main_grad = main0[0].clone()
    torch.autograd.backward(one(x0, w1, w0[1]), [dg, du])
    assert w1.grad is None and torch.equal(w1.main_grad, runs["one"][2][0])
    (o1, gx1, mg1), (o3, gx3, _) = runs["one"], runs["three"]
    for a, b in zip(o1, o3, strict=True):
        assert_finite(a)
        assert torch.equal(a, b)
    xg = ops.take_rows(x0, token_of_row).double()
    da = (torch._grouped_mm(dg, w0[0], offs=offs).double() + torch._grouped_mm(du, w0[1], offs=offs).double())
    want = ops.take_rows(da, row_of_pair).view(n, k, d).sum(1)
    assert_finite(gx1)
    # bf16 gradients: each the float64 sum rounded once to bf16 (the three nodes: twice), 2^-9 of an
    # entry; Triton's interpreter casts fp32 to bf16 less closely than torch (2.9e-3 here against 1.6e-3)
    assert rel(gx1.float().cpu(), want.cpu()) < 2 ** -7 and rel(gx3.float().cpu(), want.cpu()) < 2 ** -7
    start = torch.cat((torch.zeros(1, dtype=torch.long, device=DEV), offs[:-1].long()))
    for i, dy in enumerate((dg, du)):
        ref = torch.stack([dy[s:t].double().t() @ xg[s:t] for s, t in zip(start.tolist(), offs.tolist(), strict=True)])
        assert_finite(mg1[i])
        assert rel((mg1[i] - main0[i]).cpu(), ref.cpu()) < 1e-5, i


# (M rows, G groups, N, K): ragged tiles everywhere; CUDA also at the ~1B expert shape
WGRAD_CASES = ([(700, 8, 192, 320), (2200, 4, 768, 1536)] if CUDA else [(50, 4, 24, 40)])


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("m,groups,n,k", WGRAD_CASES)
def test_grouped_gemm_adds_its_weight_gradient_into_main_grad(seed, m, groups, n, k, recompute):
    """ops.grouped_matmul (fused) on a weight with a main_grad: the weight gradient of every
    group, summed in fp32 from the bf16 operands, is added into main_grad (float64 of the same
    values to fp32 rounding; w.grad stays None; an empty group's slice keeps its bits) and the
    input gradient is torch's; on a weight without one, torch's grouped GEMM gradient. Under
    recompute too (non-reentrant checkpoint: the saved weight is a copy without main_grad)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 2 * m // groups, (groups,), generator=g)
    sizes[1] = 0  # a group with no rows
    ends = sizes.cumsum(0)
    ends[-1] = m  # the last group ends at M (padding rows of the model's layout)
    offs = ends.clamp(max=m).to(torch.int32)
    a0 = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w0 = (torch.randn(groups, n, k, generator=g) * 0.05).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    main0 = torch.randn(groups, n, k, generator=g)
    start = torch.cat((torch.zeros(1, dtype=torch.long), offs[:-1].long()))
    spans = list(zip(start.tolist(), offs.tolist(), strict=True))
    ref_w = torch.stack([dy[s:e].double().t() @ a0[s:e].double() for s, e in spans])
    ref_a = torch.cat([dy[s:e].double() @ w0[i].double() for i, (s, e) in enumerate(spans)])
    counts = offs.long() - start
    for with_main in (True, False):
        a = a0.to(DEV, copy=True).requires_grad_()
        w = w0.to(DEV, copy=True).requires_grad_()
        if with_main:
            w.main_grad = main0.to(DEV, copy=True)
        def run(a_, w=w):
            return ops.grouped_matmul(a_, w, offs.to(DEV), counts.to(DEV), fused=True)
        out = torch.utils.checkpoint.checkpoint(run, a, use_reentrant=False) if recompute else run(a)
        out.backward(dy.to(DEV))
        assert rel(a.grad.float().cpu(), ref_a) < 1e-2
        if with_main:
            assert w.grad is None
            got = w.main_grad.cpu()
            assert_finite(got)
            assert torch.equal(got[1], main0[1])
            assert rel(got - main0, ref_w) < 1e-5
        else:
            assert rel(w.grad.float().cpu(), ref_w) < 1e-2


@pytest.mark.parametrize("tma", [True, False])
def test_grouped_wgrad_both_loads_sum_only_each_groups_rows(seed, tma):
    """kernels.moe.add_grouped_wgrad by pointer tiles and by TMA descriptors made per group on
    the device: each group's dY^T A from its own rows only (float64 to fp32 rounding), added into
    d; an empty group's slice keeps its bits; rows past the last group's end are NaN and must
    not reach any sum (a load running past a group's end would take the next group's rows or
    those); N and K not multiples of any tile (the last tiles' columns past them masked)."""
    from plugins.deepseek_v4.kernels import moe

    g = torch.Generator().manual_seed(seed)
    m, groups, n, k = (1500, 6, 776, 1544) if CUDA else (83, 5, 24, 40)  # N, K past a whole tile
    cuts = sorted(torch.randint(1, m - 8, (groups - 1,), generator=g).tolist())
    cuts[1] = cuts[0]  # group 1 has no rows
    offs = torch.tensor(cuts + [m - 5], dtype=torch.int32)  # the last 5 rows belong to no group
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    dy[m - 5:], a[m - 5:] = float("nan"), float("nan")
    base = torch.randn(groups, n, k, generator=g)
    start = [0, *offs.tolist()[:-1]]
    ref = torch.stack([dy[s:e].double().t() @ a[s:e].double() for s, e in zip(start, offs.tolist(), strict=True)])
    d = base.to(DEV, copy=True)
    moe.add_grouped_wgrad(dy.to(DEV), a.to(DEV), offs.to(DEV), d, tma=tma)
    got = d.cpu()
    assert_finite(got)
    assert torch.equal(got[1], base[1])
    assert rel(got - base, ref) < 1e-5


@pytest.mark.skipif(not CUDA, reason="one tile config in the interpreter")
@pytest.mark.parametrize("tma", [True, False])
def test_grouped_wgrad_tiles_give_the_same_bits(seed, tma):
    """Every autotune config of the grouped weight gradient (of one load path) gives the same
    bits (the tuning may choose differently in another process: a resumed run, another rank)."""
    from plugins.deepseek_v4.kernels import moe

    g = torch.Generator().manual_seed(seed)
    m, groups, n, k = 1500, 6, 768, 1536
    offs = torch.tensor(sorted(torch.randint(0, m, (groups - 1,), generator=g).tolist()) + [m], dtype=torch.int32)
    dy = torch.randn(m, n, generator=g).to(DEV, torch.bfloat16)
    a = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    base = torch.randn(groups, n, k, generator=g).to(DEV)
    configs = moe._WGRAD_TMA_CONFIGS if tma else moe._WGRAD_CONFIGS
    if tma:
        triton.set_allocator(moe._scratch_on(DEV))
    outs = []
    for cfg in configs:
        d = base.clone()
        grid = (triton.cdiv(n, cfg.kwargs["BN"]) * triton.cdiv(k, cfg.kwargs["BK"]), groups)
        moe._grouped_wgrad.fn[grid](dy, a, offs.to(DEV), d, n, k, UPCAST=False, TMA=tma, **cfg.kwargs,
                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        outs.append(d)
    assert_finite(outs[0])
    for cfg, d in zip(configs, outs, strict=True):
        assert torch.equal(d, outs[0]), cfg


# (B, S, H, D, G): V4 head size; S, G not multiples of the tiles; a row with no chosen entry
MASS_CASES = ([(2, 300, 16, 512, 75), (1, 64, 3, 128, 9)] if CUDA else [(2, 19, 3, 32, 7), (1, 5, 2, 16, 3)])


@pytest.mark.parametrize("case", MASS_CASES)
def test_attention_mass_matches_float64_reference(seed, case):
    """The indexer's KL target (attention probability of each chosen compressed entry, summed
    over heads, from the core's lse) against float64: every element written (NaN-poisoned),
    exact zeros where not chosen (tiles with no chosen entry skipped), and the core's own
    probabilities when lse comes from it."""
    from plugins.deepseek_v4.kernels.indexer import attention_mass

    b, s, h, d, g = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen)
    ent = torch.randn(b, g, d, generator=gen)
    lse = torch.randn(b * s, h, generator=gen) * 2 + 6  # any finite lse: the formula is pointwise
    # chosen within each token's visible entries (causal, a document's start): whole tiles
    # without a chosen entry, which the kernel skips
    chosen = (torch.rand(b, s, g, generator=gen) < 0.4) & (torch.arange(g) < _entry_bounds(gen, b, s, g)[..., None])
    chosen[0, 0] = False
    qd, ed = q.to(DEV, DTYPE), ent.to(DEV, DTYPE)
    got = attention_mass(qd, ed, lse.to(DEV), chosen.to(DEV), d ** -0.5).cpu()
    logit = torch.einsum("bshd,bgd->bhsg", qd.double().cpu(), ed.double().cpu()) * d ** -0.5
    want = torch.exp(logit - lse.double().view(b, s, h).permute(0, 2, 1)[..., None]).sum(1) * chosen
    assert got.dtype == torch.float32
    assert rel(got, want) < TOL
    assert torch.equal(got[~chosen], torch.zeros(int((~chosen).sum())))


# (leading shape, n streams, d): V4's n = 4; d not a multiple of the D chunk; n = 3 (padded)
MIX_CASES = ([((2, 150), 4, 1536 + 40), ((37,), 3, 200)] if CUDA else [((2, 5), 4, 70), ((3,), 3, 9)])


@pytest.mark.parametrize("lead,n,d", MIX_CASES)
def test_stream_mixing_kernels_match_float64_reference(seed, lead, n, d):
    """mHC's stream sum u = sum_i pre_i X_i and hc_post X'_j = post_j F + sum_i comb[i, j] X_i
    (comb transposed) against float64 autograd: outputs (NaN-poisoned first) and the
    gradients of every input; bf16 streams on CUDA, fp32 under the interpreter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, d, generator=g)
    f = torch.randn(*lead, d, generator=g)
    pre = torch.rand(*lead, n, generator=g) + 0.1
    post = 2 * torch.rand(*lead, n, generator=g)
    comb = torch.rand(*lead, n, n, generator=g)
    cu, co = torch.randn(*lead, d, generator=g), torch.randn(*lead, n, d, generator=g)
    ref = [t.double().requires_grad_() for t in (x, f, pre, post, comb)]
    u_ref = torch.einsum("...n,...nd->...d", ref[2], ref[0])
    o_ref = ref[3][..., None] * ref[1][..., None, :] + torch.einsum("...ij,...id->...jd", ref[4], ref[0])
    ((u_ref * cu.double()).sum() + (o_ref * co.double()).sum()).backward()
    ins = [x.to(DEV, DTYPE).requires_grad_(), f.to(DEV, DTYPE).requires_grad_()]
    ins += [t.to(DEV).requires_grad_() for t in (pre, post, comb)]
    u = mhc.weighted_sum(ins[2], ins[0])
    o = mhc.hc_post(ins[1], ins[0], ins[3], ins[4])
    assert u.dtype == o.dtype == DTYPE
    ((u.float() * cu.to(DEV)).sum() + (o.float() * co.to(DEV)).sum()).backward()
    assert rel(u.float().cpu(), u_ref) < TOL
    assert rel(o.float().cpu(), o_ref) < TOL
    for got, want, name in zip(ins, ref, ["x", "f", "pre", "post", "comb"], strict=True):
        assert rel(got.grad.float().cpu(), want.grad) < TOL, name


# RMSNorm (leading shape, D, weight): V4's hidden and head widths; D not a power of two;
# rows not a multiple of the tile; an fp32 input with a bf16/fp32 weight (the compressor's)
NORM_CASES = ([((2, 300), 1536, True), ((3, 50, 16), 512, False), ((37,), 200, True), ((0, 8), 64, True)]
              if CUDA else [((2, 9), 48, True), ((3, 5, 2), 32, False), ((7,), 20, True), ((0, 3), 16, True)])


def _grads_vs_float64(fn_ref, fn_kernel, inputs: list[torch.Tensor], cot: torch.Tensor, dtypes: list):
    """Forward and input gradients of fn_kernel (inputs cast to dtypes, on DEV) and float64
    fn_ref of the same (rounded) input values: a bf16 rounding that moves an input across a
    clamp bound must not count as a kernel error. Returns (out, ref out, [(grad, ref grad)])."""
    ref_in = [t.detach().to(dt).double().requires_grad_() for t, dt in zip(inputs, dtypes, strict=True)]
    ref = fn_ref(*ref_in)
    (ref * cot.double()).sum().backward()
    ins = [t.detach().to(DEV, dt).clone().requires_grad_() for t, dt in zip(inputs, dtypes, strict=True)]
    out = fn_kernel(*ins)
    (out.float() * cot.to(DEV)).sum().backward()
    return out, ref, [(a.grad, b.grad) for a, b in zip(ins, ref_in, strict=True)]


@pytest.mark.parametrize("lead,d,weighted", NORM_CASES)
def test_rms_norm_kernel_matches_float64_reference(seed, lead, d, weighted):
    """The fused RMSNorm against float64 autograd of the formula: output (NaN-poisoned first)
    in the input's dtype, the input gradient and the weight gradient (per-program partials
    summed); bf16 on CUDA, fp32 under the interpreter; and an fp32 input with a bf16 weight."""
    from plugins.deepseek_v4.kernels import elementwise as ew

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g) * 3 + 0.5
    w = torch.rand(d, generator=g) + 0.5
    cot = torch.randn(*lead, d, generator=g)

    def ref(a, b=None):
        y = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * b if b is not None else y

    for x_dt, w_dt in ((DTYPE, DTYPE), (torch.float32, DTYPE)):
        ins, dts = ([x, w], [x_dt, w_dt]) if weighted else ([x], [x_dt])
        out, want, grads = _grads_vs_float64(ref, lambda a, b=None: ew.rms_norm(a, b, 1e-6), ins, cot, dts)
        assert out.dtype == x_dt and out.shape == x.shape
        if not x.numel():
            continue
        tol = TOL if DTYPE != torch.float32 and torch.bfloat16 in (x_dt, w_dt) else 2e-5
        assert rel(out.float().cpu(), want) < tol
        for (got, exp), name in zip(grads, ["x", "weight"], strict=False):
            assert got.dtype == (x_dt if name == "x" else w_dt)
            assert rel(got.float().cpu(), exp) < tol, name


# RoPE (x shape, cos shape): queries [B, S, H, D] with cos [B, S, 1, rd/2]; keys [B, S, D];
# an all-rotated row (D = rd); decoding's [B, 1, H, D] with cos [B, 1, 1, rd/2]; 3 pairs (the
# kernels' pair tile is a power of two wider)
ROPE_CASES = ([((2, 300, 16, 512), (2, 300, 1, 32)), ((2, 77, 512), (2, 77, 32)), ((3, 40, 64), (3, 40, 32)),
               ((5, 1, 16, 512), (5, 1, 1, 32)), ((2, 33, 3, 70), (2, 33, 1, 3))]
              if CUDA else [((2, 7, 3, 24), (2, 7, 1, 4)), ((2, 9, 16), (2, 9, 4)), ((3, 5, 8), (3, 5, 4)),
                            ((4, 1, 2, 12), (4, 1, 1, 2)), ((2, 5, 3, 10), (2, 5, 1, 3))])


@pytest.mark.parametrize("xs,cs", ROPE_CASES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_matches_float64_reference(seed, xs, cs, inverse):
    """The fused RoPE against float64 autograd of ops.apply_rope: output (NaN-poisoned first),
    the unrotated columns copied bit for bit, the input gradient; cos/sin broadcast over heads.
    In place the same bits, and with its columns kept and put back, x as it was."""
    from plugins.deepseek_v4.kernels import elementwise as ew

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*xs, generator=g)
    ang = torch.rand(*cs, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    cot = torch.randn(*xs, generator=g)
    out, want, [(gx, gx_ref)] = _grads_vs_float64(
        lambda a: ops.apply_rope(a, cos.double(), sin.double(), inverse),
        lambda a: ew.apply_rope(a, cos.to(DEV), sin.to(DEV), inverse), [x], cot, [DTYPE])
    assert out.dtype == DTYPE
    assert rel(out.float().cpu(), want) < TOL
    assert rel(gx.float().cpu(), gx_ref) < TOL
    keep = xs[-1] - 2 * cs[-1]
    assert torch.equal(out[..., :keep].cpu(), x[..., :keep].to(DTYPE))
    # in place (as on a backward's fresh gradient): the same bits
    y = x.to(DEV, DTYPE, copy=True)
    assert ew.apply_rope_(y, cos.to(DEV), sin.to(DEV), inverse) is y
    assert torch.equal(y.cpu(), out.detach().cpu())
    # in place with the rotated columns kept (ops._unroped, the attention output's way out): the
    # same bits, the columns as they were (into a NaN-poisoned buffer), and put back bit for bit
    z = x.to(DEV, DTYPE, copy=True)
    kept = ew.rope_kept_(z, cos.to(DEV), sin.to(DEV), inverse)
    assert torch.equal(z.cpu(), out.detach().cpu())
    assert kept.shape == (*xs[:-1], 2 * cs[-1]) and torch.equal(kept.cpu(), x[..., keep:].to(DTYPE))
    assert ew.put_rotated_(z, kept) is z and torch.equal(z.cpu(), x.to(DTYPE))


@pytest.mark.parametrize("xs,cs", [c for c in ROPE_CASES if len(c[0]) == 4])  # queries [B, S, H, D]
def test_norm_rope_on_the_kernels_matches_float64_reference(seed, xs, cs):
    """ops.norm_rope on the kernels (one kernel each way: the norm and the rotation in
    registers, the backward from the kept output and rstd) against float64 autograd of the
    weightless norm then the rotation: output (NaN-poisoned first) and the input gradient; rows
    of different scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*xs, generator=g) * (torch.rand(*xs[:-1], 1, generator=g) * 4 + 0.2)
    ang = torch.rand(*cs, generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    cot = torch.randn(*xs, generator=g)

    def ref(a):
        return ops.apply_rope(a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6), cos.double(), sin.double())

    out, want, [(gx, gx_ref)] = _grads_vs_float64(
        ref, lambda a: ops.norm_rope(a, cos.to(DEV), sin.to(DEV), 1e-6, fused=True), [x], cot, [DTYPE])
    assert out.dtype == gx.dtype == DTYPE
    assert rel(out.float().cpu(), want) < TOL
    assert rel(gx.float().cpu(), gx_ref) < TOL


SWIGLU_CASES = [(300, 768, True), (45, 200, False), (0, 64, True)] if CUDA else [(9, 40, True), (5, 13, False)]


@pytest.mark.parametrize("m,i,weighted", SWIGLU_CASES)
def test_swiglu_kernel_matches_float64_reference(seed, m, i, weighted):
    """The fused clamped SwiGLU times the routing weight against float64 autograd: output
    (NaN-poisoned first) in the asked dtype, gradients of g, u and the weight; values on both
    sides of the clamps (limit 1.5, so many are clamped)."""
    from plugins.deepseek_v4.kernels import elementwise as ew

    limit = 1.5
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, i, generator=g) * 2, torch.randn(m, i, generator=g) * 2
    w = torch.rand(m, generator=g) + 0.1
    cot = torch.randn(m, i, generator=g)

    def ref(x, y, ww=None):
        h = torch.nn.functional.silu(x.clamp(max=limit)) * y.clamp(-limit, limit)
        return h * ww[:, None] if ww is not None else h

    ins, dts = ([a, b, w], [DTYPE, DTYPE, torch.float32]) if weighted else ([a, b], [DTYPE, DTYPE])
    out, want, grads = _grads_vs_float64(
        ref, lambda x, y, ww=None: ew.swiglu(x, y, limit, ww, DTYPE), ins, cot, dts)
    assert out.dtype == DTYPE and out.shape == (m, i)
    if not m:
        return
    assert rel(out.float().cpu(), want) < TOL
    for (got, exp), name in zip(grads, ["g", "u", "weight"], strict=False):
        assert got.dtype == (torch.float32 if name == "weight" else DTYPE)
        assert rel(got.float().cpu(), exp) < TOL, name


# (T, H, non-RoPE width dn, RoPE width r, K, pool N): V4's K = V (448 + 64) and the 1b config's
# (192 + 64: three scale blocks); on CPU a width that is no power of two (one block) and 1b's
FP8_SHAPES = ([(37, 64, 448, 64, 640 + 3, 900), (64, 16, 192, 64, 20, 80)] if CUDA
              else [(9, 5, 48, 16, 21, 40), (4, 16, 192, 64, 7, 12)])


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_pool_kernel_matches_attention_over_the_dequantized_rows(seed, shape):
    """The decoding kernel over an FP8 key pool read in place (codes, per-block scales, RoPE
    channels) against float64 attention over the rows fp8_kv_dequant gives, and against the
    plain kernel over those rows: outputs start as NaN, the empty row gives zeros, and every
    finite e4m3 code (subnormals, both signs) is in rows the second token reads."""
    t, h, dn, r, k, n = shape
    q, _, idx, sink = make(seed, t, h, dn + r, k, n)
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randn(n, dn + r, generator=g) * torch.logspace(-2, 2, dn + r)[torch.randperm(dn + r, generator=g)]
    codes, scales = ops.fp8_kv_quant(x, r)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    codes.view(-1)[:finite.numel()] = finite
    every = -(-finite.numel() // dn)  # the rows holding them
    idx[1, :every] = torch.arange(every, dtype=idx.dtype)
    rope = x[:, dn:].to(DTYPE)
    rows = torch.cat((ops.fp8_kv_dequant(codes, scales, DTYPE), rope), -1)  # [N, dn + r]
    assert torch.isfinite(rows).all() and rows[:every].abs().min() == 0
    scale = (dn + r) ** -0.5
    o_ref, lse_ref = ops.sparse_attention_indexed(q.double(), rows.double(), idx, sink.double(), scale)
    qd, sk = q.to(DEV, DTYPE), sink.to(DEV)
    o, lse = sa.sparse_attention_fp8(qd, codes.to(DEV), scales.to(DEV), rope.to(DEV), idx.to(DEV), sk, scale)
    assert o.dtype == DTYPE and o.shape == (t, h, dn + r)
    assert rel(o.float().cpu(), o_ref) < TOL and rel(lse.cpu(), lse_ref) < TOL
    assert torch.equal(o[0].float().cpu(), torch.zeros(h, dn + r))
    o_plain, _ = sa.sparse_attention(qd, rows.to(DEV), idx.to(DEV), sk, scale)
    assert rel(o.float().cpu(), o_plain.float().cpu()) < TOL


def test_non_power_of_two_head_dim_is_refused():
    """A head dim the kernel cannot tile is a clear error, not a wrong answer."""
    q, kv, idx, sink = make(0, 4, 16, 48, 5, 10)
    with pytest.raises(ValueError, match="power of two"):
        sa.sparse_attention(q.to(DEV), kv.to(DEV), idx.to(DEV), sink.to(DEV), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_training_step_with_kernels_matches_reference(seed, dtype):
    """A full tiny-model forward+backward (all features: SWA/CSA/HCA, indexer KL, MTP) with
    the Triton attention core matches the PyTorch path: losses and every gradient (fp32),
    losses and the whole gradient vector (bf16: per-tensor comparison is ill-posed there,
    as rounding differences flip discrete MoE/indexer top-k choices for a few tokens)."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("bf16 model parity runs on CUDA")
    from conftest import TINY_EACH_ONCE, random_ids, tiny_model

    from miles.train import losses
    from miles.train.batching import MicroBatch
    from plugins.deepseek_v4.model import IGNORE_INDEX

    # CPU (Triton's interpreter, the suite's slowest test): one row of 36 still crosses two
    # HCA blocks and the sliding window, through one block of each attention kind; CUDA takes
    # two rows of 40 through the whole tiny preset.
    ids = random_ids(seed, *((2, 40) if CUDA else (1, 36))).to(DEV)
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    runs = {}
    for backend in ("torch", "triton"):
        model = tiny_model(seed, dtype=dtype, kernels=backend, **({} if CUDA else TINY_EACH_ONCE)).to(DEV).train()
        _, res = losses.compute(model, MicroBatch.lm(ids, lab))
        res.loss.backward()
        runs[backend] = (res.metrics, {k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    (l_ref, g_ref), (l_k, g_k) = runs["torch"], runs["triton"]
    bf16 = dtype == torch.bfloat16
    for k in ("lm_loss", "mtp_loss", "indexer_loss", "loss"):
        # bf16 on H100, 8 seeds: lm/mtp/total within 1e-4; the indexer KL (a small divergence of
        # two close distributions built from bf16 probabilities) within 1.7e-2.
        tol = (0.05 if k == "indexer_loss" else 2e-2) if bf16 else 2e-5
        assert rel(l_k[k].float().cpu(), l_ref[k].float().cpu()) < tol, k
    if bf16:
        # A routing flip can give an expert tokens in one run only: missing gradient = zero.
        names = sorted(set(g_ref) | set(g_k))

        def flat(g):
            return torch.cat([g[n].double().cpu().flatten() if n in g else
                              torch.zeros(g_ref.get(n, g_k.get(n)).numel(), dtype=torch.float64) for n in names])

        # measured 0.018-0.043 over 8 seeds (bf16 rounding + routing flips); a kernel bug is O(1)
        assert rel(flat(g_k), flat(g_ref)) < 0.1
        return
    assert g_ref.keys() == g_k.keys()
    ref = {k: g.double().cpu() for k, g in g_ref.items()}
    got = {k: g.double().cpu() for k, g in g_k.items()}
    # Gradients that are sums of many cancelling terms (mHC head scale/base) have norms ~1e-6
    # of the largest; judge each tensor against its norm plus 1e-3 of the largest norm.
    for g in [*ref.values(), *got.values()]:
        assert_finite(g)
    floor = 1e-3 * max(g.norm() for g in ref.values())
    errs = {k: ((got[k] - ref[k]).norm() / (ref[k].norm() + floor)).item() for k in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] < 1e-4, f"worst gradient error {errs[worst]:.2e} in {worst}"


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_fp32_projection_on_tf32_tensor_cores_matches_float64(seed, w_dtype):
    """ops.fp32_linear, the fp32 projections of a bf16 model (compressor, gate, LM/MTP heads
    with bf16 weights; the mHC mixes with an fp32 one): on TF32 tensor cores the output and
    both gradients stay as close to float64 as the IEEE fp32 path (bf16 products are exact
    in TF32; only fp32 operands and the backward's fp32 gradient are rounded). On CPU the
    flag is inert and the function equals autograd through F.linear of fp32 copies."""
    g = torch.Generator().manual_seed(seed)
    n, k, m = 301, 1536, 1000 if w_dtype == torch.bfloat16 else 24  # asymmetric, K as in the ~1B config
    x0 = torch.randn(2, n, k, generator=g).to(torch.bfloat16)
    w0 = (torch.randn(m, k, generator=g) * 0.02).to(w_dtype)
    gy = torch.randn(2, n, m, generator=g)

    def run(tf32: bool | None):
        x = x0.to(DEV, copy=True).requires_grad_()
        w = w0.to(DEV, copy=True).requires_grad_()
        y = (torch.nn.functional.linear(x.float(), w.float()) if tf32 is None
             else ops.fp32_linear(x, w, tf32))
        y.backward(gy.to(DEV))
        return y.double().cpu(), x.grad.double().cpu(), w.grad.double().cpu()

    x64, w64, g64 = x0.double().requires_grad_(), w0.double().requires_grad_(), gy.double()
    y64 = x64 @ w64.t()
    y64.backward(g64)
    ref = (y64.detach(), x64.grad, w64.grad)
    ieee, tf32, plain = run(False), run(True), run(None)
    for name, a, b, c, r in zip(("y", "dx", "dw"), ieee, tf32, plain, ref, strict=True):
        e_ieee, e_tf32, e_plain = rel(a, r), rel(b, r), rel(c, r)
        assert e_ieee <= e_plain * 1.01 + 1e-7, (name, e_ieee, e_plain)  # the saved-input form costs nothing
        # bf16 outputs (dx, dw of bf16 weights) carry 2^-9 roundings; y and fp32 dw stay near fp32
        bound = 2 * e_ieee + (1e-3 if CUDA else 1e-7)
        assert e_tf32 <= bound, f"{name}: TF32 error {e_tf32:.2e} against IEEE {e_ieee:.2e}"
        if not CUDA:
            assert torch.equal(a, b), name


# (B, S, h, d, G): V4's indexer (16 heads of 128) over the ~1B benchmark's 4096 tokens and
# 1024 entries on CUDA; token and entry counts off the tiles and off the 32-entry gate words,
# several token splits of dk; no entries at all
SCORE_CASES = ([(1, 4096, 16, 128, 1024), (1, 700, 16, 128, 175), (2, 37, 3, 64, 11), (1, 5, 2, 16, 0)] if CUDA
               else [(2, 37, 3, 16, 11), (1, 100, 2, 32, 150), (1, 5, 2, 16, 0)])


@pytest.mark.parametrize("shape", [(2, 37, 5, 128), (70, 64), (70, 16)] if CUDA else [(2, 9, 3, 32), (5, 16)])
def test_hadamard_kernel_matches_float64_reference(seed, shape):
    """kernels.indexer.hadamard (the indexer q's rotation: a bf16 dot with the +-1 entries,
    the 1 / sqrt(n) on the fp32 sums) against float64 x @ H / sqrt(n) for bf16 x of different
    scales: the output (NaN-poisoned first) float64's rounded to bf16 but for near-ties (on
    CUDA; the interpreter's casts truncate: within 2^-7), the gradient likewise (the same
    rotation: H is symmetric), rows past the program's tile, ops.hadamard(fused) routing
    bf16 to it and fp32 past it."""
    from plugins.deepseek_v4.kernels import indexer

    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x0 = (torch.randn(*shape, generator=g) * (torch.rand(*shape[:-1], 1, generator=g) * 8 + 0.1)).to(torch.bfloat16)
    cot = torch.randn(*shape, generator=g).to(torch.bfloat16)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / math.sqrt(n)
    x = x0.to(DEV).requires_grad_()
    y = ops.hadamard(x, fused=True)
    assert y.dtype == torch.bfloat16 and y.grad_fn is not None and "Hadamard" in type(y.grad_fn).__name__
    y.backward(cot.to(DEV))
    assert_finite(y, x.grad)
    for got, want, name in ((y, x0.double() @ h, "y"), (x.grad, cot.double() @ h, "dx")):
        got = got.detach().cpu()
        if CUDA:
            off = (got != want.to(torch.bfloat16)).double().mean().item()
            assert off < 0.01, f"{name}: {off:.2%} off float64 rounded to bf16"
        assert rel(got.double(), want) < (2.0 ** -8 if CUDA else 2.0 ** -7), name
    with pytest.raises(ValueError, match="hadamard kernel"):
        indexer.hadamard(x0.float().to(DEV), ops._hadamard_signs(n, x.device))
    xf = x0.float().to(DEV)
    assert torch.equal(ops.hadamard(xf, fused=True), ops.hadamard(xf))  # fp32: the torch path


def _entry_bounds(gen: torch.Generator, b: int, s: int, g: int) -> torch.Tensor:
    """hi [B, S] int32 as a packed row's visibility gives it: causal (entry e complete after
    token (e + 1) r - 1, r = S / G), none visible for a stretch after a random document start,
    and some rows bounded off the tiles' and gate words' edges."""
    r = max(1, s // max(g, 1))
    hi = ((torch.arange(s) + 1) // r).clamp(max=g).expand(b, s).clone()
    for row in range(b):
        start = int(torch.randint(1, max(2, s - 1), (1,), generator=gen))
        hi[row, start:start + max(1, s // 7)] = 0
    return hi.to(torch.int32)


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("prec", ["tf32x3", "split3", "bf16x3"])
@pytest.mark.parametrize("b,s,h,d,g", SCORE_CASES)
def test_indexer_scores_kernel_matches_float64_reference(seed, b, s, h, d, g, prec, bounded, monkeypatch):
    """The lightning indexer's scores sum_h w relu(q_h . k_g) as one kernel each way, against
    float64: the scores (NaN-poisoned first) to fp32 rounding; the relu gate the forward kept
    (its bits) equal to float64's signs wherever rounding cannot flip one (|q . k| above 1e-3
    of |q| |k|); and the gradients of q, k (summed over token splits) and w to fp32 rounding
    against float64 autograd of the formula through that gate. Through float64's own gate the
    gradients would be off by whole terms at the few dots within rounding of 0 (at the ~1B
    shape 5e-5 to 6e-4 relative, with either fp32-accurate dot: relu's derivative jumps
    there), which is no defect of the kernel. fp32 inputs, or bf16 q as the model passes it
    (b == 1; its gradient then comes back in bf16). Bounded: entries past each token's bound hi
    (causal, a document's start) score exactly 0 with their gates off, whole tiles past every
    bound of their tokens skipped, and no gradient through them."""
    from plugins.deepseek_v4.kernels import indexer

    monkeypatch.setattr(indexer, "SCORE_PREC", prec)
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, h, d, generator=gen), torch.randn(b, g, d, generator=gen)
    w = torch.randn(b, s, h, generator=gen) * h ** -0.5
    cot = torch.randn(b, s, g, generator=gen)
    hi = _entry_bounds(gen, b, s, g) if bounded else torch.full((b, s), g, dtype=torch.int32)
    seen = torch.arange(g) < hi[..., None]  # [B, S, G]
    q = q.bfloat16() if b == 1 else q
    ins = [t.to(DEV).requires_grad_() for t in (q, k, w)]
    out = indexer.indexer_scores(*ins, hi.to(DEV) if bounded else None)
    assert out.dtype == torch.float32 and out.shape == (b, s, g)
    bits = out.grad_fn.saved_tensors[3].cpu()  # [B, S, h, ceil(G / 32)] int32, entry 32 c + j at bit j of word c
    (out * cot.to(DEV)).sum().backward()
    if not g:
        assert not ins[0].grad.any() and not ins[2].grad.any()
        return
    assert_finite(out)
    gate = ((bits[..., None] >> torch.arange(32)) & 1).flatten(-2)[..., :g].bool()  # [B, S, h, G]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, w)]  # (on CPU, ins are q, k, w)
    dots = torch.einsum("bshd,bgd->bshg", ref_in[0], ref_in[1])  # [B, S, h, G]
    with torch.no_grad():
        ref = torch.einsum("bsh,bshg->bsg", ref_in[2], torch.relu(dots)) * seen
        sure = dots.abs() > 1e-3 * ref_in[0].norm(dim=-1)[..., None] * ref_in[1].norm(dim=-1)[:, None, None]
        sure &= seen[:, :, None, :]
    assert rel(out.cpu(), ref) < 1e-6, "scores"
    assert not out.cpu()[~seen].any() and not gate[~seen[:, :, None, :].expand_as(gate)].any(), "past the bounds"
    assert sure.float().mean() > 0.95 * seen.float().mean() and torch.equal(gate[sure], (dots > 0)[sure]), "relu gate"
    (torch.einsum("bsh,bshg->bsg", ref_in[2], dots * gate) * cot.double()).sum().backward()
    for got, want, name in zip(ins, ref_in, ["q", "k", "w"], strict=True):
        assert got.grad.dtype == got.dtype, name
        assert rel(got.grad.cpu(), want.grad) < (2 ** -8 if got.dtype == torch.bfloat16 else 1e-6), name
    with pytest.raises(ValueError, match="indexer_scores"):
        indexer.indexer_scores(ins[0], ins[1][..., 1:], ins[2])


def test_bf16_products_are_exact_products_summed_in_fp32(seed):
    """ops.bf16_products (the bf16 x bf16 projections' forward with tf32 on: heads, gate,
    compressor) on CUDA: the fp32 result of the same bf16 values in float64 to fp32 summation
    rounding (~sqrt(K) ulps), which a GEMM rounding its output or its sums to bf16 (2^-9)
    misses by far. Elsewhere (CPU, fp32 operands) it declines (None) and fp32_linear runs."""
    g = torch.Generator().manual_seed(seed)
    n, k, m = 301, 1536, 1000  # the ~1B config's width, rows and columns not multiples of a tile
    x = torch.randn(2, n, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)
    assert ops.bf16_products(x.float().to(DEV), w.float().to(DEV)) is None
    if not CUDA:
        assert ops.bf16_products(x, w) is None
        return
    y = ops.bf16_products(x.to(DEV), w.to(DEV))
    assert y.dtype == torch.float32 and y.shape == (2, n, m)
    assert rel(y.cpu(), x.double() @ w.double().t()) < 2 * k ** 0.5 * 2.0 ** -24


def test_split_bf16_is_two_bf16_terms_and_the_kernel_gives_the_same_bits(seed):
    """ops.split_bf16: hi is the cast to bf16 (round to nearest even), hi + lo is g to 2^-17
    relative, over magnitudes from 1e-30 to 1e30, zeros and a column count off every tile;
    the kernel (NaN-poisoned output) gives the same bits on CUDA."""
    g = torch.Generator().manual_seed(seed)
    r, n = 37, 301
    x = torch.randn(r, n, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, n, dtype=torch.float64)
    x = x.float()
    x[0, :2] = torch.tensor([0.0, -0.0])
    ref = ops.split_bf16(x)
    assert ref.dtype == torch.bfloat16 and ref.shape == (r, 2 * n)
    hi, lo = ref[:, :n], ref[:, n:]
    assert torch.equal(hi, x.to(torch.bfloat16))
    err = (hi.double() + lo.double() - x.double()).abs()
    assert (err <= x.double().abs() * 2.0 ** -17).all(), err.max().item()
    got = ops.split_bf16(x.to(DEV), fused=True).cpu()
    if CUDA:
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    else:  # the interpreter's casts to bf16 truncate: hi within an ulp, hi + lo to 2^-15
        assert_finite(got)
        err = (got[:, :n].double() + got[:, n:].double() - x.double()).abs()
        assert (err <= x.double().abs() * 2.0 ** -15).all(), err.max().item()
        assert ((got[:, :n].double() - x.double()).abs() <= x.double().abs() * 2.0 ** -7).all()


@pytest.mark.skipif(not CUDA, reason="the split products run on CUDA only")
def test_split_products_round_like_float64(seed):
    """ops.split_products, the bf16 fp32 projections' backward (compressor, gate): dx, and dw
    rounded to bf16 as a weight without main_grad gets it, are float64's rounded to bf16 but
    for near-ties (measured 0.25% of elements on CPU in float64; rounding g to TF32 first, as
    the TF32 path did, gives 10%, dropping the lo term 43%); dw itself comes in fp32 (what
    main_grad takes) within 1e-4 of float64 (the split's 2^-17, summed)."""
    g = torch.Generator().manual_seed(seed)
    n, k, m = 301, 1536, 1000
    x = torch.randn(2, n, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)
    gy = torch.randn(2, n, m, generator=g)
    gx, gw = ops.split_products(gy.to(DEV), x.to(DEV), w.to(DEV), (True, True))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32 and gx.shape == x.shape and gw.shape == w.shape
    gx64 = gy.double() @ w.double()
    gw64 = gy.double().reshape(-1, m).t() @ x.double().reshape(-1, k)
    assert_finite(gw)
    assert ((gw.cpu().double() - gw64).abs() <= 1e-4 * gw64.abs() + 1e-5 * gw64.abs().max()).all(), "dw in fp32"
    for name, a, ref in (("dx", gx, gx64), ("dw", gw.to(torch.bfloat16), gw64)):
        a = a.cpu()
        assert_finite(a)
        off = (a != ref.to(torch.bfloat16)).double().mean().item()
        assert off < 0.01, f"{name}: {off:.2%} of elements differ from float64 rounded to bf16"
    assert ops.split_products(gy, x.float(), w.float(), (True, True)) is None  # fp32 operands: declined


@pytest.mark.skipif(not CUDA, reason="TF32 exists on CUDA only")
def test_bf16_model_with_tf32_projections_is_as_close_to_fp32_as_without(seed):
    """The whole bf16 training step (kernels on, tiny model with every feature) with the
    fp32 projections on TF32 tensor cores is as close to the fp32 model as with IEEE fp32
    products: losses and the whole gradient vector, against the fp32 run of the same weights."""
    from conftest import random_ids, tiny_model

    from miles.train import losses
    from miles.train.batching import MicroBatch
    from plugins.deepseek_v4.model import IGNORE_INDEX

    ids = random_ids(seed, 2, 40).to(DEV)
    lab = torch.roll(ids, -1, 1)
    lab[:, -1] = IGNORE_INDEX
    runs = {}
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("ieee", torch.bfloat16, False),
                              ("tf32", torch.bfloat16, True)):
        model = tiny_model(seed, dtype=dtype, kernels="triton", tf32_projections=tf32).to(DEV).train()
        _, res = losses.compute(model, MicroBatch.lm(ids, lab))
        res.loss.backward()
        names = sorted(n for n, p in model.named_parameters())
        grads = torch.cat([p.grad.double().cpu().flatten() if p.grad is not None else
                           torch.zeros(p.numel(), dtype=torch.float64) for n, p in sorted(model.named_parameters())])
        runs[name] = ({k: v.float().cpu() for k, v in res.metrics.items()}, grads, names)
    (l_ref, g_ref, _), (l_ieee, g_ieee, _), (l_tf32, g_tf32, _) = runs["fp32"], runs["ieee"], runs["tf32"]
    for k in ("lm_loss", "mtp_loss", "loss"):
        e_ieee, e_tf32 = rel(l_ieee[k], l_ref[k]), rel(l_tf32[k], l_ref[k])
        assert e_tf32 <= 2 * e_ieee + 2e-3, f"{k}: TF32 {e_tf32:.2e} against IEEE {e_ieee:.2e}"
    e_ieee, e_tf32 = rel(g_ieee, g_ref), rel(g_tf32, g_ref)
    assert e_tf32 <= 1.5 * e_ieee + 1e-2, f"gradients: TF32 {e_tf32:.2e} against IEEE {e_ieee:.2e}"
    print(f"bf16 vs fp32 gradient error: IEEE projections {e_ieee:.3e}, TF32 {e_tf32:.3e}")


# (rows, vocabulary): several tiles with a ragged last one, one tile
HEAD_CASES = [(300, 32768 + 5), (37, 1000)] if CUDA else [(9, 3 * 64 + 7), (4, 40)]


@pytest.mark.parametrize("r,v", HEAD_CASES)
def test_head_softmax_kernels_match_float64_reference(seed, r, v):
    """kernels.cross_entropy against float64: each row's max (exact), sum of exponentials and
    log-sum-exp, the label's logit (exact) from one read of fp32 logits (NaN-poisoned outputs),
    rows of very different scales and offsets (the running max must rescale the sum); the
    in-place gradient -g softmax(z) + hit onehot(label), hit = 0 on some rows (labels on
    another TP rank's shard)."""
    from plugins.deepseek_v4.kernels import cross_entropy as ce

    g = torch.Generator().manual_seed(seed)
    scale, shift = torch.rand(r, 1, generator=g) * 20 + 0.1, torch.randn(r, 1, generator=g) * 50
    z = torch.randn(r, v, generator=g) * scale + shift
    z[0, -1] += 80  # one row's maximum in its last, ragged tile
    ids = torch.randint(0, v, (r,), generator=g)
    ids[1] = v - 1
    gr = torch.randn(r, generator=g)
    hit = torch.where(torch.rand(r, generator=g) < 0.7, gr, torch.zeros(r))
    m, s, pick = ce.row_stats(z.to(DEV), ids.to(DEV))
    assert_finite(m, s, pick)
    zd = z.double()
    lse_ref = torch.logsumexp(zd, -1)
    assert torch.equal(m.cpu(), z.amax(-1)) and torch.equal(pick.cpu(), z.gather(-1, ids[:, None])[:, 0])
    lse = m + torch.log(s)
    assert ((lse.double().cpu() - lse_ref).abs() / lse_ref.abs().clamp_min(1)).max() < 1e-6
    dz = z.to(DEV)
    ce.softmax_grad_(dz, lse, ids.to(DEV), gr.to(DEV), hit.to(DEV))
    ref = -gr.double()[:, None] * torch.softmax(zd, -1)
    ref[torch.arange(r), ids] += hit.double()
    assert rel(dz.cpu(), ref) < 1e-5
    assert (dz.cpu().double() - ref).abs().max() < 1e-5 * gr.abs().max()


@pytest.mark.parametrize("r,v", HEAD_CASES)
@pytest.mark.parametrize("terms", [1, 2])
def test_head_gradient_terms_are_the_in_place_gradients_bits(seed, r, v, terms):
    """kernels.cross_entropy.softmax_grad_terms, the head backward's bf16 GEMM operand written
    from the logits in one pass: bit for bit softmax_grad_'s fp32 gradient rounded to bf16 (one
    term) or split hi | lo (ops.split_bf16's kernel, two terms), into a NaN-poisoned out; the
    logits left as they were."""
    from plugins.deepseek_v4.kernels import cross_entropy as ce

    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(r, v, generator=g) * (torch.rand(r, 1, generator=g) * 20 + 0.1)).to(DEV)
    ids = torch.randint(0, v, (r,), generator=g).to(DEV)
    gr = torch.randn(r, generator=g).to(DEV)
    hit = torch.where(torch.rand(r, generator=g).to(DEV) < 0.7, gr, 0.0)
    m, s, _ = ce.row_stats(z, ids)
    lse = m + torch.log(s)
    dz = z.clone()
    ce.softmax_grad_(dz, lse, ids, gr, hit)
    # the split kernel: on CUDA torch's cast and split bit for bit (its own test); the
    # interpreter's casts truncate, alike in both kernels
    want = ops.split_bf16(dz, fused=True)[:, :terms * v]
    out = torch.full((r, terms * v), float("nan"), device=DEV, dtype=torch.bfloat16)
    z0 = z.clone()
    got = ce.softmax_grad_terms(z, lse, ids, gr, hit, out)
    assert got is out and torch.equal(z, z0)
    assert_finite(got)
    assert torch.equal(got.cpu(), want.cpu())
    with pytest.raises(ValueError, match="softmax_grad_terms"):
        ce.softmax_grad_terms(z, lse, ids, gr, hit, out.float())


@pytest.mark.parametrize("tp_rank", [None, 0, 1])
def test_fused_head_matches_the_torch_head_on_one_and_tp_ranks(seed, tp_rank, monkeypatch):
    """The chunked head with the log-softmax kernels against its own torch path in one process:
    one rank (labels -100 and past V clamped, as cross-entropy reads them) and a TP rank's
    arithmetic (ParallelContext(tp_size=2, tp_rank): its sums over ranks are identities here,
    so both paths work on this shard alone), labels on this shard, on the other one and
    ignored; log-probabilities and the gradients of y and w over 3 chunks."""
    from plugins.deepseek_v4 import parallel
    from plugins.deepseek_v4.parallel import ParallelContext, VocabHead

    n, d, v = (300, 256, 1000) if CUDA else (50, 16, 70)
    monkeypatch.setattr(parallel, "HEAD_CHUNK_ELEMENTS", (n // 3 + 1) * v)
    g = torch.Generator().manual_seed(seed)
    y0, w0 = torch.randn(n, d, generator=g).to(DTYPE), (torch.randn(v, d, generator=g) * 0.3).to(DTYPE)
    labels = torch.randint(0, 2 * v, (n,), generator=g)
    labels[::7] = -100
    cot = torch.randn(n, generator=g)
    ctx = ParallelContext() if tp_rank is None else ParallelContext(tp_size=2, tp_rank=tp_rank)
    runs = []
    for fused in (False, True):
        y, w = y0.to(DEV, copy=True).requires_grad_(), w0.to(DEV, copy=True).requires_grad_()
        lp = ctx.head_logprobs(VocabHead(y, w, ctx, False, fused), labels.to(DEV))
        (lp * cot.to(DEV)).sum().backward()
        runs.append([t.detach().double().cpu() for t in (lp, y.grad, w.grad)])
    for name, a, b in zip(("logprobs", "d y", "d w"), runs[1], runs[0], strict=True):
        assert rel(a, b) < (TOL if name != "logprobs" else 1e-5), name
    assert runs[0][2].abs().sum() > 0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tf32", [False, True])
def test_chunked_head_logprobs_match_the_full_logits(seed, tf32, fused, monkeypatch):
    """The trainer's LM/MTP head (ctx.head_logprobs: logits built and dropped chunk by chunk,
    recomputed in the backward; fused: the log-softmax kernels) against log-softmax of the
    whole fp32 logits, on the device with the model dtype's operands: log-probabilities,
    entropy and both gradients."""
    from plugins.deepseek_v4 import parallel
    from plugins.deepseek_v4.parallel import ParallelContext, VocabHead

    if tf32 and fused and not CUDA:
        pytest.skip("without CUDA tf32 changes nothing: the fused run is the tf32=False one")
    n, d, v = 300, 256, 1000
    monkeypatch.setattr(parallel, "HEAD_CHUNK_ELEMENTS", 64 * v)  # 5 chunks, the last ragged
    g = torch.Generator().manual_seed(seed)
    y0 = torch.randn(n, d, generator=g).to(DTYPE)
    w0 = (torch.randn(v, d, generator=g) * 0.05).to(DTYPE)
    labels = torch.randint(0, v, (n,), generator=g).to(DEV)
    cot = torch.randn(n, generator=g).to(DEV)
    ctx, runs = ParallelContext(), []
    for chunked in (False, True):
        y, w = y0.to(DEV, copy=True).requires_grad_(), w0.to(DEV, copy=True).requires_grad_()
        head = VocabHead(y, w, ctx, tf32 and CUDA, fused and chunked)
        lp = ctx.head_logprobs(head, labels) if chunked else ctx.token_logprobs(head.logits(), labels)
        ent = ctx.head_entropy(head) if chunked else ctx.token_entropy(head.logits())
        (lp * cot).sum().backward()
        runs.append([t.detach().double().cpu() for t in (lp, ent, y.grad, w.grad)])
    for name, a, b in zip(("logprobs", "entropy", "d y", "d w"), runs[1], runs[0], strict=True):
        assert rel(a, b) < (1e-2 if CUDA else 1e-5), name  # bf16 gradients: a few ulps of 2^-8


@pytest.mark.parametrize("path", ["in_place", "temporary", "bf16_cpu"])
def test_accumulate_wgrad_adds_fp32_sums_into_main(seed, path, monkeypatch):
    """ops.accumulate_wgrad, how the trainer's linears and heads add their weight gradient into
    main_grad: main [N, K] += dy^T x summed in fp32 (bf16 operands on CUDA: the GEMM adding into
    the fp32 buffer, or through an fp32 temporary where torch cannot; fp32 on CPU, and bf16
    there upcast) is main's start plus float64 of the same products to fp32 rounding (a
    gradient rounded to bf16 before the add, as the linears returned it, is ~1e-3 off)."""
    if path == "temporary":
        if not CUDA:
            pytest.skip("the fp32 temporary is the bf16 CUDA fallback")
        monkeypatch.setattr(ops, "_addmm_takes_fp32_addend", lambda: False)
    elif path == "bf16_cpu" and CUDA:
        pytest.skip("CPU's bf16 operands: the CUDA run has its own")
    elif CUDA:
        print(f"addmm adds bf16 products into fp32 in place: {ops._addmm_takes_fp32_addend()}")
    g = torch.Generator().manual_seed(seed)
    t, n, k = (1000, 300, 700) if CUDA else (50, 24, 40)
    dtype = torch.bfloat16 if path == "bf16_cpu" else DTYPE
    dy, x = torch.randn(t, n, generator=g).to(dtype), torch.randn(t, k, generator=g).to(dtype)
    main0 = torch.randn(n, k, generator=g) * 0.1
    main = main0.to(DEV, copy=True)
    ops.accumulate_wgrad(main, dy.to(DEV), x.to(DEV))
    got = main.cpu()
    assert_finite(got)
    assert rel(got.double() - main0.double(), dy.double().t() @ x.double()) < 1e-5


def _head_case(seed: int, tp_rank: int | None, monkeypatch, wgrad_chunks: int = 2):
    """A head's inputs in 3 chunks: (generator, y [n, d], w [V, d] in the model dtype, labels
    (on this shard, and with a TP rank on the other one too), a cotangent [n]). On bf16 CUDA the
    backward's weight-gradient GEMM takes `wgrad_chunks` chunks of two-term bf16 dz (4 bytes a
    logit) at a time (HEAD_WGRAD_BYTES; 2: chunks 1-2, then 3); fp32 operands never gather."""
    from plugins.deepseek_v4 import parallel

    n, d, v = (300, 256, 1000) if CUDA else (50, 16, 70)
    monkeypatch.setattr(parallel, "HEAD_CHUNK_ELEMENTS", (n // 3 + 1) * v)
    monkeypatch.setattr(parallel, "HEAD_WGRAD_BYTES", wgrad_chunks * 4 * (n // 3 + 1) * v)
    g = torch.Generator().manual_seed(seed)
    y0, w0 = torch.randn(n, d, generator=g).to(DTYPE), (torch.randn(v, d, generator=g) * 0.3).to(DTYPE)
    labels = torch.randint(0, v if tp_rank is None else 2 * v, (n,), generator=g)
    return g, y0, w0, labels, torch.randn(n, generator=g)


@pytest.mark.parametrize("wgrad_chunks", [1, 2])
@pytest.mark.parametrize("tp_rank,y_fp32", [(None, False), (1, False), (1, True)])
def test_head_adds_its_weight_gradient_into_main_grad(seed, tp_rank, y_fp32, wgrad_chunks, monkeypatch):
    """The trainer's head (its weight has a main_grad): w.grad stays None and main_grad is its
    start plus float64's dz^T y; with bf16 CUDA operands dz enters the GEMMs as two bf16
    terms (parallel.head_split), to 5e-5 (dz on TF32, planted, measured 2.1e-4), and dy is
    float64's rounded to bf16 but for near-ties; fp32 on CPU to 1e-6. One rank and a TP rank's
    shard (labels on the other shard too), 3 chunks, the weight gradient's GEMM a chunk or
    two at a time (bf16 CUDA operands; _WgradRows' own test covers the gathering on CPU);
    y_fp32: the trainer's TP ranks, whose head input is fp32 (their GEMMs stay on TF32: 1e-3)."""
    if y_fp32 and not CUDA:
        pytest.skip("on CPU y is fp32 in every case")
    from plugins.deepseek_v4.parallel import ParallelContext, VocabHead

    g, y0, w0, labels, cot = _head_case(seed, tp_rank, monkeypatch, wgrad_chunks)
    v, d = w0.shape
    main0 = torch.randn(v, d, generator=g)
    y_dtype = torch.float32 if y_fp32 else DTYPE
    ctx = ParallelContext() if tp_rank is None else ParallelContext(tp_size=2, tp_rank=tp_rank)
    y, w = y0.to(DEV, y_dtype, copy=True).requires_grad_(), w0.to(DEV, copy=True).requires_grad_()
    w.main_grad = main0.to(DEV, copy=True)
    lp = ctx.head_logprobs(VocabHead(y, w, ctx, CUDA, True), labels.to(DEV))
    (lp * cot.to(DEV)).sum().backward()
    # float64: this shard's logits; the label's logit counts where the label is on the shard
    y64, w64 = y0.double().requires_grad_(), w0.double().requires_grad_()
    z = y64 @ w64.t()
    ids = labels - (tp_rank or 0) * v
    mine = (ids >= 0) & (ids < v)
    picked = torch.where(mine, z.gather(-1, ids.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    ((picked - torch.logsumexp(z, -1)) * cot.double()).sum().backward()
    assert w.grad is None
    got = w.main_grad.cpu()
    assert_finite(got, y.grad)
    assert rel(got.double() - main0.double(), w64.grad) < (1e-3 if y_fp32 else 5e-5 if CUDA else 1e-6)
    if CUDA and not y_fp32:
        off = (y.grad.cpu() != y64.grad.to(torch.bfloat16)).double().mean().item()
        assert off < 0.01, f"dy: {off:.2%} of elements differ from float64 rounded to bf16"
        assert rel(y.grad.float().cpu(), y64.grad) < 2.0 ** -8
    elif CUDA:
        assert rel(y.grad.cpu(), y64.grad) < 1e-3
    else:
        assert rel(y.grad.cpu(), y64.grad) < 1e-6


@pytest.mark.parametrize("budget_chunks,gemms", [(1, 4), (2, 2), (5, 1)])
def test_head_wgrad_rows_gather_chunks_into_fewer_gemms(seed, budget_chunks, gemms, monkeypatch):
    """parallel._WgradRows, the head backward's weight gradient over chunks: bf16 dz rows of 4
    chunks (the last ragged) written slot by slot give main + sum of dz^T y (float64 of the same
    values, to fp32 rounding) in the GEMMs the budget allows: one chunk (a GEMM each), two
    (chunks 1-2, 3-4), more than the backward has (one GEMM, its buffer no larger than its
    rows); fp32 operands run a GEMM a chunk whatever the budget."""
    from plugins.deepseek_v4 import parallel

    rows, cols, d, total = 7, 24, 16, 25
    monkeypatch.setattr(parallel, "HEAD_WGRAD_BYTES", budget_chunks * 2 * cols * rows)
    calls = []
    real = parallel.accumulate_wgrad
    monkeypatch.setattr(parallel, "accumulate_wgrad", lambda *a: (calls.append(a[1].shape[0]), real(*a)))
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(total, d, generator=g).to(torch.bfloat16)
    for dtype, want in ((torch.bfloat16, gemms), (torch.float32, 4)):
        dz = torch.randn(total, cols, generator=g).to(dtype)
        main0 = torch.randn(cols, d, generator=g)
        main, calls[:] = main0.clone(), []
        acc = parallel._WgradRows(main, cols, dtype, "cpu", rows, total)
        for i in range(0, total, rows):
            op = acc.slot(min(rows, total - i)).copy_(dz[i:i + rows])
            acc.add(op, y[i:i + rows] if dtype == torch.bfloat16 else y[i:i + rows].float())
        acc.flush()
        assert len(calls) == want and sum(calls) == total, (dtype, calls)
        assert acc.buf.shape[0] <= total
        assert_finite(main)
        assert rel(main.double() - main0.double(), dz.double().t() @ y.double()) < 1e-6, dtype


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tp_rank", [None, 1])
def test_head_keeps_its_logits_and_rounds_its_gradient_on_request(seed, tp_rank, fused, monkeypatch):
    """The heads' backward options (config.head_keep_logits, head_grad_terms), 3 chunks, one
    rank and a TP shard (labels on the other shard too), the model dtype's operands, w with a
    main_grad. Kept logits: log-probs, dy and main_grad bit for bit the recomputing head's.
    One gradient term: dz enters both GEMMs rounded to bf16, so main_grad's rows (and on CPU
    dy's) are float64's products of float64's dz rounded to bf16, to 1e-5, but where an
    element of dz lay within fp32 noise of a bf16 tie (a row or two: 90% of rows asked), and
    the two-term head's rows are off by ~1e-3 (at most half within 1e-5: the option acts)."""
    from plugins.deepseek_v4.parallel import ParallelContext, VocabHead

    _, y0, w0, labels, cot = _head_case(seed, tp_rank, monkeypatch)
    (n, d), v = y0.shape, w0.shape[0]
    ctx = ParallelContext() if tp_rank is None else ParallelContext(tp_size=2, tp_rank=tp_rank)

    def run(**options) -> list[torch.Tensor]:
        y, w = y0.to(DEV, copy=True).requires_grad_(), w0.to(DEV, copy=True).requires_grad_()
        w.main_grad = torch.zeros(v, d, device=DEV)
        lp = ctx.head_logprobs(VocabHead(y, w, ctx, CUDA, fused, **options), labels.to(DEV))
        (lp * cot.to(DEV)).sum().backward()
        out = [t.detach().cpu() for t in (lp, y.grad, w.main_grad)]
        assert_finite(*out)
        return out

    base, kept, one = run(), run(keep_logits=True), run(grad_terms=1)
    for name, a, b in zip(("logprobs", "dy", "dw"), kept, base, strict=True):
        assert torch.equal(a, b), f"kept logits: {name}"
    assert torch.equal(one[0], base[0])
    # float64: dz = cot (onehot - softmax) over this shard's logits (one process: no other shard)
    y64, w64 = y0.double(), w0.double()
    ids = labels - (tp_rank or 0) * v
    onehot = torch.zeros(n, v, dtype=torch.float64)
    mine = (ids >= 0) & (ids < v)
    onehot[mine, ids[mine]] = 1.0
    dz = cot.double()[:, None] * (onehot - torch.softmax(y64 @ w64.t(), -1))
    dzb = dz.float().to(torch.bfloat16).double()

    def rows_within(got: torch.Tensor, want: torch.Tensor) -> float:
        """The share of rows within 1e-5 of want's (relative to each row's norm)."""
        return ((got.double() - want).norm(dim=-1) <= 1e-5 * want.norm(dim=-1)).double().mean().item()

    assert rows_within(one[2], dzb.t() @ y64) >= 0.9
    assert rows_within(base[2], dzb.t() @ y64) <= 0.5
    if not CUDA:  # on CUDA dy comes back in bf16, rounding both alike
        assert rows_within(one[1], dzb @ w64) >= 0.9
        assert rows_within(base[1], dzb @ w64) <= 0.5


def _graph_steps(w, cfg: dict, graphs: bool, batches: list) -> list[dict]:
    w.build_model({**cfg, "cuda_graphs": graphs}, seed=0, dtype="bfloat16", deterministic=True)
    w.setup_training(lr=1e-3, warmup_steps=0, total_steps=100)
    out = [w.train_step(mbs, checksums=True) for mbs in batches]
    if graphs:
        assert w.model._graphs.captures == 1  # one signature, captured once, replayed since
    w.ddp.grad_accs.clear()  # its hooks hold the model in a cycle through C++
    w.model = w.ddp = w.opt = w.sched = None
    return out


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_graphed_training_steps_equal_eager_steps_bitwise(seed, monkeypatch):
    """config.cuda_graphs through the trainer (Megatron DDP, bf16, deterministic kernels): three
    steps of two micro-batches, each step's rows packed with fresh documents of fresh lengths,
    give the eager steps' losses, grad norm and the MD5 of every reduced gradient bit for bit;
    a fourth step of another length runs eagerly, with a warning, and agrees too.
    Guards inputs not copied into the graphs, a layout or RoPE table frozen at capture, the
    capture's warm-up counted into the experts' loads (step 2 routes by the bias they set),
    and aux terms lost on the way out of a graph."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles.train.batching import MicroBatch
    from miles.train.worker import TrainWorker
    from plugins.deepseek_v4 import DeepSeekV4Config
    from plugins.deepseek_v4.determinism import disable_deterministic

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg = DeepSeekV4Config.tiny(
        vocab_size=1024, hidden_size=256, num_hidden_layers=3, num_attention_heads=8, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=128, o_groups=4, o_lora_rank=64, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=128, index_n_heads=4, index_head_dim=64, index_topk=32,
        compress_ratios=[4, 16, 0, 0], num_hash_layers=1, sliding_window=64, kernels="triton").to_dict()
    g = torch.Generator().manual_seed(seed)
    batches = []
    for s in (512, 512, 512, 384):  # the last step's shape was not captured: it runs eagerly
        mbs = []
        for _ in range(2):
            cuts = sorted(torch.randperm(s - 2, generator=g)[:3].add(1).tolist())
            doc = torch.zeros(s, dtype=torch.long)
            for c in cuts:
                doc[c:] += 1
            doc[s - int(torch.randint(0, 40, (1,), generator=g)):] = -1  # padding at the end
            ids = torch.randint(0, 1024, (1, s + 1), generator=g)
            mbs.append(MicroBatch.lm(ids[:, :-1], ids[:, 1:].contiguous(), doc[None]))
        batches.append(mbs)
    w = TrainWorker(0, 1)
    w.init_distributed(*w.rendezvous_address())
    try:
        eager = _graph_steps(w, cfg, False, batches)
        with pytest.warns(UserWarning, match="run eagerly"):
            graphed = _graph_steps(w, cfg, True, batches)
    finally:
        disable_deterministic()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        gc.collect()
        torch.cuda.empty_cache()
    for step, (a, b) in enumerate(zip(eager, graphed, strict=True)):
        assert a["grad_md5"] and all(math.isfinite(v) for v in a.values() if isinstance(v, float)), step
        a.pop("step_time"), b.pop("step_time")
        assert a == b, step


def _adamw_case(seed: int, aligned: bool, steps: list[int], moments: str = "float32"):
    """An AdamW over tensors of sizes around the kernel's block and a program's span (one
    element to 3 programs and a part block) in two groups (decay and lr differ), with random
    moments (kept in `moments`) and step counts, gradients of scales from 1e-3 to 1e3, and bf16
    copies (NaN first) for all but one tensor. Weights, gradients, moments and copies are each
    views into one buffer on the device, 16-byte aligned or 4 bytes off (2 for bf16), with a
    sentinel between them. Returns (optimizer, params, outs, gaps): gaps, (buffer, mask, sentinel)."""
    from miles.train import adamw

    g = torch.Generator().manual_seed(seed)
    b, span = adamw.BLOCK, adamw.BLOCK * adamw.ITERS  # a program: ITERS blocks
    sizes = [1, 17, b + 1, span, span + 1, 3 * span + b + 5]
    off = 0 if aligned else 1
    gaps = []

    def views(values, dtype, sentinel=123.0):
        per = 16 // torch.empty((), dtype=dtype).element_size()  # elements in 16 bytes
        starts = [0]
        for n in sizes:  # each view 16-byte aligned (plus `off`), at least 16 bytes of gap after it
            starts.append(starts[-1] + (n + 2 * per - 1) // per * per)
        flat = torch.full((starts[-1] + per,), sentinel, dtype=dtype, device=DEV)
        inside = torch.zeros(flat.shape, dtype=torch.bool, device=DEV)
        out = []
        for v, at in zip(values, starts, strict=False):
            out.append(flat[off + at:off + at + v.numel()])
            out[-1].copy_(v)
            inside[off + at:off + at + v.numel()] = True
        gaps.append((flat, ~inside, sentinel))
        return out

    def randn():
        return [torch.randn(n, generator=g) for n in sizes]

    params = [torch.nn.Parameter(v) for v in views(randn(), torch.float32)]
    grads = views([v * 10 ** (torch.rand((), generator=g) * 6 - 3) for v in randn()], torch.float32)
    kept = adamw.MOMENTS[moments]
    exp_avgs = views([v * 0.1 for v in randn()], kept)
    exp_avg_sqs = views([v ** 2 * 0.01 for v in randn()], kept)
    outs = views([torch.full((n,), float("nan")) for n in sizes], torch.bfloat16)
    outs[2] = None
    opt = torch.optim.AdamW([{"params": params[:3], "weight_decay": 0.1, "lr": 3e-3},
                             {"params": params[3:], "weight_decay": 0.0, "lr": 1e-2}], betas=(0.9, 0.95), eps=1e-8)
    adamw.set_moments(opt, moments)
    for p, gr, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        p.grad = gr
        opt.state[p] = {"step": torch.tensor(float(st), device=DEV), "exp_avg": m, "exp_avg_sq": v}
    assert all((p.data_ptr() % 16 == 0) == aligned for p in params[1:])
    return opt, params, {id(p): o for p, o in zip(params, outs, strict=True)}, gaps


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_adamw_kernel_matches_float64_adamw_and_torchs_fused(seed, aligned, clip, moments):
    """One step of miles.train.adamw's kernel (which also writes the bf16 weights) against
    float64 AdamW from the same state and against torch's fused AdamW (impl="torch"): the
    weights and moments within fp32 rounding of float64, the moments within twice that of
    torch's (on an H100 most of torch's differ from the kernel's float64-rounded ones in the
    last bit: torch's CUDA AdamW rounds in fp32 along the way); the bf16 copies exactly the fp32
    weights rounded to nearest even (NaN first: every element written); the step counts
    advanced; the gradients left as they were; nothing written outside the tensors. bf16
    moments: the weights as with fp32 ones (the step reads the moments before they are
    rounded), the moments kept in bf16 within half a bf16 step more."""
    from miles.train import adamw

    steps = [1, 2, 7, 100, 3, 1000]
    mine, params, outs, gaps = _adamw_case(seed, aligned, steps, moments)
    theirs, params2, outs2, _ = _adamw_case(seed, aligned, steps, moments)
    scale = torch.tensor(3.7, device=DEV) if clip else None
    before = [(p.detach().double(), p.grad.clone(), mine.state[p]["exp_avg"].double(),
               mine.state[p]["exp_avg_sq"].double()) for p in params]
    adamw.update(mine, outs, scale, impl="triton")
    adamw.update(theirs, outs2, scale, impl="torch")
    for flat, gap, sentinel in gaps:
        assert (flat[gap].float() == sentinel).all(), "the kernel wrote outside a tensor"
    eps32 = torch.finfo(torch.float32).eps
    for i, (p, p2, (w0, g0, m0, v0), st) in enumerate(zip(params, params2, before, steps, strict=True)):
        group = mine.param_groups[0 if i < 3 else 1]
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        gs = g0.double() / (float(scale) if clip else 1.0)  # the scale as given: 3.7 rounded to fp32
        m = b1 * m0 + (1 - b1) * gs
        v = b2 * v0 + (1 - b2) * gs * gs
        step = (lr / (1 - b1 ** (st + 1))) * m / (v.sqrt() / math.sqrt(1 - b2 ** (st + 1)) + eps)
        w = w0 * (1 - lr * wd) - step
        what = f"tensor {i} ({p.numel()} elements)"
        assert float(mine.state[p]["step"]) == st + 1, what
        assert torch.equal(p.grad, g0), what
        # fp32 rounding: the decay and the last subtraction half an ulp each; the step's term
        # ~4.75 (its factors' roundings: step size, moment, square root, bias corrections,
        # divisions): 1, 5, 1 with a margin. The moments: half an ulp, and the clipped
        # gradient's rounding. (torch's fp32 weights on CUDA land up to ~2.4 of these bounds
        # from float64, measured on an H100: its step's arithmetic differs in the last bits.)
        # With the clip, the gradient is rounded to fp32 before the moments (as torch's
        # grad_scale stores it): its half ulp reaches the step through m and v, relative
        # (1 - b1)|g| / |m| and (1 - b2) g^2 / v (halved by the square root), many ulps where
        # m's two terms cancel (seed 617550439: 10.7 ulps of the step); counted twice, a margin.
        half = torch.finfo(torch.bfloat16).eps / 2 if moments == "bfloat16" else 0.0  # the kept moments' rounding
        carried = (eps32 * step.abs() * ((1 - b1) * gs.abs() / m.abs().clamp_min(1e-300)
                                         + (1 - b2) * gs * gs / v.clamp_min(1e-300)) if clip else 0.0)
        checks = (("weights", p.detach(), w, eps32 * (w0.abs() + 5 * step.abs() + w.abs()) + carried),
                  ("exp_avg", mine.state[p]["exp_avg"], m, eps32 * (m.abs() + gs.abs()) + half * m.abs()),
                  ("exp_avg_sq", mine.state[p]["exp_avg_sq"], v, eps32 * (v.abs() + gs * gs) + half * v.abs()))
        assert all(mine.state[p][n].dtype == adamw.MOMENTS[moments] for n in ("exp_avg", "exp_avg_sq")), what
        for name, got, want, bound in checks:
            assert_finite(got, what=what)
            err = (got.double() - want).abs()
            worst = (err / bound.clamp_min(1e-300)).max().item()
            assert (err <= bound).all(), f"{what} {name} vs float64: {worst:.2f}x its bound"
        for name, got, _want, bound in checks[1:]:  # the moments against torch's
            torch_s = theirs.state[p2][name].double()
            assert_finite(torch_s, what=what)
            assert ((got.double() - torch_s).abs() <= 2 * bound).all(), f"{what} {name} vs torch's fused AdamW"
        if outs[id(p)] is not None:
            assert torch.equal(outs[id(p)].view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16)), what


def test_adamw_kernel_follows_its_tensors_and_leaves_the_rest(seed):
    """Three steps against torch's fused AdamW on a twin: the second reuses the kernel's kept
    table, the third follows a moment tensor replaced between steps (a checkpoint load does
    this; a table kept by the old address would update the old tensor); a parameter without
    a gradient keeps its weight, its (absent) state and its copy, and an empty one steps."""
    from miles.train import adamw

    steps = [1, 2, 7, 100, 3, 1000]
    (mine, params, outs, _), (theirs, params2, outs2, _) = (_adamw_case(seed, True, steps) for _ in range(2))
    extra = []
    for opt, out in ((mine, outs), (theirs, outs2)):
        idle, empty = torch.nn.Parameter(torch.ones(5, device=DEV)), torch.nn.Parameter(torch.ones(0, device=DEV))
        empty.grad = torch.zeros(0, device=DEV)
        out[id(idle)] = torch.full((5,), float("nan"), dtype=torch.bfloat16, device=DEV)
        opt.add_param_group({"params": [idle, empty], "weight_decay": 0.0})
        extra.append((idle, empty, out[id(idle)]))
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(3):
        if step == 2:
            for opt, ps in ((mine, params), (theirs, params2)):
                opt.state[ps[3]]["exp_avg"] = opt.state[ps[3]]["exp_avg"].clone()
        for p, p2 in zip(params, params2, strict=True):
            fresh = torch.randn(p.numel(), generator=g).to(DEV)
            p.grad.copy_(fresh)
            p2.grad.copy_(fresh)
        adamw.update(mine, outs, impl="triton")
        adamw.update(theirs, outs2, impl="torch")
        b1, b2 = mine.param_groups[0]["betas"]
        for i, (p, p2) in enumerate(zip(params, params2, strict=True)):
            what = f"step {step} tensor {i}"
            # ulps apart of the larger of the moment and this step's share of it (the share can
            # cancel the moment: one element once landed 17 ulps of the result apart, 3.5 of
            # the share); a stale row is off by about the share itself
            for name, share in (("exp_avg", (1 - b1) * p.grad.abs()), ("exp_avg_sq", (1 - b2) * p.grad ** 2)):
                a, b = mine.state[p][name], theirs.state[p2][name]
                assert_finite(a, b, what=what)
                assert ((a - b).abs() <= 2e-6 * (b.abs().max() + share.max())).all(), f"{what} {name}"
            assert_finite(p.detach(), what=what)
            assert ((p - p2).abs() <= 2e-6 * p2.abs().max()).all(), what
    idle, empty, copy = extra[0]
    assert torch.equal(idle.detach(), torch.ones(5, device=DEV)) and idle not in mine.state and copy.isnan().all()
    assert float(mine.state[empty]["step"]) == 3


def test_fingerprint_block_sums_give_the_scans_fingerprints(seed, monkeypatch):
    """The weight sync's fingerprints on a GPU (kernels/fingerprint.py: a block's sums in one
    read of its bytes, then the blocks before each span's ends and its own block up to them)
    equal torch's scans over the words (checksum's CPU path, tested against the definition in
    Python integers in test_rollout_sync) for a buffer of many tensors, odd-sized and
    straddling blocks; one word changed changes its tensor's alone."""
    from plugins.deepseek_v4 import checksum
    from plugins.deepseek_v4.kernels import fingerprint

    if not CUDA:
        monkeypatch.setattr(fingerprint, "BLOCK", 64)
    monkeypatch.setattr(checksum, "BOUNDS_CHUNK", 7)  # the span ends in several gathers
    g = torch.Generator().manual_seed(seed)
    n = (64 << 20) if CUDA else 20_000  # bytes
    flat = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(DEV)
    spans, off = [], 0
    while (size := int(torch.randint(1, n // 40, (1,), generator=g))) + off <= n:
        spans.append((f"t{len(spans)}", off, size))
        off += size + size % 2  # the next tensor at an even offset
    blocks = checksum.packed_fingerprints(flat, spans, kernel=True)
    assert blocks == checksum.packed_fingerprints(flat, spans, kernel=False)
    k, o, b = spans[len(spans) // 2]
    flat[o + b // 2] ^= 1
    changed = checksum.packed_fingerprints(flat, spans, kernel=True)
    assert [s for s in changed if changed[s] != blocks[s]] == [k]
