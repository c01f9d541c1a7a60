"""DeepSeek-V4 in PyTorch: one definition for training, Megatron workers and the engine.

state_dict names equal DeepSeek's checkpoint tensor names (embed.weight,
layers.N.attn.wq_a.weight, layers.N.ffn.experts.E.w1.weight, mtp.0.e_proj.weight, ...),
so the HF bridge needs no name table; parameter names are the same except the routed
experts, stacked per layer (RoutedExperts: layers.N.ffn.experts.w1 [E, I, d]).
Shapes: B batch, S tokens, H heads, D head_dim (512 in V4), n mHC streams, d hidden,
G compressed entries, E experts.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import ops
from .config import DeepSeekV4Config
from .forward import Fwd, Rope, Trace, once
from .graphs import BlockGraphs
from .kv_pool import Fp8KeyPool, KeyPool
from .layout import Blocks, SequenceLayout
from .parallel import ParallelContext, VocabHead

IGNORE_INDEX = -100
AUX_LOSSES = frozenset({"indexer", "balance"})


def use_kernels(cfg: DeepSeekV4Config, t: torch.Tensor) -> bool:
    """GPU kernels (Triton attention core and Sinkhorn, grouped expert GEMMs) for work on
    tensor t: config.kernels "auto" = on CUDA when triton is installed."""
    if cfg.kernels == "auto":
        from . import kernels

        return t.is_cuda and kernels.available()
    return cfg.kernels == "triton"


def use_fused(cfg: DeepSeekV4Config, t: torch.Tensor) -> bool:
    """The fused elementwise kernels (norms, RoPE, SwiGLU, the MoE's row moves, the heads'
    log-softmax, the mHC gates) for work on tensor t: with the GPU kernels, unless
    config.fused_elementwise is off (the PyTorch ops, for A/B runs)."""
    return cfg.fused_elementwise and use_kernels(cfg, t)


def use_tf32(cfg: DeepSeekV4Config, t: torch.Tensor) -> bool:
    """The fp32 projections of a bf16 model on TF32 tensor cores (ops.fp32_linear says why
    that loses nothing on bf16 operands); an fp32 model, the reference, multiplies in IEEE fp32."""
    return cfg.tf32_projections and t.dtype == torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, cfg: DeepSeekV4Config, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, fused=use_fused(self.cfg, x))


# =========================================================================== decoding state
@dataclass
class CompressorCache:
    """One compressor's decoding state for N slots: the entries emitted so far (entry g =
    block g), and the projections C, Z of the current block's tokens (token p at p % r) and
    of the last complete block (CSA overlap only)."""

    entries: KeyPool | Fp8KeyPool  # [N, G, dim] (the main compressor's: positions W.. of the layer's key pool)
    tail: torch.Tensor  # [N, 2, r, coff*dim] fp32
    prev: torch.Tensor | None  # [N, 2, r, coff*dim] fp32


@dataclass
class LayerCache:
    """One attention layer's decoding state for N slots. keys [N, W + G, D] is the pool the
    attention core reads: the window's K = V as a ring (position p at p % W), then the
    compressed entries (FP8 under model.kv_quant, kv_pool)."""

    keys: KeyPool | Fp8KeyPool
    comp: CompressorCache | None
    idx: CompressorCache | None  # the indexer's own compressor (CSA)


@dataclass
class KVCache:
    """Preallocated decoding state of the whole model for N independent sequences (slots).
    `length[n]` tokens are held in slot n, so its next token sits at position length[n]."""

    layers: list[LayerCache]
    length: torch.Tensor  # [N] int64
    max_len: int

    @property
    def slots(self) -> int:
        return self.length.shape[0]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Give slot dst[i] the state of slot src[i] (n samples of one prompt share its
        prefill): one indexed copy a cache tensor for all pairs. No slot is in both lists."""
        if set(src) & set(dst):
            raise ValueError(f"copy_slots: slots {sorted(set(src) & set(dst))} are both read and written")
        s, d = (torch.tensor(x, device=self.length.device) for x in (src, dst))
        for t in self.tensors():
            t[d] = t[s]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache with a slot dimension first, each storage once (the main
        compressor's entries live inside `keys`)."""
        out = [self.length]
        for lc in self.layers:
            out += lc.keys.tensors()
            if lc.comp is not None:
                out += [t for t in (lc.comp.tail, lc.comp.prev) if t is not None]
            if lc.idx is not None:
                out += lc.idx.entries.tensors() + [t for t in (lc.idx.tail, lc.idx.prev) if t is not None]
        return out


def kept(keep: torch.Tensor, *grids: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
    """Index grids broadcast with `keep` [B, k] -> their kept entries as flat device tensors (the
    cache-write plans: built on the host, no wait for the device)."""
    grids = torch.broadcast_tensors(*grids, keep)
    return tuple(g[grids[-1]].to(device, non_blocking=True) for g in grids[:-1])


@dataclass
class PrefillCapture:
    """What a prefill forward keeps: the token indices whose logits it returns, and per
    attention layer the tensors the cache is filled from."""

    at: torch.Tensor  # [B] each row's last token index
    layers: list[tuple] = field(default_factory=list)  # (kv, (C, Z), entries, (Ci, Zi), index entries)


@dataclass
class FillPlan:
    """Where a packed prefill's tokens go in the cache: index tensors built on the host from the
    prompt lengths (no wait for the device), so each cache tensor of a layer is written by one
    indexed copy for all rows (per row and layer, the launches and boolean-mask syncs made the
    prefill host-bound: 180 ms for 64 prompts of 64 tokens at 1b, 20 ms of it kernels).
    Row b (lens[b] tokens, one document from position 0) goes to slot slots[b]. Each entry is a
    tuple of equal-length [n] tensors:
      window: (row, token, slot): the last W tokens of each row (ring position token % W);
      entries[r]: (row, block, slot): the complete blocks of ratio r, lens[b] // r of them;
      tail[r]: (row, token, slot, token % r): the tokens after the last complete block;
      prev[r]: (row, token, slot, token % r): the tokens of the last complete block."""

    window: tuple[torch.Tensor, ...]
    entries: dict[int, tuple[torch.Tensor, ...]]
    tail: dict[int, tuple[torch.Tensor, ...]]
    prev: dict[int, tuple[torch.Tensor, ...]]

    @classmethod
    def of(cls, lens: list[int], slots: list[int], window: int, ratios: Iterable[int], device) -> FillPlan:
        n = torch.tensor(lens)[:, None]  # [B, 1]
        row = torch.arange(len(lens))[:, None]
        slot = torch.tensor(slots)[:, None]

        def pick(token: torch.Tensor, keep: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """[B, k] grids -> the kept (row, token, slot, *more)."""
            return kept(keep, row, token, slot, *more, device=device)

        token = n - window + torch.arange(window)  # [B, W]
        plan = cls(pick(token, token >= 0), {}, {}, {})
        for r in set(ratios):
            blocks = n // r  # [B, 1] complete blocks
            g = torch.arange(max(1, max(lens) // r))  # [G]
            plan.entries[r] = pick(g[None].expand(len(lens), -1), g < blocks)
            j = torch.arange(r)  # [r]
            after = blocks * r + j  # [B, r]
            plan.tail[r] = pick(after, after < n, j)
            plan.prev[r] = pick(after - r, (blocks > 0).expand(-1, r), j)
        return plan


@dataclass
class ChunkBlocks:
    """One compression ratio's part of an ExtendPlan. Each row pools from a buffer [U, ...] of
    token projections laid out from the block before the slot's current one: buffer index
    u = position - (starts // r - 1) * r (the cached last complete block at u < r, the
    current block's cached tokens from u = r, then the chunk). Buffer block k + 1 is block
    g = starts // r + k; index tuples are flat [n] device tensors:
      chunk: (row, token, u): where each chunk token goes;
      entries: (row, k, slot, g): the blocks the chunk completes;
      tail: (row, u, slot, u % r): the tokens after the last complete block (the new tail);
      prev: (row, u, slot, u % r): the last complete block's tokens, where the chunk completed one."""

    size: int  # U, a multiple of r
    has_prev: torch.Tensor  # [B, U / r - 1] block g > 0
    start: torch.Tensor  # [B, U / r - 1] the blocks' first positions g * r (their RoPE positions)
    seen: torch.Tensor  # [B, T] the complete blocks a chunk token's query sees: (position + 1) // r
    chunk: tuple[torch.Tensor, ...]
    entries: tuple[torch.Tensor, ...]
    tail: tuple[torch.Tensor, ...]
    prev: tuple[torch.Tensor, ...]


@dataclass
class ExtendPlan:
    """A chunk of tokens continuing each of B slots (chunked prefill), laid out on the host from
    the slots' lengths and the chunks' (no wait for the device). Row b holds lens[b] tokens
    (right-padded to T) at positions starts[b] + t of slot slots[b]. A query's keys are its
    window, then the complete blocks' entries: the window from [ring W ; chunk T], the ring
    holding the slot's last W positions (position p at p % W)."""

    slots: torch.Tensor  # [B]
    pos: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T]
    window: torch.Tensor  # [B, T, W] each query's window keys in [ring ; chunk] (query p, j: key p - j), -1 none
    ring: tuple[torch.Tensor, ...]  # (row, token, slot, p % W): the chunk tokens the ring keeps
    blocks: dict[int, ChunkBlocks]
    lens: list[int]

    @classmethod
    def of(cls, starts: list[int], lens: list[int], slots: list[int], window: int, ratios: Iterable[int],
           device) -> ExtendPlan:
        L, n = torch.tensor(starts)[:, None], torch.tensor(lens)[:, None]  # [B, 1]
        b, t = len(lens), max(lens)
        row, slot = torch.arange(b)[:, None], torch.tensor(slots)[:, None]
        tok = torch.arange(t)[None]  # [1, T]
        pos, valid = L + tok, tok < n  # [B, T]

        def flat(keep: torch.Tensor, *grids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return kept(keep, *grids, device=device)

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=True)

        key = pos[..., None] - torch.arange(window)  # [B, T, W] key positions
        at = torch.where(key < L[..., None], key % window, window + key - L[..., None])
        win = torch.where((key >= 0) & (key < (L + n)[..., None]), at, -1)
        keep = (tok >= n - window) & valid  # the last W tokens of the chunk
        plan = cls(dev(torch.tensor(slots)), dev(pos), dev(valid), dev(win), flat(keep, row, tok, slot, pos % window),
                   {}, lens)
        for r in set(ratios):
            g0, m = L // r, L % r  # [B, 1] the current block, its cached tokens
            size = r * -(-(r + int((m + n).max())) // r)
            k = torch.arange(size // r - 1)[None]  # [1, K]
            g = g0 + k  # [B, K] block numbers
            end = (L + n) // r  # [B, 1] complete blocks after the chunk
            u = torch.arange(size)[None]  # [1, U]
            p = u + (g0 - 1) * r  # [B, U] positions
            last = (end - 1 - g0 + 1) * r  # buffer index of the last complete block's first token
            plan.blocks[r] = ChunkBlocks(
                size, dev(g >= 1), dev(g * r), dev((pos + 1) // r),
                chunk=flat(valid, row, tok, r + m + tok),
                entries=flat(g < end, row, k, slot, g),
                tail=flat((p >= end * r) & (p < L + n) & (u >= r), row, u, slot, u % r),
                prev=flat((end > g0) & (u >= last) & (u < last + r), row, u, slot, u % r))
        return plan


# =========================================================================== attention parts
def padded(seqs: list[torch.Tensor], lens: list[int]) -> torch.Tensor:
    """1-D token ids -> [B, max(lens)] right-padded with 0, built on the host."""
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for b, t in enumerate(seqs):
        ids[b, : lens[b]] = t.reshape(-1)
    return ids


def token_rows(index: torch.Tensor, seq: int) -> torch.Tensor:
    """Token positions index [B, ...] of a [B, seq, .] tensor -> its rows in the [B*seq, .]
    flattening [B*...], for `gather_tokens`."""
    b = index.shape[0]
    return (index + torch.arange(b, device=index.device).view(b, *[1] * (index.dim() - 1)) * seq).flatten()


def gather_tokens(t: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """t [B, S, C] -> t[b, index[b]] [*shape, C] (rows = token_rows(index, S)). One
    index_select: its backward is index_add_, ~4x faster on CPU than advanced indexing's
    (atomic on CUDA; deterministic under torch's deterministic mode)."""
    return t.flatten(0, 1).index_select(0, rows).view(*shape, t.shape[-1])


def block_numbers(chosen: torch.Tensor, blocks: Blocks, k: int) -> torch.Tensor:
    """Chosen compressed entries [B, s, G] bool -> their in-document block numbers [B, s, k]
    (ascending, -1 = none): what the engine's slot cache indexes them by."""
    b, s, g = chosen.shape
    at = ops.mask_to_index(chosen, min(k, g))  # [B, s, <=k] entry indices of the row
    num = torch.where(at >= 0, blocks.pos.gather(1, at.clamp_min(0).flatten(1)).view(at.shape) // blocks.ratio, -1)
    return torch.cat((num, num.new_full((b, s, k - num.shape[-1]), -1)), -1) if num.shape[-1] < k else num


def entries_mask(picked: torch.Tensor, blocks: Blocks, layout: SequenceLayout, q) -> torch.Tensor:
    """Indexer replay: picked [B, s, K] in-document block numbers (-1: none) of the queries
    layout.doc[:, q] -> the entries [B, s, G] of this row they are (a document's blocks are
    contiguous in the row's compacted order: its first is the count of valid blocks that start
    before the document). Numbers past the document land outside it; the caller's visibility
    mask drops them."""
    b, g = blocks.start.shape
    idx = torch.arange(layout.shape[1], device=picked.device)
    doc_start = (idx - layout.pos)[:, q]  # [B, s]
    first = (blocks.valid[:, None, :] & (blocks.start[:, None, :] < doc_start[..., None])).sum(-1)  # [B, s]
    at = torch.where(picked >= 0, first[..., None] + picked.long(), g).clamp(max=g)  # [B, s, K]; g = a spare column
    out = torch.zeros(*at.shape[:2], g + 1, dtype=torch.bool, device=picked.device)
    return out.scatter_(-1, at, True)[..., :g]


class Compressor(nn.Module):
    """Pools each complete block of `ratio` tokens into one entry of width `dim` (all fp32).
    CSA (ratio 4) overlaps: the previous block's tokens feed the first channel half, the
    current block's the second; absent previous tokens are C = 0, Z = -inf."""

    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, dim: int, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.ratio, self.cfg = dim, ratio, cfg
        self.overlap = cfg.is_csa(ratio)
        coff = 2 if self.overlap else 1
        self.wkv = ctx.replicated_linear(cfg.hidden_size, coff * dim, dtype)
        self.wgate = ctx.replicated_linear(cfg.hidden_size, coff * dim, dtype)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, cfg, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d] -> C, Z [B, S, coff*D] in fp32."""
        tf32 = use_tf32(self.cfg, x)
        return ops.fp32_linear(x, self.wkv.weight, tf32), ops.fp32_linear(x, self.wgate.weight, tf32)

    def pool(self, cur_c: torch.Tensor, cur_z: torch.Tensor, prev_c: torch.Tensor | None,
             prev_z: torch.Tensor | None, has_prev: torch.Tensor | None) -> torch.Tensor:
        """Block projections [B, G, r, coff*D] -> normalised entries [B, G, D] (fp32, no RoPE)."""
        ape = self.ape.float()
        if self.overlap:
            d = self.dim
            hp = has_prev[..., None, None]
            c = torch.cat((torch.where(hp, prev_c[..., :d], 0.0), cur_c[..., d:]), dim=-2)  # [B, G, 2r, D]
            z = torch.cat((torch.where(hp, prev_z[..., :d] + ape[:, :d], float("-inf")),
                           cur_z[..., d:] + ape[:, d:]), dim=-2)
        else:
            c, z = cur_c, cur_z + ape
        pooled = ops.compress_pool(c, z)
        return ops.rms_norm(pooled, self.norm.weight, self.norm.eps, fused=use_fused(self.cfg, pooled))

    def forward(self, x: torch.Tensor, blocks: Blocks,
                gather=None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """All complete blocks of the sequence: x [B, s, d] -> entries [B, G, D] fp32, and the
        projections (C, Z) [B, S, coff*D] that a prefill keeps as decoding state. `gather`
        (context parallel): this rank's projections [B, s, .] -> the whole sequence's."""
        c, z = self.project(x)
        if gather is not None:
            c, z = gather(c), gather(z)
        shape = blocks.start.shape + (blocks.ratio,)  # [B, G, r]

        def block_tokens(offset: int) -> tuple[torch.Tensor, torch.Tensor]:
            """(C, Z) of each block shifted by `offset` blocks, [B, G, r, coff*D] each."""
            rows = token_rows(blocks.token_index(offset), c.shape[1])
            return gather_tokens(c, rows, shape), gather_tokens(z, rows, shape)

        prev = block_tokens(-1) if self.overlap else (None, None)  # only the overlapping pool reads it
        return self.pool(*block_tokens(0), *prev, blocks.has_prev), (c, z)

    # ---- incremental decoding
    def new_cache(self, slots: int, entries: KeyPool | Fp8KeyPool | None, max_len: int, device) -> CompressorCache:
        coff = 2 if self.overlap else 1
        if entries is None:  # the indexer's own entries, fp32 (FP8 codes under kv_quant, as its keys are rounded)
            g = max_len // self.ratio
            entries = (Fp8KeyPool.zeros(slots, g, self.dim, self.cfg.qk_rope_head_dim, torch.float32, device)
                       if self.cfg.kv_quant else KeyPool.zeros(slots, g, self.dim, torch.float32, device))
        tail = torch.zeros(slots, 2, self.ratio, coff * self.dim, device=device)
        return CompressorCache(entries, tail, torch.zeros_like(tail) if self.overlap else None)

    def fill(self, cc: CompressorCache, plan: FillPlan, cz: tuple[torch.Tensor, torch.Tensor],
             entries: torch.Tensor) -> None:
        """Slots' state after a prefill (`plan`): the projections cz [B, S, coff*D] and the
        entries [B, G, D] (each row's complete blocks first)."""
        (e_row, e_g, e_slot), r = plan.entries[self.ratio], self.ratio
        cc.entries.put((e_slot, e_g), entries[e_row, e_g])
        for store, (row, tok, slot, j) in ((cc.tail, plan.tail[r]), (cc.prev, plan.prev[r])):
            if store is not None:
                store[slot, 0, j], store[slot, 1, j] = cz[0][row, tok], cz[1][row, tok]

    def step(self, x: torch.Tensor, cc: CompressorCache, slots: torch.Tensor, pos: torch.Tensor, rope_fn,
             memo: dict | None = None) -> None:
        """Feed each row's token at position pos [B] (x [B, 1, d]); rows whose block it
        completes emit entry pos // r. Every row pools and only the completing ones write:
        the shapes never depend on which rows complete (no wait for the GPU, one CUDA graph).
        `memo`: the step's position facts (forward.once), shared by the compressors of a ratio."""
        r, cap = self.ratio, cc.entries.shape[1]
        c, z = self.project(x)  # [B, 1, coff*D]
        # [B] each: the token's place in its block, whether it completes it, the block (a
        # completing row's is in range), whether a block precedes it, the block's first position
        j, done, g, has_prev, start = once(memo, ("blocks", r, cap), lambda: block_facts(pos, r, cap))
        cc.tail[slots, 0, j], cc.tail[slots, 1, j] = c[:, 0], z[:, 0]
        if cap == 0:  # a cache shorter than one block: no block ever completes
            return
        cur = cc.tail[slots]  # [B, 2, r, coff*D]
        pc = pz = prev = None
        if cc.prev is not None:
            prev = cc.prev[slots]
            pc, pz = prev[:, 0, None], prev[:, 1, None]
        entry = self.pool(cur[:, 0, None], cur[:, 1, None], pc, pz, has_prev)  # [B, 1, D]
        entry = rope_fn(entry, start, ("blocks", r, cap))[:, 0]  # [B, D]
        cc.entries.put((slots, g), entry, when=done)
        if cc.prev is not None:
            cc.prev[slots] = torch.where(done[:, None, None, None], cur, prev)

    def extend(self, x: torch.Tensor, cc: CompressorCache, plan: ExtendPlan, rope_fn) -> None:
        """Feed a chunk of tokens to each slot (x [B, T, d], `plan`): the blocks it completes
        become entries, and the slot keeps the new partial block's (and CSA: the last complete
        block's) projections."""
        r, p = self.ratio, plan.blocks[self.ratio]
        cz = torch.stack(self.project(x), 2)  # [B, T, 2, coff*D]: C, Z
        buf = cz.new_zeros(cz.shape[0], p.size, *cz.shape[2:])  # [B, U, 2, coff*D]
        buf[:, r:2 * r] = cc.tail[plan.slots].transpose(1, 2)  # the current block's cached tokens (and stale ones
        if cc.prev is not None:  # past them, which the chunk overwrites or no complete block reads)
            buf[:, :r] = cc.prev[plan.slots].transpose(1, 2)
        row, tok, u = p.chunk
        buf[row, u] = cz[row, tok]
        blocks = buf.unflatten(1, (-1, r))  # [B, U / r, r, 2, coff*D]
        cur, prev = blocks[:, 1:], blocks[:, :-1]
        entries = self.pool(cur[..., 0, :], cur[..., 1, :], prev[..., 0, :], prev[..., 1, :], p.has_prev)
        entries = rope_fn(entries, p.start)  # [B, K, D]
        row, k, slot, g = p.entries
        cc.entries.put((slot, g), entries[row, k])
        for store, (row, u, slot, j) in ((cc.tail, p.tail), (cc.prev, p.prev)):
            if store is not None:
                store[slot, :, j] = buf[row, u]


def block_facts(pos: torch.Tensor, r: int, cap: int) -> tuple[torch.Tensor, ...]:
    """Decoding positions pos [B] against blocks of r tokens in a cache of `cap` entries: (j,
    done, g, has_prev [B, 1], start [B, 1]) as Compressor.step reads them."""
    j = pos % r
    g = (pos // r).clamp_max(max(cap - 1, 0))
    return j, j == r - 1, g, (g >= 1)[:, None], (g * r)[:, None]


class Indexer(nn.Module):
    """Lightning indexer (CSA only): scores compressed entries per query, top-k picks."""

    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = ctx.replicated_linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = ctx.replicated_linear(cfg.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(ctx, cfg, self.head_dim, ratio, dtype)
        # indexer replay in training forwards: (replayed entries this indexer would not have
        # picked, replayed entries), summed until the trainer reads and resets them
        self.register_buffer("replay_stats", torch.zeros(2), persistent=False)

    def queries(self, x: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q [B, S, h, dI] (RoPE then Hadamard) and head weights w [B, S, h] (fp32)."""
        q = self.wq_b(c_q).unflatten(-1, (self.n_heads, self.head_dim))
        fused = use_fused(self.cfg, q)
        q = ops.hadamard(ops.apply_rope(q, cos[:, :, None], sin[:, :, None], fused=fused), fused=fused)
        w = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    @staticmethod
    def keys(entries: torch.Tensor) -> torch.Tensor:
        return ops.hadamard(entries)


class Attention(nn.Module):
    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.layer, self.ratio = layer, cfg.layer_ratio(layer)
        self.n_heads = cfg.num_attention_heads // ctx.tp_size
        self.groups = cfg.o_groups // ctx.tp_size
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.rope_kind = "compressed" if self.ratio else "swa"
        d, h, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = ctx.replicated_linear(d, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg, dtype)
        self.wq_b = ctx.column_linear(cfg.q_lora_rank, h * D, dtype)
        self.wkv = ctx.replicated_linear(d, D, dtype)
        self.kv_norm = RMSNorm(D, cfg, dtype)
        self.wo_a = ctx.column_linear(h * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = ctx.row_linear(cfg.o_groups * cfg.o_lora_rank, d, dtype)
        self.ctx = ctx
        self.attn_sink = ctx.sharded_parameter((cfg.num_attention_heads,), 0, torch.float32)
        self.compressor = Compressor(ctx, cfg, D, self.ratio, dtype) if self.ratio else None
        self.indexer = Indexer(ctx, cfg, self.ratio, dtype) if cfg.is_csa(self.ratio) else None
        # this layer's index among the main stack's CSA layers (indexer replay); None elsewhere and in MTP
        self.pick_index = (sum(cfg.is_csa(cfg.layer_ratio(i)) for i in range(layer))
                           if self.indexer is not None and layer < cfg.num_hidden_layers else None)

    # ---- shared pieces of the full and the incremental path
    def _q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        fused = use_fused(self.cfg, x)
        c_q = self.q_norm(self.wq_a(x))  # [B, S, q_lora]
        q = self.wq_b(c_q).unflatten(-1, (self.n_heads, self.head_dim))  # [B, S, H, D]
        return c_q, ops.norm_rope(q, cos[:, :, None], sin[:, :, None], self.cfg.rms_norm_eps, fused=fused)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kv = ops.apply_rope(self.kv_norm(self.wkv(x)), cos, sin, fused=use_fused(self.cfg, x))  # [B, T, D]
        return ops.fp8_kv_fake_quant(kv, 2 * cos.shape[-1]) if self.cfg.kv_quant else kv

    def _rope_entries(self, rope: Rope):
        """fn(entries [.., G, D], their positions) -> entries with RoPE (and KV-QAT's rounding):
        compressed and indexer keys, in the full forward and where decoding completes a block."""
        def fn(entries: torch.Tensor, positions: torch.Tensor, key=None) -> torch.Tensor:
            cos, sin = rope.at(positions, key)
            out = ops.apply_rope(entries, cos, sin, fused=use_fused(self.cfg, entries))
            return ops.fp8_kv_fake_quant(out, 2 * cos.shape[-1]) if self.cfg.kv_quant else out
        return fn

    def _options(self):
        from .kernels.sparse_attention import AttentionOptions

        c = self.cfg
        return AttentionOptions(c.sm90_kernels, c.sm90_kv_gradient, c.overlap_chunks)

    def _out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        fused = use_fused(self.cfg, o)
        return self.wo_b(ops.unrope_out_proj(o, cos[:, :, None], sin[:, :, None], self.wo_a.weight, self.groups, fused))

    def forward(self, x: torch.Tensor, fwd: Fwd) -> torch.Tensor:
        """x [B, s, d] (attn_norm applied; s = this rank's query tokens of the S) -> [B, s, d].
        Keys come from all S tokens: under context parallelism each rank projects its own
        tokens (K = V, compressor C and Z) and the results are all-gathered."""
        rope = fwd.ropes[self.rope_kind]
        q_cos, q_sin = rope.cos[:, fwd.q], rope.sin[:, fwd.q]
        gather = self.ctx.gather_seq if self.ctx.cp_size > 1 else None
        c_q, q = self._q(x, q_cos, q_sin)
        kv = self._kv(x, q_cos, q_sin)  # [B, s, D]: this rank's tokens (CP), then all of them
        kv = gather(kv) if gather else kv
        keys, chosen = kv, None
        comp = cz = ki_entries = ki_cz = blocks = None
        if self.compressor is not None:
            blocks = fwd.layout.blocks(self.ratio)
            rope_e = self._rope_entries(rope)
            comp, cz = self.compressor(x, blocks, gather)
            comp = rope_e(comp, blocks.pos).to(kv.dtype)  # [B, G, D]
            visible = fwd.layout.visible(blocks)[:, fwd.q]  # [B, s, G]
            chosen = visible
            if self.indexer is not None:
                # The indexer sees detached inputs: only its auxiliary loss trains it.
                qi, wi = self.indexer.queries(x.detach(), c_q.detach(), q_cos, q_sin)
                ki_entries, ki_cz = self.indexer.compressor(x.detach(), blocks, gather)
                ki_entries = rope_e(ki_entries, blocks.pos)
                scores = ops.indexer_scores(qi, self.indexer.keys(ki_entries), wi,
                                            fwd.layout.entry_bound(blocks)[:, fwd.q],
                                            fused=use_kernels(self.cfg, qi))  # [B, s, G]; 0 past the bound
                chosen = ops.topk_select(scores, visible, self.indexer.topk)
                if self.pick_index is not None:
                    chosen = self._replay_picks(chosen, visible, blocks, fwd)
            keys = torch.cat((kv, comp), 1)
        want_kl = self.indexer is not None and "indexer" in fwd.aux and torch.is_grad_enabled()
        keys = self.ctx.to_tp_region(keys)  # one K = V for heads split over TP ranks
        o, mass_c, lse = self._attend(q, keys, fwd.layout, fwd.q, chosen, want_kl)
        if want_kl:
            self._indexer_kl(self.ctx.sum_over_tp(mass_c), scores, chosen, fwd)
        if fwd.capture is not None:
            fwd.capture.layers.append((kv, cz, comp, ki_cz, ki_entries))
        out = self._out(o, q_cos, q_sin)
        if fwd.trace is not None and not fwd.replay and fwd.trace.wants(self.layer):
            fwd.trace.add(self.layer, {"input": x, "q": q, "kv": kv, "entries": comp, "chosen": chosen, "lse": lse,
                                       "output": out, "doc": fwd.layout.doc, "pos": fwd.layout.pos,
                                       "rows": torch.arange(fwd.layout.shape[1], device=x.device)[fwd.q]})
        return out

    def _replay_picks(self, own: torch.Tensor, visible: torch.Tensor, blocks, fwd: Fwd) -> torch.Tensor:
        """Indexer replay: the entries [B, s, G] each query attends, the engine's (fwd.picked, as
        in-document block numbers) where given, else this indexer's own `own`; records the
        chosen entries in fwd.picks."""
        chosen = own
        if fwd.picked is not None:
            chosen = entries_mask(fwd.picked[:, fwd.q, self.pick_index], blocks, fwd.layout, fwd.q) & visible
            if self.training and torch.is_grad_enabled() and not fwd.replay:
                with torch.no_grad():  # no host wait: summed on the device
                    self.indexer.replay_stats += torch.stack(((chosen & ~own).sum(), chosen.sum())).float()
        if fwd.picks is not None and not fwd.replay:
            fwd.picks[self.pick_index] = block_numbers(chosen, blocks, self.indexer.topk)
        return chosen

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, layout: SequenceLayout, q_rows: slice,
                chosen: torch.Tensor | None, want_probs: bool):
        """Attention core over keys = [S raw K = V ; G compressed entries] [B, S+G, D]: each
        query sees its sliding window of raw keys and its `chosen` entries [B, s, G] (None:
        no entries). Returns o [B, s, H, D], if asked the attention probability of each
        compressed entry summed over this rank's heads [B, s, G] (detached), and the softmax's
        log-denominator lse [B, s, H] where the path computes it (else None)."""
        scale = self.head_dim ** -0.5
        n_raw = layout.shape[1]
        if not use_kernels(self.cfg, q) and q.is_cuda:
            # PyTorch on a GPU: dense batched GEMMs over all S + G keys under a mask run on tensor
            # cores; per-query gathers of W + K keys took 2x the step (the ~1B config, H100)
            mask = layout.window_mask(self.window)[:, q_rows]  # [B, s, S]
            if chosen is not None:
                mask = torch.cat((mask, chosen), -1)
            o, probs = ops.sparse_attention(q, keys, mask, self.attn_sink, scale, return_probs=want_probs)
            return o, (probs[..., n_raw:].detach().sum(1) if want_probs else None), None
        b, s, h, d = q.shape
        row = torch.arange(b, device=q.device)[:, None, None] * keys.shape[1]  # row offsets in the key pool
        win = layout.window_index(self.window)[:, q_rows]  # [B, s, W]
        parts = [torch.where(win >= 0, win + row, -1)]
        if chosen is not None:
            # K bound: the indexer's top-k, or all G entries (HCA): no wait for the GPU
            bound = min(self.indexer.topk, chosen.shape[-1]) if self.indexer is not None else chosen.shape[-1]
            picks = ops.mask_to_index(chosen, bound)  # [B, s, K]
            parts.append(torch.where(picks >= 0, picks + n_raw + row, -1))
        idx = torch.cat(parts, -1).reshape(b * s, -1)  # [B*s, W + K] into [B*(S+G)] keys
        if not use_kernels(self.cfg, q):
            # CPU: the gather reference, W + K keys a query (a dense mask over all S + G keys
            # made the tiny model's whole training step 1.7x slower)
            o, lse, p = ops.sparse_attention_indexed(q.reshape(b * s, h, d), keys.reshape(-1, d), idx,
                                                     self.attn_sink, scale, return_probs=True)
            mass_c = None
            if want_probs:  # [B*s, H, W + K] -> the chosen entries' mass, summed over heads [B, s, G]
                g, mass = chosen.shape[-1], p[..., win.shape[-1]:].detach().sum(1)  # [B*s, K]
                at = torch.where(picks >= 0, picks, g).reshape(b * s, -1)  # empty slots -> a spare column
                mass_c = mass.new_zeros(b * s, g + 1).scatter_add_(1, at, mass)[:, :g].view(b, s, g)
            return o.view(b, s, h, d), mass_c, lse.view(b, s, h)
        from .kernels.sparse_attention import sparse_attention as kernel

        o, lse = kernel(q.reshape(b * s, h, d), keys.reshape(-1, d), idx.to(torch.int32), self.attn_sink, scale,
                        deterministic=torch.are_deterministic_algorithms_enabled(), options=self._options())
        mass_c = None
        if want_probs:  # recomputed from lse for the chosen compressed entries only
            from .kernels.indexer import attention_mass

            mass_c = attention_mass(q, keys[:, n_raw:], lse, chosen, scale)
        return o.view(b, s, h, d), mass_c, lse.view(b, s, h)

    @staticmethod
    def _indexer_kl(target: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor, fwd: Fwd) -> None:
        """KL(main-attention mass over the chosen entries [B, S, G], summed over all heads and
        renormalised || softmax of the indexer scores over the same entries), summed over rows
        (those without a chosen entry add 0; `loss_rows` counts the rows that have one)."""
        total = target.sum(-1, keepdim=True)
        rows = chosen.any(-1) & (total[..., 0] > 0)
        target = torch.where(chosen, target / total.clamp_min(1e-30), 0.0)
        # A finite fill keeps rows without picks finite (an all -inf row gives NaN grads).
        logp = torch.log_softmax(scores.masked_fill(~chosen, -1e30), -1)
        kl = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - logp), 0.0).sum(-1)
        fwd.indexer_terms.append(torch.where(rows, kl, 0.0).sum())

    # ---- incremental decoding
    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> LayerCache:
        g = max_len // self.ratio if self.ratio else 0
        if self.cfg.kv_quant:  # the runtime's FP8 cache
            keys = Fp8KeyPool.zeros(slots, self.window + g, self.head_dim, self.cfg.qk_rope_head_dim, dtype, device)
        else:
            keys = KeyPool.zeros(slots, self.window + g, self.head_dim, dtype, device)
        comp = self.compressor.new_cache(slots, keys.positions(self.window), max_len, device) if self.ratio else None
        idx = self.indexer.compressor.new_cache(slots, None, max_len, device) if self.indexer else None
        return LayerCache(keys, comp, idx)

    def fill(self, lc: LayerCache, plan: FillPlan, captured: tuple) -> None:
        """Slots' state after a prefill (`plan`: which row's tokens go to which slot)."""
        kv, cz, comp, ki_cz, ki_entries = captured
        row, tok, slot = plan.window
        lc.keys.put((slot, tok % self.window), kv[row, tok])
        if self.compressor is not None:
            self.compressor.fill(lc.comp, plan, cz, comp)
            if self.indexer is not None:
                self.indexer.compressor.fill(lc.idx, plan, ki_cz, ki_entries)

    def step(self, x: torch.Tensor, lc: LayerCache, slots: torch.Tensor, pos: torch.Tensor,
             ropes: dict[str, Rope], picks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """One token per row, row b at position pos[b] of slot slots[b]: x [B, 1, d] -> [B, 1, d];
        writes the token's K = V, compressor projections and any completed entry to the cache.
        `picks`: where the indexer's chosen entries go ([B, K] block numbers, as Fwd.picks)."""
        rope = ropes[self.rope_kind]
        w, memo = self.window, rope.memo
        cos, sin = rope.at(pos[:, None], "tokens")  # [B, 1, rd/2]
        c_q, q = self._q(x, cos, sin)  # q [B, 1, H, D]
        lc.keys.put((slots, once(memo, ("ring", w), lambda: pos % w)), self._kv(x, cos, sin)[:, 0])
        # [B, W] ring entries written so far
        mask = once(memo, ("window", w), lambda: torch.arange(w, device=x.device) <= pos[:, None])
        keys = w  # the most keys a row attends (static: the slot's capacity, not this batch's count)
        if self.compressor is not None:
            rope_e = self._rope_entries(rope)
            self.compressor.step(x, lc.comp, slots, pos, rope_e, memo)
            g = lc.keys.shape[1] - w  # G: the slot's entry capacity (entries past count are masked)
            # [B, G] the complete blocks, all visible
            chosen = once(memo, ("complete", self.ratio, g),
                          lambda: torch.arange(g, device=x.device) < ((pos + 1) // self.ratio)[:, None])
            keys += g
            if self.indexer is not None:
                self.indexer.compressor.step(x, lc.idx, slots, pos, rope_e, memo)
                qi, wi = self.indexer.queries(x, c_q, cos, sin)
                scores = ops.indexer_scores(qi, self.indexer.keys(lc.idx.entries.get((slots,))), wi)  # [B, 1, G]
                chosen = ops.topk_select(scores, chosen[:, None], self.indexer.topk)[:, 0]
                keys = w + min(self.indexer.topk, g)
                if picks is not None and self.pick_index is not None:  # a slot's entry g is block g
                    at = ops.mask_to_index(chosen, min(self.indexer.topk, g))  # [B, <=K]
                    picks[self.pick_index] = F.pad(at, (0, self.indexer.topk - at.shape[-1]), value=-1)
            mask = torch.cat((mask, chosen), -1)  # [B, W + G]
        scale = self.head_dim ** -0.5
        if use_kernels(self.cfg, q):
            pick = ops.mask_to_index(mask, keys)  # [B, K] into the slot's row of the pool
            idx = torch.where(pick >= 0, pick + slots[:, None] * lc.keys.shape[1], -1).to(torch.int32)
            b, _, h, d = q.shape
            o = lc.keys.attend(q.reshape(b, h, d), idx, self.attn_sink, scale,  # the pool in place (FP8: codes)
                               self._options())
            o = o.view(b, 1, h, d)
        else:
            o, _ = ops.sparse_attention(q, lc.keys.get((slots, slice(0, mask.shape[1]))), mask[:, None],
                                        self.attn_sink, scale)
        return self._out(o, cos, sin)

    def extend(self, x: torch.Tensor, lc: LayerCache, plan: ExtendPlan, ropes: dict[str, Rope],
               picks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """A chunk of tokens per row after the tokens its slot holds (chunked prefill): x [B, T, d]
        -> [B, T, d], the full forward's outputs at those positions; the chunk's K = V, compressor
        state and completed entries go to the cache. `picks`: as in `step`, [B, T, K]."""
        rope, w = ropes[self.rope_kind], self.window
        cos, sin = rope.at(plan.pos, "chunk")  # [B, T, rd/2]
        c_q, q = self._q(x, cos, sin)  # [B, T, H, D]
        kv = self._kv(x, cos, sin)  # [B, T, D]
        ring = lc.keys.get((plan.slots, slice(0, w)))  # [B, W, D] (a copy: the chunk's tokens overwrite it below)
        parts, idx = [ring, kv.to(ring.dtype)], [plan.window]  # idx [B, T, .] into [ring ; chunk ; entries]
        if self.compressor is not None:
            rope_e = self._rope_entries(rope)
            self.compressor.extend(x, lc.comp, plan, rope_e)
            entries = lc.keys.get((plan.slots, slice(w, None)))  # [B, G, D], the chunk's blocks in
            g = entries.shape[1]
            seen = plan.blocks[self.ratio].seen  # [B, T]: each query sees entries [0, seen)
            chosen = torch.arange(g, device=x.device) < seen[..., None]  # [B, T, G]
            bound = g
            if self.indexer is not None:
                self.indexer.compressor.extend(x, lc.idx, plan, rope_e)
                qi, wi = self.indexer.queries(x, c_q, cos, sin)
                ki = self.indexer.keys(lc.idx.entries.get((plan.slots,)))  # [B, G, dI]
                scores = ops.indexer_scores(qi, ki, wi, seen, fused=use_kernels(self.cfg, qi))  # [B, T, G]
                chosen = ops.topk_select(scores, chosen, self.indexer.topk)
                bound = min(self.indexer.topk, g)
            at = ops.mask_to_index(chosen, bound)  # [B, T, <=K] entry g = block g
            if picks is not None and self.pick_index is not None:
                picks[self.pick_index] = F.pad(at, (0, self.indexer.topk - at.shape[-1]), value=-1)
            parts.append(entries)
            idx.append(torch.where(at >= 0, at + w + kv.shape[1], -1))
        keys = torch.cat(parts, 1)  # [B, W + T + G, D]
        b, t, h, d = q.shape
        row = torch.arange(b, device=x.device)[:, None, None] * keys.shape[1]
        idx = torch.cat(idx, -1)
        idx = torch.where(idx >= 0, idx + row, -1).reshape(b * t, -1)  # [B*T, W + K] into [B*(W+T+G)] keys
        o = self._core(q.reshape(b * t, h, d), keys.reshape(-1, d), idx).view(b, t, h, d)
        row, tok, slot, at = plan.ring
        lc.keys.put((slot, at), kv[row, tok])
        return self._out(o, cos, sin)

    def _core(self, q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Sparse attention o [N, H, D] of q [N, H, D] over the rows idx [N, K] of keys [M, D]
        (-1: none): the kernel on the GPU path, the gather reference elsewhere."""
        scale = self.head_dim ** -0.5
        if not use_kernels(self.cfg, q):
            return ops.sparse_attention_indexed(q, keys, idx, self.attn_sink, scale)[0]
        from .kernels.sparse_attention import sparse_attention

        return sparse_attention(q, keys, idx.to(torch.int32), self.attn_sink, scale, options=self._options())[0]


# =========================================================================== MoE
class Expert(nn.Module):
    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.limit = cfg, cfg.swiglu_limit
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = ctx.column_linear(d, inter, dtype)
        self.w2 = ctx.row_linear(inter, d, dtype)
        self.w3 = ctx.column_linear(d, inter, dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, d]; weight [N] (routing weight, applied before w2) -> [N, d]."""
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), self.limit, weight, x.dtype, fused=use_fused(self.cfg, x)))


class RoutedExperts(nn.Module):
    """This rank's routed experts (global ids first..first+n-1) as three stacked weights,
    w1, w3 [n, I/tp, d] and w2 [n, d, I/tp]: the grouped GEMMs read them whole, and the
    backward accumulates one gradient per weight kind instead of one per expert (3n autograd
    leaves, DDP hooks and adds a layer otherwise). Outside the module they are DeepSeek's
    per-expert tensors `E.w1.weight` (state_dict, load_state_dict, HF files, exports, seeded
    init); sharded checkpoints keep them stacked, split over EP along dim 0."""

    WEIGHTS = ("w1", "w3", "w2")

    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, dtype: torch.dtype):
        super().__init__()
        local = ctx.local_experts(cfg.n_routed_experts)
        self.first, n, d, inter = local.start, len(local), cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = ctx.sharded_parameter((n, inter, d), 1, dtype)
        self.w3 = ctx.sharded_parameter((n, inter, d), 1, dtype)
        self.w2 = ctx.sharded_parameter((n, d, inter), 2, dtype)
        for w in (self.w1, self.w3, self.w2):
            w.expert_dim = 0  # EP splits dim 0 (sharded checkpoints)
        ctx.mark_expert(self)

    def per_expert(self, prefix: str, leaf: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A tensor shaped like stacked weight `leaf` (the weight, its gradient) as DeepSeek's
        per-expert tensors: (prefix + "E.w1.weight", t[E - first]), views carrying the
        weight's TP split (dim one lower) and expert mark."""
        w = getattr(self, leaf)
        for i in range(t.shape[0]):
            v = t[i]
            v.tensor_model_parallel, v.partition_dim = w.tensor_model_parallel, w.partition_dim - 1
            v.partition_stride, v.allreduce = 1, False
            yield f"{prefix}{self.first + i}.{leaf}.weight", v

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Views of the detached weights whether or not keep_vars: no per-expert Parameter exists
        # to keep, and writes through them (loads) must not meet autograd.
        for leaf in self.WEIGHTS:
            destination.update(self.per_expert(prefix, leaf, getattr(self, leaf).detach()))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        mine = {}
        for leaf in self.WEIGHTS:
            mine.update((k, (leaf, i)) for i, (k, _) in enumerate(self.per_expert(prefix, leaf, getattr(self, leaf))))
        with torch.no_grad():
            for key, (leaf, i) in mine.items():
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                w, t = getattr(self, leaf), state_dict[key]
                if tuple(t.shape) != tuple(w.shape[1:]):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(t.shape)}, "
                                      f"the model has {tuple(w.shape[1:])}")
                    continue
                w[i].copy_(t)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in mine)


def balanced_hash_table(vocab: int, n_experts: int, k: int, layer: int) -> torch.Tensor:
    """Deterministic, balanced token -> experts table for hash layers, [vocab, k] int64.

    Token t gets the k consecutive experts (pi(t)*k + j) mod E, j < k, where
    pi(t) = (a*t + layer) mod vocab is a permutation (a coprime to vocab), so the k
    experts of a token are distinct and every expert serves floor or ceil(vocab*k/E)
    vocabulary entries. Independent of torch's RNG and version; loaded checkpoints keep
    their own table."""
    a = 2654435761 % vocab or 1
    while math.gcd(a, vocab) != 1:
        a += 1
    t = torch.arange(vocab, dtype=torch.long)
    pi = (a * t + layer) % vocab
    return (pi[:, None] * k + torch.arange(k)) % n_experts


class Gate(nn.Module):
    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, layer: int, is_hash: bool, dtype):
        super().__init__()
        self.topk, self.is_hash, self.cfg = cfg.num_experts_per_tok, is_hash, cfg
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        if is_hash:
            self.register_buffer("tid2eid", balanced_hash_table(
                cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok, layer))
        else:
            # fp32 selection bias, updated aux-loss-free (not by the optimizer).
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
            self.register_buffer("expert_load", torch.zeros(cfg.n_routed_experts), persistent=False)
            # routing replay in training forwards: (tokens whose own top-k differs from the replayed
            # experts, replayed tokens), summed until the trainer reads and resets them
            self.register_buffer("replay_stats", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, forced: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d], ids [N] -> experts [N, k], weights [N, k] fp32, scores [N, E] fp32.
        `forced` [N, k]: experts to use instead of this router's choice (routing replay; rows of
        -1 route as usual); the weights still come from this router's scores, so it keeps its
        gradient."""
        s = ops.sqrtsoftplus(ops.fp32_linear(x, self.weight, use_tf32(self.cfg, x)))  # [N, E]
        if self.is_hash:
            idx = self.tid2eid[ids]
        else:
            idx = torch.topk(s + self.bias, self.topk, dim=-1, sorted=False).indices
            if forced is not None:
                replayed = forced[:, :1] >= 0  # [N, 1]
                own, idx = idx, torch.where(replayed, forced.to(idx.dtype), idx)
                if self.training and torch.is_grad_enabled():
                    with torch.no_grad():  # no host wait: summed on the device
                        differ = (own.sort(-1).values != idx.sort(-1).values).any(-1) & replayed[:, 0]
                        self.replay_stats += torch.stack((differ.sum(), replayed.sum())).float()
        w = s.gather(-1, idx)
        return idx, w / w.sum(-1, keepdim=True) * self.scaling, s


class MoE(nn.Module):
    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, layer: int, is_hash: bool, dtype):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.gate = Gate(ctx, cfg, layer, is_hash, dtype)
        # this layer's index among the main stack's learned routers (routing replay); None for
        # hash layers (routed by token id) and MTP's
        self.route_index = layer - cfg.num_hash_layers if not is_hash and layer < cfg.num_hidden_layers else None
        self.experts = RoutedExperts(ctx, cfg, dtype)
        self.shared_experts = (Expert(ctx, cfg, dtype)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor, fwd: Fwd | None, ids: torch.Tensor, valid: torch.Tensor,
                routes: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, S, d]; ids, valid [B, S] -> [B, S, d]. `routes` (decoding, without a Fwd):
        where the experts chosen go, as Fwd.routes."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        r = self.route_index
        forced = None
        if r is not None and fwd is not None and fwd.routed is not None:
            forced = fwd.routed[:, fwd.q, r].reshape(-1, fwd.routed.shape[-1])  # [N, k]
        idx, w, s = self.gate(xf, ids.reshape(-1), forced)
        record = fwd.routes if fwd is not None and not fwd.replay else routes
        if r is not None and record is not None:
            record[r] = idx.view(*shape[:2], -1)  # [B, s, k]
        w = self.ctx.to_tp_region(w)  # scales TP-split expert activations
        # EP: the (token, slot) pairs of every rank routed to this rank's experts, one row each
        xs, idxs, ws, route = self.ctx.ep_dispatch(xf, idx, w, self.cfg.n_routed_experts)
        e = self.experts
        out = ops.routed_experts(self.ctx.to_tp_region(xs), idxs, ws, e.w1, e.w3, e.w2, e.first,
                                 self.cfg.swiglu_limit, fused=use_kernels(self.cfg, xs) and xs.dtype == torch.bfloat16,
                                 fused_elementwise=use_fused(self.cfg, xs))
        out = self.ctx.ep_combine(out, route)  # [N, d]: this rank's tokens, their k slots summed
        out = self.ctx.reduce_from_tp(out)  # expert widths split over TP: partial sums
        if self.shared_experts is not None:
            out = ops.add_cast(out, self.shared_experts(xf), x.dtype)  # fp32 sum, rounded once, one pass
        if not self.gate.is_hash:
            v = valid.reshape(-1)
            if self.training and torch.is_grad_enabled() and not (fwd is not None and fwd.replay):
                with torch.no_grad():  # counted once per token, not again when recomputed; no
                    # bincount of idx[v]: its output size would make the host wait for the GPU
                    self.gate.expert_load += (F.one_hot(idx, s.shape[-1]).sum(1) * v[:, None]).sum(0).float()
            if fwd is not None and "balance" in fwd.aux and torch.is_grad_enabled():
                fwd.balance_terms.append(self._balance(idx, s, valid))
        return out.to(x.dtype).reshape(shape)  # the cast without a shared expert (add_cast's is x.dtype)

    def _balance(self, idx: torch.Tensor, s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Sequence-level balance loss sum_e f_e * P_e (V3 form), summed over rows with tokens."""
        b, t = valid.shape
        e, k = s.shape[-1], idx.shape[-1]
        v = valid.float()
        n = v.sum(1).clamp_min(1)  # [B]
        counts = F.one_hot(idx, e).sum(-2).view(b, t, e).float() * v[..., None]
        f = counts.sum(1) * e / (k * n[:, None])
        p = ((s / s.sum(-1, keepdim=True)).view(b, t, e) * v[..., None]).sum(1) / n[:, None]
        return ((f * p).sum(-1) * (v.sum(1) > 0)).sum()


# =========================================================================== blocks
class Block(nn.Module):
    """One transformer block; attention and MoE each wrapped in mHC."""

    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, layer: int, dtype: torch.dtype,
                 is_hash: bool):
        super().__init__()
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.hidden_size
        m = n * (n + 2)
        self.attn_norm = RMSNorm(d, cfg, dtype)
        self.attn = Attention(ctx, cfg, layer, dtype)
        self.ffn_norm = RMSNorm(d, cfg, dtype)
        self.ffn = MoE(ctx, cfg, layer, is_hash, dtype)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(m, n * d, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(m, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _hc(self, site: str, x: torch.Tensor, fused: bool):
        c = self.cfg
        return ops.hc_pre(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                          getattr(self, f"hc_{site}_scale"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
                          fused=fused, tf32=use_tf32(c, x), gates=use_fused(c, x), streams=True)

    def forward(self, x: torch.Tensor, fwd: Fwd, ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, n, d] -> [B, S, n, d]."""
        fused = use_kernels(self.cfg, x)
        u, post, comb, x = self._hc("attn", x, fused)  # x through hc_pre: one gradient pass for both uses
        x = ops.hc_post(self.attn(self.attn_norm(u), fwd), x, post, comb, fused=fused)
        u, post, comb, x = self._hc("ffn", x, fused)
        return ops.hc_post(self.ffn(self.ffn_norm(u), fwd, ids, fwd.layout.doc[:, fwd.q] >= 0), x, post, comb,
                           fused=fused)

    def step(self, x: torch.Tensor, lc: LayerCache, slots: torch.Tensor, pos: torch.Tensor,
             ropes: dict[str, Rope], ids: torch.Tensor, routes: dict[int, torch.Tensor] | None = None,
             picks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        return self._incremental(x, lambda h: self.attn.step(h, lc, slots, pos, ropes, picks), ids,
                                 torch.ones_like(ids, dtype=torch.bool), routes)

    def extend(self, x: torch.Tensor, lc: LayerCache, plan: ExtendPlan, ropes: dict[str, Rope], ids: torch.Tensor,
               routes: dict[int, torch.Tensor] | None = None,
               picks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        return self._incremental(x, lambda h: self.attn.extend(h, lc, plan, ropes, picks), ids, plan.valid, routes)

    def _incremental(self, x: torch.Tensor, attend, ids: torch.Tensor, valid: torch.Tensor,
                     routes: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """The block over the cache (decoding step, chunk): attend(normed x) -> the attention's
        output, as the forward's but without a Fwd."""
        fused = use_kernels(self.cfg, x)
        u, post, comb, x = self._hc("attn", x, fused)
        x = ops.hc_post(attend(self.attn_norm(u)), x, post, comb, fused=fused)
        u, post, comb, x = self._hc("ffn", x, fused)
        return ops.hc_post(self.ffn(self.ffn_norm(u), None, ids, valid, routes), x, post, comb, fused=fused)


def add_head_collapse(mod: nn.Module, cfg: DeepSeekV4Config, dtype: torch.dtype) -> None:
    """Register hc_head_{fn,base,scale} and the final `norm` on `mod` (DeepSeek's names sit
    at the model top level and on each MTP block)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    mod.hc_head_fn = nn.Parameter(torch.empty(n, n * d, dtype=torch.float32))
    mod.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
    mod.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
    mod.norm = RMSNorm(d, cfg, dtype)


def head_collapse(mod: nn.Module, cfg: DeepSeekV4Config, x: torch.Tensor) -> torch.Tensor:
    """Streams [B, S, n, d] -> normed hidden [B, S, d] for the LM head."""
    y = ops.hc_head(x, mod.hc_head_fn, mod.hc_head_base, mod.hc_head_scale, cfg.rms_norm_eps, cfg.hc_eps,
                    fused=use_kernels(cfg, x), tf32=use_tf32(cfg, x), gates=use_fused(cfg, x))
    return mod.norm(y)


class MTPBlock(Block):
    """Multi-token prediction: x = e_proj(enorm(embed(t_j))) + h_proj(hnorm(X_{j-1})) per
    stream, one block (learned routing), own head collapse; predicts t_{j+1} at index j."""

    def __init__(self, ctx: ParallelContext, cfg: DeepSeekV4Config, layer: int, dtype: torch.dtype):
        super().__init__(ctx, cfg, layer, dtype, is_hash=False)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg, dtype)
        self.hnorm = RMSNorm(d, cfg, dtype)
        self.e_proj = ctx.replicated_linear(d, d, dtype)
        self.h_proj = ctx.replicated_linear(d, d, dtype)
        add_head_collapse(self, cfg, dtype)


# =========================================================================== model
class LayerStack(nn.ModuleDict):
    """The blocks a pipeline stage holds, keyed by global layer index (so parameter names
    stay DeepSeek's `layers.N.*` on every stage); iterates and indexes like a list."""

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, i: int | str) -> nn.Module:
        return self._modules[str(i)]


@dataclass
class CausalLMOutput:
    """What one forward returns. Losses are not computed here: a loss function (the trainer's,
    chosen by name) combines the logits with labels, and the auxiliary sums with their counts.
    Under context parallelism every [B, s, ...] tensor covers this rank's chunk of tokens."""

    head: VocabHead | None = None  # the LM head over this rank's vocabulary shard (None before the last stage)
    mtp_head: VocabHead | None = None  # MTP's: index j predicts t_{j+1} from (X_{j-1}, t_j)
    mtp_rows: torch.Tensor | None = None  # [B, s] bool: positions that have an MTP prediction
    hidden: torch.Tensor | None = None  # [B, s, n*d] streams sent to the next pipeline stage
    # Auxiliary loss sums of this stage (asked for with `aux=`), each the mean over the model's
    # layers of a per-layer sum over rows: "indexer" (KL, rows of `loss_rows()["indexer"]`),
    # "balance" (sequence balance term, rows with tokens). Divide by their global counts.
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: torch.Tensor | None = None  # [B, s, L, k] with record_routes: the experts chosen per learned MoE layer
    picks: torch.Tensor | None = None  # [B, s, C, K] with record_picks: the indexer's entries per CSA layer
    _built: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def logits(self) -> torch.Tensor | None:
        """[B, s, V/tp] fp32, built on first use (trainers take log-probabilities from `head`)."""
        return self._build("logits", self.head)

    @property
    def mtp_logits(self) -> torch.Tensor | None:
        return self._build("mtp", self.mtp_head)

    def _build(self, key: str, head: VocabHead | None) -> torch.Tensor | None:
        if head is not None and key not in self._built:
            self._built[key] = head.logits()
        return self._built.get(key)


class DeepSeekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 causal LM.

    `model(input_ids, attention_mask=None, doc_ids=None, aux=())` -> CausalLMOutput: the LM
    head (its logits[b, t] predict input_ids[b, t+1]; trainers take log-probabilities from
    the head in chunks, `.logits` builds them whole), MTP's head and the auxiliary loss sums
    asked for. Losses are the trainer's (a loss function chosen by name): the model holds no labels.
    """

    def __init__(self, config: DeepSeekV4Config, dtype: torch.dtype = torch.float32,
                 ctx: ParallelContext | None = None, seed: int | None = 0):
        super().__init__()
        config.validate()
        self.config = cfg = config
        ctx = ctx or ParallelContext()
        first, last = ctx.first_stage, ctx.last_stage
        # The last stage keeps its own copy of the embedding for MTP (gradients summed with
        # the first stage's copy over Megatron's embedding group).
        self.embed = ctx.embedding(cfg.vocab_size, cfg.hidden_size, dtype) if first or (
            last and cfg.num_nextn_predict_layers) else None
        self.layers = LayerStack({str(i): Block(ctx, cfg, i, dtype, is_hash=i < cfg.num_hash_layers)
                                  for i in ctx.stage_layers(cfg.num_hidden_layers)})
        if last:
            add_head_collapse(self, cfg, dtype)
        self.head = ctx.column_linear(cfg.hidden_size, cfg.vocab_size, dtype) if last else None
        self.mtp = nn.ModuleList(MTPBlock(ctx, cfg, cfg.num_hidden_layers + k, dtype)
                                 for k in range(cfg.num_nextn_predict_layers if last else 0))
        self.ctx = ctx
        self._stage_input: torch.Tensor | None = None
        # Auxiliary losses are averaged over all layers of the model, wherever they run.
        n = cfg.num_hidden_layers
        self._n_indexer_layers = sum(cfg.is_csa(cfg.layer_ratio(i)) for i in range(n))
        self._n_balance_layers = (sum(i >= cfg.num_hash_layers for i in range(n))
                                  + cfg.num_nextn_predict_layers)
        rd = cfg.qk_rope_head_dim
        self.register_buffer("inv_freq_swa", ops.rope_inv_freq(rd, cfg.rope_theta, None), persistent=False)
        self.register_buffer("inv_freq_compressed", ops.rope_inv_freq(rd, cfg.compress_rope_theta,
                                                                      cfg.rope_scaling), persistent=False)
        self._graphs = None  # graphs.BlockGraphs, made on the first graphed forward
        if cfg.cuda_graphs:
            self._block_graphs()  # a layout it cannot serve fails here, not at the first step
        if seed is not None:
            self.init_weights(seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded init, one generator per tensor name: independent of construction order,
        device and sharding (a TP rank draws the full tensor and keeps its slice)."""
        c = self.config
        for name, p in self.deepseek_named(self.named_parameters()):
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            leaf = name.rsplit(".", 1)[-1]
            shape = list(p.shape)
            split = getattr(p, "tensor_model_parallel", False)
            if split:
                shape[p.partition_dim] *= self.ctx.tp_size
            if name.endswith("norm.weight"):
                val = torch.ones(shape)
            elif leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
                val = torch.zeros(shape)
            elif leaf.endswith("_scale"):
                val = torch.ones(shape)
            elif leaf.endswith("_fn"):
                val = torch.randn(shape, generator=g) * c.hc_init_std
            else:
                val = torch.randn(shape, generator=g) * c.initializer_range
            if split:
                val = val.chunk(self.ctx.tp_size, p.partition_dim)[self.ctx.tp_rank]
            p.copy_(val.to(p.dtype))
        for mod in self.modules():
            if isinstance(mod, Gate) and not mod.is_hash:
                mod.bias.zero_()

    def deepseek_named(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, tensor shaped like it) pairs (named_parameters, gradients) under
        DeepSeek's names: the stacked routed experts as per-expert views."""
        for name, t in tensors:
            owner, _, leaf = name.rpartition(".")
            mod = self.get_submodule(owner)
            if isinstance(mod, RoutedExperts):
                yield from mod.per_expert(owner + ".", leaf, t)
            else:
                yield name, t

    # ------------------------------------------------------------------ forward
    def _ropes(self, pos: torch.Tensor) -> dict[str, Rope]:
        out = {}
        for kind, inv in (("swa", self.inv_freq_swa), ("compressed", self.inv_freq_compressed)):
            cos, sin = ops.rope_cos_sin(pos, inv)
            out[kind] = Rope(inv, cos, sin)
        return out

    def _streams(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :, None, :].expand(*h.shape[:2], self.config.hc_mult, h.shape[-1]).contiguous()

    def _head(self, y: torch.Tensor) -> VocabHead:
        """The LM head (shared by MTP) over this TP rank's vocabulary shard, for hidden y [..., d]."""
        c = self.config
        return VocabHead(y, self.head.weight, self.ctx, use_tf32(c, y), use_fused(c, y), c.head_keep_logits,
                         c.head_grad_terms)

    def set_input_tensor(self, t: torch.Tensor | list | None) -> None:
        """Pipeline schedules hand a later stage its input here ([B, s, n*d] streams)."""
        self._stage_input = t[0] if isinstance(t, list) else t

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, aux: tuple[str, ...] | frozenset[str] = (),
                _capture: PrefillCapture | None = None, routed_experts: torch.Tensor | None = None,
                record_routes: bool = False, indexer_picks: torch.Tensor | None = None,
                record_picks: bool = False, trace: Trace | None = None) -> CausalLMOutput:
        """input_ids [B, S] (the whole sequence on every rank); attention_mask (padding) or
        doc_ids (packed documents). `aux`: the auxiliary loss sums to compute ("indexer",
        "balance"; training forwards only). `routed_experts` [B, S, L, k]: routing replay, the
        experts each token takes in the L learned MoE layers of the main stack (-1: its own
        routing); `record_routes`: `out.routes` holds the experts this forward chose, [B, s, L', k]
        for the L' learned layers of this stage. `indexer_picks` [B, S, C, K]: indexer replay, the
        compressed entries (in-document block numbers, -1: none) each token's query attends in
        the C CSA layers of the main stack; `record_picks`: `out.picks` holds this forward's,
        [B, s, C', K]. Under context parallelism outputs cover this rank's chunk s of S; before
        the last pipeline stage the output is `hidden`. `trace`: attention internals of its
        layers to capture (forward.Trace)."""
        b, s = input_ids.shape
        ctx, cfg = self.ctx, self.config
        unknown = set(aux) - AUX_LOSSES
        if unknown:
            raise ValueError(f"unknown auxiliary losses {sorted(unknown)}; known: {sorted(AUX_LOSSES)}")
        q = ctx.seq_chunk(s)
        q = q.to(input_ids.device) if isinstance(q, torch.Tensor) else q
        layout = SequenceLayout.build(b, s, input_ids.device, attention_mask, doc_ids,
                                      static_blocks=use_kernels(cfg, input_ids))
        fwd = Fwd(layout, self._ropes(layout.pos), q=q, capture=_capture, aux=frozenset(aux), trace=trace)
        n_routed = cfg.num_hidden_layers - cfg.num_hash_layers
        if routed_experts is not None:
            if routed_experts.shape != (b, s, n_routed, cfg.num_experts_per_tok):
                raise ValueError(f"routed_experts has shape {list(routed_experts.shape)}; routing replay needs "
                                 f"[{b}, {s}, {n_routed}, {cfg.num_experts_per_tok}] (tokens x learned MoE layers x k)")
            fwd.routed = routed_experts.to(input_ids.device)
        fwd.routes = {} if record_routes else None
        if indexer_picks is not None:
            want = (b, s, self._n_indexer_layers, cfg.index_topk)
            if tuple(indexer_picks.shape) != want:
                raise ValueError(f"indexer_picks has shape {list(indexer_picks.shape)}; indexer replay needs "
                                 f"{list(want)} (tokens x CSA layers x index_topk)")
            fwd.picked = indexer_picks.to(input_ids.device)
        fwd.picks = {} if record_picks else None
        ids = input_ids[:, q]
        if ctx.first_stage:
            x = self._streams(self.embed(ids))  # [B, s, n, d]
        else:
            x = self._stage_input.view(b, ids.shape[1], cfg.hc_mult, cfg.hidden_size)
        for layer in self.layers:
            x = self._block(layer, x, fwd, ids)
        routes = None
        if record_routes:  # [B, s, L', k] (L' = 0: no learned router on this stage)
            routes = torch.stack([fwd.routes[r] for r in sorted(fwd.routes)], 2) if fwd.routes else \
                ids.new_zeros(*ids.shape, 0, cfg.num_experts_per_tok)
        picks = None
        if record_picks:  # [B, s, C', K] (C' = 0: no CSA layer on this stage)
            picks = torch.stack([fwd.picks[c] for c in sorted(fwd.picks)], 2) if fwd.picks else \
                ids.new_zeros(*ids.shape, 0, cfg.index_topk)
        if not ctx.last_stage:
            return CausalLMOutput(hidden=x.flatten(2), aux=self._aux_sums(fwd), routes=routes, picks=picks)
        if _capture is not None:
            x = x[torch.arange(b, device=x.device), _capture.at][:, None]  # [B, 1, n, d]: each row's last token
        out = CausalLMOutput(self._head(head_collapse(self, cfg, x)))  # hidden [B, s, d]
        if self.mtp and _capture is None:
            out.mtp_head, mfwd = self._mtp(x, ids, layout, fwd)
            out.mtp_rows = self.loss_rows(layout)["mtp"][:, q]
            main, mtp = self._aux_sums(fwd), self._aux_sums(mfwd)
            out.aux = {k: v + mtp[k] for k, v in main.items()}
        else:
            out.aux = self._aux_sums(fwd)
        out.routes, out.picks = routes, picks
        return out

    def loss_rows(self, layout: SequenceLayout) -> dict[str, torch.Tensor]:
        """[B, S] bool, per loss term, the positions it can cover (whole sequence): "tokens"
        (not padding), "mtp" (an MTP prediction exists: not a document's first token),
        "indexer" (the query sees a compressed entry of a CSA layer, whose indexer KL it
        adds). Trainers count these over the global batch to normalise each term."""
        tokens = layout.doc >= 0
        csa = [r for r in self.config.compress_ratios if self.config.is_csa(r)]
        return {"tokens": tokens, "mtp": tokens & (layout.pos >= 1),
                "indexer": tokens & (layout.pos >= csa[0] - 1) if csa else torch.zeros_like(tokens)}

    def _mtp(self, x: torch.Tensor, ids: torch.Tensor, layout: SequenceLayout, fwd: Fwd) -> tuple[VocabHead, Fwd]:
        # Index j combines X_{j-1} (same document) with embed(t_j): the MTP sequence of a
        # document starts at its second token, at position pos - 1; first tokens are dead.
        alive = (layout.pos >= 1) & (layout.doc >= 0)
        mlayout = SequenceLayout(doc=torch.where(alive, layout.doc, -1), pos=(layout.pos - 1).clamp_min(0),
                                 static_blocks=layout.static_blocks)
        mfwd = Fwd(mlayout, self._ropes(mlayout.pos), q=fwd.q, aux=fwd.aux, trace=fwd.trace)
        x_all = self.ctx.gather_seq(x)  # the shift crosses context-parallel chunks
        x_prev = torch.cat((torch.zeros_like(x_all[:, :1]), x_all[:, :-1]), 1)[:, fwd.q]
        blk = self.mtp[0]
        h = blk.e_proj(blk.enorm(self.embed(ids)))[:, :, None] + blk.h_proj(blk.hnorm(x_prev))  # [B, s, n, d]
        h = self._block(blk, h, mfwd, ids)
        return self._head(head_collapse(blk, self.config, h)), mfwd

    def _block(self, block: Block, x: torch.Tensor, fwd: Fwd, ids: torch.Tensor) -> torch.Tensor:
        """One block; with config.recompute (training) only its input is kept and its forward
        runs again in the backward, flagged `fwd.replay` so side effects happen once; with
        config.cuda_graphs (training) its forward and backward replay as CUDA graphs."""
        train = self.training and torch.is_grad_enabled()
        # replay, recording and tracing read or write the host inside the block: no graphs then
        eager = any(x is not None for x in (fwd.routed, fwd.routes, fwd.picked, fwd.picks, fwd.trace))
        if self.config.cuda_graphs and train and fwd.capture is None and not eager:
            if not (x.is_cuda and use_kernels(self.config, x)):
                raise ValueError("cuda_graphs: the graphed blocks need CUDA and the GPU kernels (config.kernels)")
            y = self._block_graphs()(block, x, fwd, ids)
            if y is not None:
                return y
        if not (self.config.recompute and train):
            return block(x, fwd, ids)

        @contextlib.contextmanager
        def replaying():
            fwd.replay = True
            try:
                yield
            finally:
                fwd.replay = False

        return torch.utils.checkpoint.checkpoint(block, x, fwd, ids, use_reentrant=False,
                                                 context_fn=lambda: (contextlib.nullcontext(), replaying()))

    def _block_graphs(self):
        if self._graphs is None:
            c = self.ctx
            split = {k: v for k, v in (("tp", c.tp_size), ("ep", c.ep_size), ("cp", c.cp_size),
                                       ("pp", c.pp_size)) if v > 1}
            if split:
                raise ValueError(f"cuda_graphs: the graphed blocks run one model replica per process; this "
                                 f"layout splits it ({', '.join(f'{k}={v}' for k, v in split.items())})")
            self._graphs = BlockGraphs(self, [g for g in self.modules() if isinstance(g, Gate) and not g.is_hash])
        return self._graphs

    def _aux_sums(self, fwd: Fwd) -> dict[str, torch.Tensor]:
        """This stage's share of the auxiliary sums: each layer's term divided by the model's
        layer count of that kind, so the shares of all pipeline stages add up to the mean over
        the model's layers."""
        zero = torch.zeros((), device=fwd.layout.doc.device)
        out = {}
        if "indexer" in fwd.aux:
            out["indexer"] = torch.stack(fwd.indexer_terms).sum() / self._n_indexer_layers if fwd.indexer_terms \
                else zero
        if "balance" in fwd.aux:
            out["balance"] = torch.stack(fwd.balance_terms).sum() / self._n_balance_layers if fwd.balance_terms \
                else zero
        return out

    # ------------------------------------------------------------------ router bias
    @torch.no_grad()
    def update_router_bias(self, rate: float | None = None) -> None:
        """Aux-loss-free balancing: bias_e += rate * sign(mean_load - load_e) from the expert
        loads counted since the last call (training forwards only), then reset the counts."""
        rate = self.config.router_bias_update_rate if rate is None else rate
        for mod in self.modules():
            if isinstance(mod, Gate) and not mod.is_hash:
                load = mod.expert_load  # no update before any token was counted (no host wait)
                mod.bias += rate * torch.sign(load.mean() - load) * (load.sum() > 0)
                load.zero_()

    # ------------------------------------------------------------------ decoding
    def new_cache(self, slots: int, max_len: int, device: torch.device | str | None = None) -> KVCache:
        """Decoding state for `slots` sequences of up to `max_len` tokens each, allocated once."""
        if self.ctx.tp_size * self.ctx.pp_size * self.ctx.cp_size > 1:
            raise ValueError("incremental decoding runs one whole model replica (TP = PP = CP = 1)")
        dt = self.embed.weight.dtype
        layers = [layer.attn.new_cache(slots, max_len, dt, device) for layer in self.layers]
        return KVCache(layers, torch.zeros(slots, dtype=torch.long, device=device), max_len)

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], cache: KVCache, slots: list[int], record: Iterable[str] = ()):
        """Prompts (1-D token ids, any lengths >= 1) as the rows of one right-padded forward
        (padding never attends or pools); each prompt's state goes to its cache slot. Returns
        the logits after each prompt's last token [B, V]; with `record` ("routes", "picks") also
        a dict of the choices each prompt token made: the experts per learned MoE layer
        [B, S, L, k] (routing replay), the indexer's entries per CSA layer [B, S, C, K]."""
        lens = [int(p.numel()) for p in prompts]
        if min(lens) < 1 or max(lens) >= cache.max_len:
            raise ValueError(f"prompt lengths must be in [1, {cache.max_len - 1}], got {lens}")
        dev = cache.length.device
        ids, n = padded(prompts, lens).to(dev), torch.tensor(lens, device=dev)
        mask = torch.arange(max(lens), device=dev) < n[:, None]
        capture = PrefillCapture(at=n - 1)
        record = frozenset(record)
        out = self.forward(ids, attention_mask=mask, _capture=capture, record_routes="routes" in record,
                           record_picks="picks" in record)
        plan = FillPlan.of(lens, slots, self.config.sliding_window,
                           [layer.attn.ratio for layer in self.layers if layer.attn.ratio], dev)
        for lc, layer, captured in zip(cache.layers, self.layers, capture.layers, strict=True):
            layer.attn.fill(lc, plan, captured)
        cache.length[slots] = n.to(cache.length.device)
        logits = self.ctx.gather_vocab(out.logits)[:, 0]
        return (logits, {k: getattr(out, k) for k in record}) if record else logits

    @torch.no_grad()
    def extend(self, chunks: list[torch.Tensor], cache: KVCache, slots: list[int], record: Iterable[str] = ()):
        """Chunked prefill: chunk b (1-D token ids, >= 1) continues slot slots[b] after the
        tokens it holds (a prefill or earlier chunks); the rows run as one right-padded
        forward over the cache. Returns, as `prefill`, the logits after each chunk's last token
        [B, V] and with `record` the choices of each chunk token, [B, T, L, k] / [B, T, C, K].
        Reads the slots' lengths from the device once."""
        lens = [int(c.numel()) for c in chunks]
        starts = cache.length[torch.tensor(slots, device=cache.length.device)].tolist()
        if min(lens) < 1 or max(s + n for s, n in zip(starts, lens, strict=True)) >= cache.max_len:
            raise ValueError(f"chunks of {lens} tokens after {starts} must be >= 1 tokens and end before "
                             f"{cache.max_len} (the cache's length)")
        dev, c = cache.length.device, self.config
        ids = padded(chunks, lens).to(dev)
        plan = ExtendPlan.of(starts, lens, slots, c.sliding_window,
                             [layer.attn.ratio for layer in self.layers if layer.attn.ratio], dev)
        ropes = self._memo_ropes()
        record = frozenset(record)
        routes = {} if "routes" in record else None
        picks = {} if "picks" in record else None
        x = self._streams(self.embed(ids))  # [B, T, n, d]
        for layer, lc in zip(self.layers, cache.layers, strict=True):
            x = layer.extend(x, lc, plan, ropes, ids, routes, picks)
        cache.length[plan.slots] += torch.tensor(lens, device=dev)
        x = x[torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev) - 1][:, None]  # [B, 1, n, d]
        logits = self.ctx.gather_vocab(self._head(head_collapse(self, c, x)).logits())[:, 0]
        return (logits, self._choices(ids, routes, picks)) if record else logits

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor, record: Iterable[str] = ()):
        """Next-token logits [B, V] after input_ids [B], row b being the next token of slot
        slots[b] (each slot at its own position); the slots advance by one token. With `record`
        ("routes", "picks") also a dict of each input token's choices: the experts per learned
        MoE layer [B, L, k], the indexer's entries (block numbers) per CSA layer [B, C, K]."""
        slots = slots.to(cache.length.device)
        pos = cache.length[slots]  # [B]
        if not pos.is_cuda and int(pos.max()) >= cache.max_len:  # on a GPU the caller keeps count (no wait)
            raise ValueError(f"a slot is full ({cache.max_len} tokens)")
        ids = input_ids.reshape(-1, 1)
        ropes = self._memo_ropes()
        x = self._streams(self.embed(ids))
        record = frozenset(record)
        routes = {} if "routes" in record else None
        picks = {} if "picks" in record else None
        for layer, lc in zip(self.layers, cache.layers, strict=True):
            x = layer.step(x, lc, slots, pos, ropes, ids, routes, picks)
        cache.length[slots] += 1
        logits = self.ctx.gather_vocab(self._head(head_collapse(self, self.config, x)).logits())[:, 0]
        if not record:
            return logits
        return logits, {k: v[:, 0] for k, v in self._choices(ids, routes, picks).items()}  # [B, L, k], [B, C, K]

    def _memo_ropes(self) -> dict[str, Rope]:
        """Rotary tables computed where first asked and shared by the layers (`Rope.at` with a key)."""
        return {"swa": Rope(self.inv_freq_swa, None, None, memo={}),
                "compressed": Rope(self.inv_freq_compressed, None, None, memo={})}

    def _choices(self, ids: torch.Tensor, routes: dict | None, picks: dict | None) -> dict[str, torch.Tensor]:
        """The experts and indexer entries the cache paths recorded, by layer, stacked for ids
        [B, T]: routes [B, T, L, k] (L = 0: no learned router), picks [B, T, C, K]."""
        c, out = self.config, {}
        for name, got, k in (("routes", routes, c.num_experts_per_tok), ("picks", picks, c.index_topk)):
            if got is not None:
                got = [got[i].view(*ids.shape, k) for i in sorted(got)]
                out[name] = torch.stack(got, 2) if got else ids.new_zeros(*ids.shape, 0, k)
        return out

    # ------------------------------------------------------------------ HF layout
    def save_pretrained(self, directory: str | Path, max_shard_bytes: int = 2 ** 30) -> None:
        """config.json + model-XXXXX-of-YYYYY.safetensors + index, DeepSeek's tensor names."""
        from .hf_io import save_safetensors_shards

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        sd = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        save_safetensors_shards(sd, directory, max_shard_bytes=max_shard_bytes)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32,
                        ctx: ParallelContext | None = None) -> DeepSeekV4ForCausalLM:
        """Load an HF-layout checkpoint (FP8 block / FP4 expert weights dequantized)."""
        from .hf_io import load_safetensors_dir

        cfg = DeepSeekV4Config.from_pretrained(directory)
        model = cls(cfg, dtype=dtype, ctx=ctx, seed=None)
        tensors = load_safetensors_dir(directory)
        own = model.state_dict()
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise ValueError(f"{directory}: checkpoint does not match the config: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{'...' if len(unexpected) > 5 else ''}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"{directory}: tensor '{name}' has shape {list(t.shape)}, "
                                 f"the config needs {list(own[name].shape)}")
        with torch.no_grad():
            for name, t in own.items():
                t.copy_(tensors[name].to(t.dtype))
        return model
