"""Each attention kind against a slow float64 oracle written from DSV4.md section 3 with
explicit per-block and per-query loops (no shared code with the model beyond weights)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, tiny_model

from plugins.deepseek_v4.layout import SequenceLayout
from plugins.deepseek_v4.model import Fwd

S = 53  # not a multiple of any ratio: partial blocks at the end


def _rms(v, w=None, eps=1e-6):
    v = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    return v if w is None else v * w


def _freqs(cfg, compressed: bool):
    rd = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    f = [theta ** (-2 * i / rd) for i in range(rd // 2)]
    y = cfg.rope_scaling
    if compressed and y is not None:
        def dim_for(rot):
            return rd * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = max(math.floor(dim_for(y.beta_fast)), 0), min(math.ceil(dim_for(y.beta_slow)), rd - 1)
        for i in range(rd // 2):
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            f[i] = f[i] / y.factor * ramp + f[i] * (1 - ramp)
    return f


def _rope(v, pos, freqs, sign=1.0):
    """Interleaved pairs on the last 2*len(freqs) dims of a 1-D vector."""
    v = v.clone()
    off = v.shape[-1] - 2 * len(freqs)
    for i, f in enumerate(freqs):
        a, b = v[off + 2 * i].clone(), v[off + 2 * i + 1].clone()
        c, s = math.cos(pos * f), sign * math.sin(pos * f)
        v[off + 2 * i], v[off + 2 * i + 1] = a * c - b * s, a * s + b * c
    return v


def _hadamard(v):
    n = v.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return v @ h / math.sqrt(n)


def _compress(comp, x, r, csa, freqs, eps):
    """Entries of all complete blocks, one loop per block and slot."""
    W = lambda lin: lin.weight.double()  # noqa: E731
    C, Z = x @ W(comp.wkv).T, x @ W(comp.wgate).T
    ape = comp.ape.double()
    D = comp.dim
    out = []
    for g in range(x.shape[0] // r):
        cs, zs = [], []
        if csa:
            for j in range(r):
                t = (g - 1) * r + j
                cs.append(C[t, :D] if g > 0 else torch.zeros(D, dtype=torch.float64))
                zs.append(Z[t, :D] + ape[j, :D] if g > 0 else torch.full((D,), -math.inf, dtype=torch.float64))
            for j in range(r):
                cs.append(C[g * r + j, D:])
                zs.append(Z[g * r + j, D:] + ape[j, D:])
        else:
            for j in range(r):
                cs.append(C[g * r + j])
                zs.append(Z[g * r + j] + ape[j])
        cs, zs = torch.stack(cs), torch.stack(zs)
        pooled = (torch.softmax(zs, 0) * cs).sum(0)
        out.append(_rope(_rms(pooled, comp.norm.weight.double(), eps), g * r, freqs))
    return out


def oracle(attn, cfg, x):
    """x [S, d] float64 -> [S, d], following DSV4.md line by line."""
    eps, H, D, Wn = cfg.rms_norm_eps, attn.n_heads, attn.head_dim, attn.window
    r = attn.ratio
    freqs = _freqs(cfg, compressed=r > 0)
    dbl = lambda lin: lin.weight.double()  # noqa: E731
    cq = _rms(x @ dbl(attn.wq_a).T, attn.q_norm.weight.double(), eps)
    q = (cq @ dbl(attn.wq_b).T).view(-1, H, D)
    kv = _rms(x @ dbl(attn.wkv).T, attn.kv_norm.weight.double(), eps)
    kv = torch.stack([_rope(kv[p], p, freqs) for p in range(len(x))])
    comp = _compress(attn.compressor, x, r, r == 4, freqs, eps) if r else []
    if r == 4:
        ix = attn.indexer
        nh, hd = ix.n_heads, ix.head_dim
        kI = [_hadamard(k) for k in _compress(ix.compressor, x, r, True, freqs, eps)]
        qI = (cq @ dbl(ix.wq_b).T).view(-1, nh, hd)
        wI = (x @ dbl(ix.weights_proj).T) * hd ** -0.5 * nh ** -0.5
    sink = attn.attn_sink.double()
    outs = []
    for p in range(len(x)):
        keys = [kv[j] for j in range(max(0, p - Wn + 1), p + 1)]
        visible = [g for g in range(len(comp)) if g < (p + 1) // r] if r else []
        if r == 4:
            qp = [_hadamard(_rope(qI[p, h], p, freqs)) for h in range(nh)]
            score = {g: sum(wI[p, h] * torch.relu(qp[h] @ kI[g]) for h in range(nh)) for g in visible}
            visible = sorted(visible, key=lambda g: (-float(score[g]), g))[: ix.topk]
        keys += [comp[g] for g in visible]
        K = torch.stack(keys)
        heads = []
        for h in range(H):
            qh = _rope(_rms(q[p, h], None, eps), p, freqs)
            s = K @ qh * D ** -0.5
            e = torch.exp(s - s.max())
            o = (e[:, None] * K).sum(0) / (e.sum() + torch.exp(sink[h] - s.max()))
            heads.append(_rope(o, p, freqs, sign=-1.0))
        o = torch.stack(heads).reshape(attn.groups, -1)  # [G, H*D/G]
        wa = attn.wo_a.weight.double().view(attn.groups, -1, o.shape[-1])
        lat = torch.cat([wa[g] @ o[g] for g in range(attn.groups)])
        outs.append(attn.wo_b.weight.double() @ lat)
    return torch.stack(outs)


oracle = torch.no_grad()(oracle)


@pytest.mark.parametrize("layer", [0, 1, 2])  # SWA, CSA (ratio 4 + indexer), HCA (ratio 16)
def test_attention_layer_matches_float64_oracle(seed, layer):
    """Window bounds, compressor overlap halves and ape, block visibility, indexer
    Hadamard/ReLU/top-k, sink in the denominator, inverse RoPE on the output and the
    grouped output projection all agree with an independent per-query implementation."""
    model = tiny_model(seed).eval()
    cfg = model.config
    assert cfg.compress_ratios[:3] == [0, 4, 16]
    attn = model.layers[layer].attn
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, S, cfg.hidden_size, generator=g)
    layout = SequenceLayout.build(1, S, x.device)
    fwd = Fwd(layout, model._ropes(layout.pos))
    with torch.no_grad():
        got = attn(x, fwd)[0]
    want = oracle(attn, cfg, x[0].double())
    # fp32 model vs float64 oracle: relative 1e-5 of the output scale covers fp32 rounding.
    assert_close(got, want.float(), atol=1e-5 * want.abs().max().item(), what=f"layer {layer}")
