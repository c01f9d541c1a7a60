"""Triton kernel for the lightning indexer's training target: the main attention's
probability mass on each chosen compressed entry, summed over heads (no gradient).

    mass[b, t, g] = sum_h exp(q[b, t, h] . e[b, g] * scale - lse[b*S + t, h])   (g chosen)

lse is the attention core's log-denominator (sink included), so this is exactly the
probability the core gave entry g. The PyTorch path materialises the fp32 logits
[B, H, S, G] (1 GiB per CSA layer at S = 4096, H = 64); here one program owns a
[BT tokens, BG entries] tile and loops over heads and D chunks with bf16 tensor-core dots
(fp32 accumulation), so only the [B, S, G] result is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, new_output, within_head_dim
from .sparse_attention import _mm

_CONFIGS = ([triton.Config({"BT": 16, "BG": 16, "BD": 16}, num_warps=4, num_stages=1)] if INTERPRET else
            [triton.Config({"BT": bt, "BG": bg, "BD": bd}, num_warps=w, num_stages=st)
             for bt, bg, bd, w, st in [(64, 64, 64, 4, 2), (64, 64, 128, 4, 2), (64, 128, 64, 8, 2),
                                       (128, 64, 64, 8, 2), (128, 128, 64, 8, 2), (64, 64, 32, 4, 3),
                                       (32, 64, 64, 4, 2), (16, 32, 16, 4, 2)]])


@triton.autotune(_CONFIGS, key=["H", "D"], prune_configs_by={"early_config_prune": within_head_dim("BD")})
@triton.jit
def _mass(Q, E, LSE, CH, OUT, scale, S, G, H, sq_b, sq_s, sq_h, se_b, se_g, sc_b, sc_s, so_b, so_s,
          D: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # t * stride can pass 2^31
    g = tl.program_id(1) * BG + tl.arange(0, BG)
    tmask, gmask = t < S, g < G
    tile = tmask[:, None] & gmask[None, :]
    chosen = tl.load(CH + b * sc_b + t[:, None] * sc_s + g[None, :], mask=tile, other=0) != 0  # [BT, BG]
    acc = tl.zeros([BT, BG], tl.float32)
    for h in range(H):
        s = tl.zeros([BT, BG], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            qh = tl.load(Q + b * sq_b + t[:, None] * sq_s + h * sq_h + d[None, :], mask=tmask[:, None], other=0.0)
            e = tl.load(E + b * se_b + g[:, None] * se_g + d[None, :], mask=gmask[:, None], other=0.0)
            s += _mm(qh, tl.trans(e), IEEE)
        lse = tl.load(LSE + (b * S + t) * H + h, mask=tmask, other=0.0)
        # unchosen entries may exceed lse (overflow to inf): masked before they are summed
        acc += tl.where(chosen, tl.exp(s * scale - lse[:, None]), 0.0)
    tl.store(OUT + b * so_b + t[:, None] * so_s + g[None, :], acc, mask=tile)


def attention_mass(q: torch.Tensor, entries: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, S, H, D]; entries [B, G, D] (the compressed keys); lse [B*S, H] fp32 from the
    attention core; chosen [B, S, G] bool -> [B, S, G] fp32 head-summed probabilities
    (0 where not chosen). No autograd (a detached training target)."""
    b, s, h, d = q.shape
    g = entries.shape[1]
    if entries.shape != (b, g, d) or lse.shape != (b * s, h) or chosen.shape != (b, s, g):
        raise ValueError(f"attention_mass: shapes q {list(q.shape)}, entries {list(entries.shape)}, "
                         f"lse {list(lse.shape)}, chosen {list(chosen.shape)} do not fit")
    if d & (d - 1) or d < 16:
        raise ValueError(f"attention_mass: head dim {d} must be a power of two >= 16")
    q, e = q.detach().contiguous(), entries.detach().to(q.dtype).contiguous()
    lse, ch = lse.detach().float().contiguous(), chosen.to(torch.int8).contiguous()
    out = new_output((b, s, g), q, torch.float32)
    if out.numel():
        _mass[lambda m: (triton.cdiv(s, m["BT"]), triton.cdiv(g, m["BG"]), b)](
            q, e, lse, ch, out, scale, s, g, h, q.stride(0), q.stride(1), q.stride(2), e.stride(0), e.stride(1),
            ch.stride(0), ch.stride(1), out.stride(0), out.stride(1), D=d, IEEE=q.dtype == torch.float32)
    return out
