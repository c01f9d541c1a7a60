"""Where layers get their linear and embedding modules from, and how tokens move.

The model definition asks this context for every weight-bearing linear/embedding and for
the few cross-rank moves of a sharded run, so the same layer code runs in one process
(plain torch and identities, here) and sharded inside Megatron workers (a context that
returns tensor-parallel layers and real collectives). The context reports:
- tp: heads, output groups, expert widths and the vocabulary are split over TP ranks;
- pp: this stage's contiguous range of layers (first stage embeds, last stage has the
  heads, MTP and losses);
- cp: this rank's query tokens, two of 2 x cp equal pieces (piece r and piece 2cp-1-r:
  every rank gets the same causal work); K = V and the compressor projections are
  computed on the local tokens and all-gathered over the sequence;
- ep: the routed experts this rank holds; each (token, slot) pair travels to the rank
  holding its expert, and the outputs travel back to be summed per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .ops import (
    _cuda_matmul_precision,
    accumulate_wgrad,
    bf16_on_cuda,
    fp32_linear,
    linear,
    main_grad_of,
    main_grad_written,
    split_bf16,
)

# fp32 logits [rows, V/tp] held at once by the chunked head (256 MiB; the split backward holds
# their two bf16 terms beside them, as much again)
HEAD_CHUNK_ELEMENTS = 1 << 26
# bytes of the logit gradient's bf16 GEMM operand (dz's rows) the head's backward gathers over
# chunks for one weight-gradient GEMM: each such GEMM reads and writes the whole fp32 main_grad
# [V/tp, d] (2 GiB at V4's vocabulary), which a GEMM per chunk did 8 times a sequence of 4096
HEAD_WGRAD_BYTES = 1 << 30


@dataclass
class VocabHead:
    """An LM (or MTP) head not yet applied: hidden states y [..., d] and this TP rank's
    vocabulary rows `weight` [V/tp, d]. Training losses take log-probabilities and entropy
    from it over chunks of rows (ctx.head_logprobs), so no [..., V] fp32 logits are kept for
    the backward; `logits()` builds them whole (evaluation, decoding, tests)."""

    y: torch.Tensor
    weight: torch.Tensor
    ctx: ParallelContext
    tf32: bool = False
    fused: bool = False  # the log-softmax kernels (kernels.cross_entropy) for the chunks
    keep_logits: bool = False  # the backward reads the forward's logits (config.head_keep_logits)
    grad_terms: int = 2  # bf16 terms of the logits' gradient in the backward GEMMs (config.head_grad_terms)

    def logits(self) -> torch.Tensor:
        return self.ctx.vocab_logits(self.y, self.weight, self.tf32)


class _HeadLogprobs(torch.autograd.Function):
    """log p(label) [N] from y [N, d] and vocabulary rows w [V/tp, d], chunk by chunk: the
    forward keeps y, w and each row's log-sum-exp; the backward recomputes a chunk's logits,
    dz = g * (onehot(label) - softmax(z)) in place of the logits (one [c, V/tp] fp32 buffer a
    chunk: autograd through cross-entropy held four), and returns dz @ w and dz^T @ y. One TP
    rank: the forward is F.cross_entropy of the chunk (one chunk gives the full logits' bits),
    the backward normalises the exponentials by their row sum again. TP ranks: the log-sum-exp
    and the label's logit are each one reduction over the ranks per chunk, the exponentials
    taken in place of the logits. fused: the chunk's row statistics in one read and its gradient
    in one pass (kernels.cross_entropy), from the log-sum-exp kept on one rank too. Where w has
    a main_grad (the trainer) dz^T @ y is added there in fp32 and no weight gradient returned;
    with tf32 on bf16 CUDA y and w the backward GEMMs read dz as two bf16 terms (`head_split`;
    TP ranks get an fp32 y from head_input, so their GEMMs stay on TF32). keep: the forward's
    chunk logits are kept for the backward instead of computed again; terms = 1: dz rounded
    to bf16 for both backward GEMMs (on every device, so the rounding is the same on CPU)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, pc: ParallelContext, tf32: bool,
                rows: int, fused: bool, scale: float = 1.0, keep: bool = False, terms: int = 2) -> torch.Tensor:
        v = w.shape[0]
        ids = labels - pc.tp_rank * v
        mine = (ids >= 0) & (ids < v)
        ids = ids.clamp(0, v - 1)
        out, lses, kept = [], [], []
        for i in range(0, y.shape[0], rows):
            z = _scaled(fp32_linear(y[i:i + rows], w, tf32), scale)  # [c, V/tp]
            if keep:
                kept.append(z)  # read-only below, but for the copy the TP path takes
            if fused:
                from .kernels.cross_entropy import row_stats

                m, s, picked = row_stats(z, ids[i:i + rows])  # [c] each
                if pc.tp_size == 1:
                    lse = m + torch.log(s)
                else:
                    top = pc.max_over_tp(m)
                    lse = top + torch.log(pc.sum_over_tp(s * torch.exp(m - top)))
                    picked = pc.sum_over_tp(torch.where(mine[i:i + rows], picked, 0.0))
                out.append(picked - lse)
                lses.append(lse)
                continue
            if pc.tp_size == 1:
                out.append(-F.cross_entropy(z, ids[i:i + rows], reduction="none"))
                continue
            picked = torch.where(mine[i:i + rows], z.gather(-1, ids[i:i + rows, None])[:, 0], 0.0)
            m = pc.max_over_tp(z.amax(-1))  # any shift works; the max avoids overflow
            e = z.sub(m[:, None]) if keep else z.sub_(m[:, None])  # unkept z is spent: in place
            lse = m + torch.log(pc.sum_over_tp(e.exp_().sum(-1)))
            out.append(pc.sum_over_tp(picked) - lse)
            lses.append(lse)
        lse = torch.cat(lses) if lses else y.new_zeros(0, dtype=torch.float32)  # empty: one rank, torch
        ctx.save_for_backward(y, w, ids, mine, lse)
        ctx.tf32, ctx.rows, ctx.one_rank, ctx.fused, ctx.scale = tf32, rows, pc.tp_size == 1, fused, scale
        ctx.kept, ctx.terms = kept if keep else None, terms
        return torch.cat(out) if out else y.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, w, ids, mine, lse = ctx.saved_tensors
        c, d, v = ctx.rows, y.shape[-1], w.shape[0]
        split = ctx.tf32 and head_split(y, w)
        # the trainer: dz^T @ y added into main_grad, no [V/tp, d] gradient returned, w announced
        # to its DDP (main_grad_written: the overlapped reduction counts it ready)
        want_dw = ctx.needs_input_grad[1]
        main = main_grad_of(w) if want_dw else None
        dw = main if main is not None or not want_dw else torch.zeros_like(w, dtype=torch.float32)
        dy = torch.empty(y.shape, dtype=torch.float32, device=y.device)
        wf = None if split else w.float()
        kept, ctx.kept = ctx.kept, None  # each chunk's buffer freed as its gradient is done
        # each chunk's GEMM operand: bf16 dz (one term: [n, V]; two: [2n, V], a token's hi row
        # then its lo row) or fp32 dz, written where the weight-gradient GEMM will read it
        per_row = 2 if split and ctx.terms == 2 else 1
        wgrad = _WgradRows(dw, v, torch.bfloat16 if split else torch.float32, y.device, per_row * c,
                           per_row * y.shape[0])
        with _cuda_matmul_precision(ctx.tf32):
            for i in range(0, y.shape[0], c):
                sl = slice(i, i + c)
                if kept is not None:
                    dz, kept[i // c] = kept[i // c], None
                else:
                    dz = _scaled(fp32_linear(y[sl], w, ctx.tf32), ctx.scale)  # [c, V/tp] logits: the forward's own
                # dz = g onehot(label) - g softmax(z), in place: the chunk's only [c, V/tp] buffer
                # (one rank: every row's clamped label, as cross-entropy read it)
                hit = g[sl] if ctx.one_rank else torch.where(mine[sl], g[sl], 0.0)
                n = dz.shape[0]
                if ctx.fused and split and ctx.scale == 1.0:  # dz straight into the GEMMs' bf16 terms
                    from .kernels.cross_entropy import softmax_grad_terms

                    op = softmax_grad_terms(dz, lse[sl], ids[sl], g[sl], hit,
                                            wgrad.slot(per_row * n).view(n, per_row * v)).view(per_row * n, v)
                    del dz
                    if per_row == 2:  # exact products of dz = hi + lo, summed in fp32
                        dy[sl] = torch.mm(op, w, out_dtype=torch.float32).view(n, 2, d).sum(1)
                        wgrad.add(op, y[sl, None].expand(n, 2, d).reshape(2 * n, d))
                    else:
                        dy[sl] = torch.mm(op, w, out_dtype=torch.float32)
                        wgrad.add(op, y[sl])
                    continue
                if ctx.fused:
                    from .kernels.cross_entropy import softmax_grad_

                    softmax_grad_(dz, lse[sl], ids[sl], g[sl], hit)
                elif ctx.one_rank:  # no log-sum-exp kept: softmax by the row's max and sum
                    dz.sub_(dz.amax(-1, keepdim=True)).exp_()
                    dz.mul_(-g[sl, None] / dz.sum(-1, keepdim=True))
                else:
                    dz.sub_(lse[sl, None]).exp_().mul_(-g[sl, None])
                if not ctx.fused:
                    dz.scatter_add_(-1, ids[sl, None], hit[:, None])
                _scaled(dz, ctx.scale)  # the logits' own gradient: d(z scale)/dz = scale
                if ctx.terms == 1 and not split:  # dz rounded to bf16, its values in fp32 (as on bf16 CUDA)
                    dz = dz.to(torch.bfloat16).float()
                if split and ctx.terms == 2:  # exact products of dz = hi + lo, summed in fp32
                    op = split_bf16(dz, fused=ctx.fused, out=wgrad.slot(2 * n).view(n, 2 * v)).view(2 * n, v)
                    dy[sl] = torch.mm(op, w, out_dtype=torch.float32).view(n, 2, d).sum(1)
                    wgrad.add(op, y[sl, None].expand(n, 2, d).reshape(2 * n, d))
                elif split:  # one bf16 term: bf16 GEMMs with fp32 sums
                    op = wgrad.slot(n).copy_(dz)
                    dy[sl] = torch.mm(op, w, out_dtype=torch.float32)
                    wgrad.add(op, y[sl])
                else:  # fp32 operands: dz itself, a GEMM a chunk (_WgradRows gathers bf16 only)
                    torch.mm(dz, wf, out=dy[sl])
                    wgrad.add(dz, y[sl].float())
            wgrad.flush()
        if main is not None:
            main_grad_written(w)
        dw = None if main is not None or dw is None else dw.to(w.dtype)
        return dy.to(y.dtype), dw, None, None, None, None, None, None, None, None


class _WgradRows:
    """The head backward's weight gradient, dw += dz^T y, over several chunks' rows at once:
    slot(rows) is where a chunk writes its dz operand, add(op, y) books it, and one GEMM takes
    every booked row when the next slot would not fit (or at flush). Gathers only bf16 operands
    (their chunk's conversion writes into the slot; an fp32 operand would cost a copy) and only
    where a backward has more than one chunk, in one buffer of at most HEAD_WGRAD_BYTES and the
    backward's own rows; otherwise (`gathers` False) each add runs its GEMM. dw None: none runs."""

    def __init__(self, dw: torch.Tensor | None, cols: int, dtype: torch.dtype, device, chunk_rows: int,
                 total_rows: int):
        self.dw, self.cols, self.dtype, self.device = dw, cols, dtype, device
        chunks = -(-total_rows // chunk_rows)  # this backward's chunks
        if dw is not None and dtype == torch.bfloat16:
            chunks = min(chunks, max(1, HEAD_WGRAD_BYTES // (2 * cols * chunk_rows)))
        else:
            chunks = 1
        self.cap = min(chunks * chunk_rows, total_rows)
        self.gathers = chunks > 1
        self.buf: torch.Tensor | None = None
        self.rows, self.ys = 0, []

    def slot(self, rows: int) -> torch.Tensor:
        if self.rows + rows > self.cap:
            self.flush()
        if self.buf is None:
            self.buf = torch.empty(self.cap, self.cols, dtype=self.dtype, device=self.device)
        return self.buf[self.rows:self.rows + rows]

    def add(self, op: torch.Tensor, y: torch.Tensor) -> None:
        if self.dw is None:
            return
        if not self.gathers:
            accumulate_wgrad(self.dw, op, y)
            return
        self.ys.append(y)
        self.rows += op.shape[0]

    def flush(self) -> None:
        if self.rows:
            accumulate_wgrad(self.dw, self.buf[:self.rows], torch.cat(self.ys) if len(self.ys) > 1 else self.ys[0])
        self.rows, self.ys = 0, []


def _scaled(z: torch.Tensor, scale: float) -> torch.Tensor:
    """z * scale in place (the logits of a sampling temperature 1 / scale); 1: z untouched."""
    return z if scale == 1.0 else z.mul_(scale)


def head_split(y: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the head's backward GEMMs take the fp32 logit gradient as two bf16 terms
    (bf16 CUDA y and w; as ops.split_products for the other fp32 projections) instead of
    TF32 GEMMs of fp32 copies of y and w. Looked up at call time (the A/B swaps it)."""
    return bf16_on_cuda(y, w)


def cp_chunk(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Token indices [S/cp] of context-parallel rank `rank`: pieces rank and 2cp-1-rank of
    2cp equal pieces, so each rank holds as many early (cheap) as late (expensive) causal
    queries."""
    if seq % (2 * cp):
        raise ValueError(f"context parallel size {cp} needs the sequence length ({seq}) to be a multiple of "
                         f"{2 * cp} (two pieces per rank): pad the micro-batch")
    n = seq // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat((torch.arange(rank * n, (rank + 1) * n), torch.arange(late * n, (late + 1) * n)))


class Linear(nn.Linear):
    """nn.Linear without bias through ops.linear: the same parameter, state-dict key and class
    name (the memory plan's ledger counts saved activations by module class)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


@dataclass
class ParallelContext:
    """Single-process context: plain torch modules, no sharding."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0

    # ------------------------------------------------------------------ modules
    def column_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Output dim sharded over TP (q/kv up-projections, expert w1/w3)."""
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def row_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Input dim sharded over TP; output reduced (wo_b, expert w2)."""
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def replicated_linear(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        """Same weight on every rank (down-projections to latents, compressors, gates); its
        weight gradient goes into main_grad where the trainer gives it one (ops.linear)."""
        return Linear(in_features, out_features, dtype)

    def embedding(self, num: int, dim: int, dtype: torch.dtype) -> nn.Module:
        return nn.Embedding(num, dim, dtype=dtype)

    def sharded_parameter(self, full_shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> nn.Parameter:
        """A parameter split along `dim` over TP ranks (attn_sink over heads). Marked the way
        Megatron marks its own (tensor_model_parallel, partition_dim) so init and checkpoint
        code can find the full tensor."""
        shape = list(full_shape)
        shape[dim] //= self.tp_size
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = self.tp_size > 1, dim, 1
        return p

    def mark_expert(self, module: nn.Module) -> None:
        """A routed expert's parameters (reduced over the expert-data-parallel group)."""

    # ------------------------------------------------------------------ TP
    def to_tp_region(self, t: torch.Tensor) -> torch.Tensor:
        """A replicated tensor about to be consumed by TP-split work (the shared K = V of all
        heads, routing weights of split experts): identity forward, gradient summed over TP."""
        return t

    def reduce_from_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Partial results of TP-split work (routed experts' split widths) summed over TP
        ranks: all-reduce forward, identity backward."""
        return t

    def sum_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a detached per-rank partial (attention mass of the local heads)."""
        return t

    def max_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over TP ranks of a detached tensor."""
        return t

    def vocab_logits(self, y: torch.Tensor, weight: torch.Tensor, tf32: bool = False) -> torch.Tensor:
        """fp32 logits [..., V/tp] of this rank's vocabulary shard (the head's weight rows)."""
        return fp32_linear(y, weight, tf32)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocabulary shards of all TP ranks -> full logits [..., V] (decoding only: training
        losses work on the shards)."""
        return logits

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """log p(labels) [...] from vocabulary-sharded fp32 logits [..., V/tp], differentiable,
        without gathering the vocabulary. Labels outside [0, V) (IGNORE_INDEX) give an
        arbitrary finite value. One rank: PyTorch's fused cross-entropy. TP ranks: the
        log-sum-exp and the label's logit are each one sum over ranks (benchmarks/logprobs_gpu.py:
        on an H100 this form is 1.4x the fused one, a logsumexp-based one 1.9x)."""
        v = logits.shape[-1]
        if self.tp_size == 1:
            return -F.cross_entropy(logits.reshape(-1, v), labels.clamp(0, v - 1).reshape(-1),
                                    reduction="none").view(labels.shape)
        m = self.max_over_tp(logits.detach().amax(-1))  # [...]; any shift works, the max avoids overflow
        lse = m + torch.log(self.reduce_from_tp(torch.exp(logits - m[..., None]).sum(-1)))
        ids = labels - self.tp_rank * v
        mine = (ids >= 0) & (ids < v)
        picked = logits.gather(-1, ids.clamp(0, v - 1)[..., None])[..., 0]
        return self.reduce_from_tp(torch.where(mine, picked, 0.0)) - lse

    def head_input(self, y: torch.Tensor) -> torch.Tensor:
        """The hidden state as every TP rank's head shard reads it (one rank: itself)."""
        return y

    def head_logprobs(self, head: VocabHead, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """token_logprobs(head.logits() / temperature, labels), computed over chunks of rows with
        no [..., V] logits kept for the backward (_HeadLogprobs). Labels outside [0, V) give an
        arbitrary finite value."""
        y = self.head_input(head.y)
        rows = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
        lp = _HeadLogprobs.apply(y.reshape(-1, y.shape[-1]), head.weight, labels.reshape(-1), self, head.tf32, rows,
                                 head.fused, 1.0 / temperature, head.keep_logits, head.grad_terms)
        return lp.view(labels.shape)

    @torch.no_grad()
    def head_entropy(self, head: VocabHead, temperature: float = 1.0) -> torch.Tensor:
        """token_entropy(head.logits() / temperature) [...] over chunks of rows (a metric: detached)."""
        y = head.y.reshape(-1, head.y.shape[-1])
        rows = max(1, HEAD_CHUNK_ELEMENTS // head.weight.shape[0])
        parts = [self.token_entropy(_scaled(fp32_linear(y[i:i + rows], head.weight, head.tf32), 1.0 / temperature))
                 for i in range(0, y.shape[0], rows)]
        return (torch.cat(parts) if parts else y.new_zeros(0, dtype=torch.float32)).view(head.y.shape[:-1])

    @torch.no_grad()
    def token_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy [...] of the softmax over vocabulary-sharded logits [..., V/tp] (a metric:
        detached). H = log-sum-exp(z) - E_p[z], each sum one reduction over the TP ranks."""
        z = logits.float()
        m = self.max_over_tp(z.amax(-1))
        e = torch.exp(z - m[..., None])
        s = self.sum_over_tp(e.sum(-1))
        return m + torch.log(s) - self.sum_over_tp((e * z).sum(-1)) / s

    # ------------------------------------------------------------------ PP
    def stage_layers(self, n_layers: int) -> range:
        """This pipeline stage's layers: contiguous, earlier stages take the remainder."""
        if n_layers < self.pp_size:
            raise ValueError(f"{n_layers} layers cannot fill {self.pp_size} pipeline stages")
        per, extra = divmod(n_layers, self.pp_size)
        start = self.pp_rank * per + min(self.pp_rank, extra)
        return range(start, start + per + (self.pp_rank < extra))

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------ CP
    def seq_chunk(self, seq: int) -> slice | torch.Tensor:
        """The query tokens this CP rank computes: all (one rank), else the ascending indices
        [S/cp] of pieces r and 2cp-1-r of 2cp equal pieces (cp_chunk)."""
        return slice(None) if self.cp_size == 1 else cp_chunk(seq, self.cp_size, self.cp_rank)

    def gather_seq(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S/cp, ...] this rank's tokens (seq_chunk) -> [B, S, ...] all tokens in order; the
        backward sums the gradients of all CP ranks and keeps this rank's tokens."""
        return t

    # ------------------------------------------------------------------ EP
    def local_experts(self, n_experts: int) -> range:
        """Global ids of the routed experts this rank holds."""
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def ep_dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int):
        """The pairs this rank's experts compute, from the tokens x [N, d] routed to experts
        idx [N, k] (of n_experts) with weights w [N, k]: (rows [R, d], their experts [R, k'],
        weights [R, k'], route). One process: the tokens themselves (k' = k). EP: each
        (token, slot) pair whose expert lives here, from every EP rank, one row each (k' = 1),
        grouped by local expert. Backward: gradients sent back to the pairs' ranks."""
        return x, idx, w, None

    def ep_combine(self, out: torch.Tensor, route) -> torch.Tensor:
        """Expert outputs of the dispatched rows [R, d] (summed over their k' slots) -> this
        rank's tokens [N, d]: each token's outputs from every rank, its k slots summed in
        slot order in fp32 (as routed_experts sums them in one process)."""
        return out
