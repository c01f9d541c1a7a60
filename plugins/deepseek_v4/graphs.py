"""CUDA graphs of the training blocks (config.cuda_graphs).

A training step of the ~1B model is host-bound: each block's forward and backward is about a
thousand small launches, and the GPU waits for the host between them. Here every block (main
layers, then MTP) is captured once per input shape (`_Graphed`, after the pattern of
`torch.cuda.make_graphed_callables`) and each forward and backward replays as one graph.

What a graph needs, and where it comes from:
- Tensors in, tensors out: `_BlockStep` takes the block input, the token ids, the layout's
  (document, position) and the RoPE tables, rebuilds the per-forward facts (`Fwd`) inside the
  graph, and returns the block output with its auxiliary loss terms, which the caller appends
  to its own `Fwd`.
- Static shapes and no host reads inside a block: the layout's compression blocks have the
  static count G = S // r (`SequenceLayout.static_blocks`, set on the kernel path always, so
  a graphed and an eager step compute the same thing).
- Replays in capture order: forwards of blocks 0..N-1, then backwards N-1..0, one micro-batch
  at a time (no pipeline interleaving), all sharing one memory pool.
- Parameter gradients never leave the backward graph: it adds each into the parameter's
  `main_grad` (Megatron DDP's fp32 buffer, at a fixed address) as DDP's hook would, and the
  bf16 gradient's memory goes back to the pool for the next block's capture. (The grouped
  expert GEMMs, the projections (ops.projection_main_grad) and Megatron's linears, under
  gradient_accumulation_fusion, add theirs into main_grad themselves: the aliases carry it.)
  DDP's hooks see no gradient: after each replay the parameters whose main_grad the graph
  wrote are announced to it (ops.main_grad_written), so the overlapped reduction
  (miles/train/ddp.py) counts them ready and reduces their buckets during the backward, as
  it does for the eager blocks.
- Consecutive main layers share buffers: layer i+1's static input is layer i's static output,
  and layer i's output gradient is layer i+1's input gradient, so neither is copied.
Only one process per model replica (TP = EP = CP = PP = 1; data parallelism is outside the
blocks) and no recompute; `DeepSeekV4ForCausalLM` checks both.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn

from .forward import Fwd, Rope
from .layout import SequenceLayout
from .ops import main_grad_written


class _BlockStep(nn.Module):
    """One block as a function of tensors: (x, ids, doc, pos, cos/sin of both RoPE kinds) ->
    (x', indexer terms..., balance terms...)."""

    def __init__(self, block: nn.Module, inv_freq: dict[str, torch.Tensor], aux: frozenset[str]):
        super().__init__()
        self.block = block
        self.inv_freq, self.aux = inv_freq, aux  # not submodules: only the block's parameters are inputs
        self.n_indexer = 0

    def forward(self, x, ids, doc, pos, cos_swa, sin_swa, cos_comp, sin_comp):
        layout = SequenceLayout(doc=doc, pos=pos, static_blocks=True)
        ropes = {"swa": Rope(self.inv_freq["swa"], cos_swa, sin_swa),
                 "compressed": Rope(self.inv_freq["compressed"], cos_comp, sin_comp)}
        fwd = Fwd(layout, ropes, aux=self.aux)
        y = self.block(x, fwd, ids)
        self.n_indexer = len(fwd.indexer_terms)
        return (y, *fwd.indexer_terms, *fwd.balance_terms)


def _inputs(x: torch.Tensor, ids: torch.Tensor, fwd) -> tuple[torch.Tensor, ...]:
    r = fwd.ropes
    return (x, ids, fwd.layout.doc, fwd.layout.pos, r["swa"].cos, r["swa"].sin, r["compressed"].cos,
            r["compressed"].sin)


class _Graphed:
    """One block's forward and backward as CUDA graphs over static buffers.

    Not `torch.cuda.make_graphed_callables`: its backward graph differentiates the module's own
    parameters, and Megatron's DDP made their gradient accumulators on the default stream,
    which a capture on another stream may not wait on. Here the graphs run on detached aliases
    of the parameters (same storage, leaves of the capture stream), and the backward graph adds
    their gradients into the real parameters' `main_grad`."""

    def __init__(self, step: _BlockStep, args: tuple[torch.Tensor, ...], stream: torch.cuda.Stream):
        self.step, self.stream = step, stream
        named = dict(step.named_parameters())
        self.names, self.params = list(named), list(named.values())
        with torch.cuda.stream(stream):
            self.inputs = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
            self.alias = [p.detach().requires_grad_(p.requires_grad) for p in self.params]
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.chained = False  # inputs[0] is the previous block's static output
        self.probe = next((p for p in self.params if p.requires_grad), None)  # its main_grad must stay put
        self.main_grad_ptr = self.probe.main_grad.data_ptr() if self.probe is not None else None

    def take_input(self, prev_out: torch.Tensor) -> None:
        """Read the block input from the previous block's static output (before the capture)."""
        assert prev_out.shape == self.inputs[0].shape and prev_out.dtype == self.inputs[0].dtype
        self.inputs[0] = prev_out.detach().requires_grad_(self.inputs[0].requires_grad)
        self.chained = True

    def take_grad_out(self, next_grad_in: torch.Tensor) -> None:
        """Read the output gradient from the next block's static input gradient."""
        assert next_grad_in.shape == self.grad_out[0].shape and next_grad_in.dtype == self.grad_out[0].dtype
        self.grad_out[0] = next_grad_in

    def _run(self) -> tuple[torch.Tensor, ...]:
        return torch.func.functional_call(self.step, dict(zip(self.names, self.alias, strict=True)),
                                          tuple(self.inputs))

    def _diff(self) -> list[torch.Tensor]:
        return [t for t in (*self.inputs, *self.alias) if t.requires_grad]

    def _alias_main_grads(self, real: bool) -> None:
        """Give the aliases the parameters' main_grad (ops that add their weight gradient
        there themselves: the grouped expert GEMMs, the projections, Megatron's linears), or zeroed scratch
        ones for the warm-up, whose gradients must not reach the real buffers."""
        for p, a in zip(self.params, self.alias, strict=True):
            if a.requires_grad and hasattr(p, "main_grad"):
                a.main_grad = p.main_grad if real else torch.zeros_like(p.main_grad)

    def warm_up(self) -> None:
        self._alias_main_grads(real=False)
        out = [o for o in self._run() if o.requires_grad]
        torch.autograd.grad(out, self._diff(), [torch.ones_like(o) for o in out], allow_unused=True)
        self._alias_main_grads(real=True)

    def capture_forward(self, pool) -> None:
        with torch.cuda.graph(self.fwd, pool=pool, stream=self.stream):
            self.out = self._run()
        self.grad_out = [torch.zeros_like(o) if o.requires_grad else None for o in self.out]

    def capture_backward(self, pool) -> None:
        """The backward graph; records which parameters' main_grad it writes (`written`: those
        with a gradient here and those an op adds into main_grad itself, which announce their
        alias), the ones each replay announces to DDP. Not the rest: the MTP block's input and
        head parameters (enorm, e_proj, hc_head_*, ...) train outside its graph, eagerly."""
        out = [o for o in self.out if o.requires_grad]
        written: set[int] = set()
        for i, a in enumerate(self.alias):
            a.main_grad_ready = partial(written.add, i)  # ops.main_grad_written on the alias
        with torch.cuda.graph(self.bwd, pool=pool, stream=self.stream):
            grads = iter(torch.autograd.grad(out, self._diff(), [g for g in self.grad_out if g is not None],
                                             allow_unused=True))
            self.grad_in = [next(grads) if t.requires_grad else None for t in self.inputs]
            g = None
            for i, (p, a) in enumerate(zip(self.params, self.alias, strict=True)):
                g = next(grads) if a.requires_grad else None
                if g is not None:
                    p.main_grad.add_(g)  # what DDP's hook does with p.grad, here inside the graph
                    written.add(i)
            del g, grads  # back to the pool: the next capture reuses the memory
        for a in self.alias:
            del a.main_grad_ready
        self.written = [self.params[i] for i in sorted(written)]

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _Replay.apply(self, *args)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: _Graphed, *args):
        for k, (static, a) in enumerate(zip(g.inputs, args, strict=True)):
            if static.data_ptr() != a.data_ptr():
                if k == 0 and g.chained:  # a copy would overwrite the previous block's output
                    raise RuntimeError("cuda_graphs: a main layer's input is not the previous layer's output")
                static.copy_(a)
        g.fwd.replay()
        ctx.g = g
        return tuple(o.detach() for o in g.out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g = ctx.g
        for static, d in zip(g.grad_out, grads, strict=True):
            if static is not None and static.data_ptr() != d.data_ptr():
                static.copy_(d)
        if g.probe is not None and g.probe.main_grad.data_ptr() != g.main_grad_ptr:
            raise RuntimeError("cuda_graphs: the parameters' main_grad buffers moved since the capture (a new "
                               "DDP wrapper around a graphed model): build the model again")
        g.bwd.replay()
        for p in g.written:
            main_grad_written(p)
        return (None, *(t.detach() if t is not None else None for t in g.grad_in))


class BlockGraphs:
    """The model's blocks graphed, one set per input signature (shapes, dtypes, auxiliary
    losses); at most `max_sets` sets are kept (each holds its own memory pool, the size of a
    step's activations), later signatures run eagerly: pad micro-batches to one length."""

    def __init__(self, model: nn.Module, gates: list[nn.Module], max_sets: int = 1):
        """gates: the model's routing gates that count expert load (restored after the warm-up)."""
        self.model, self.gates, self.max_sets = model, gates, max_sets
        self._sets: dict[tuple, dict[int, _Graphed]] = {}
        self._eager: set[tuple] = set()
        self.captures = 0

    def __call__(self, block: nn.Module, x: torch.Tensor, fwd, ids: torch.Tensor) -> torch.Tensor | None:
        """The block's output through its graph, with its auxiliary terms appended to `fwd`;
        None when this signature has no graphs (the caller runs the block eagerly)."""
        args = _inputs(x, ids, fwd)
        key = (tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args), fwd.aux)
        steps = self._sets.get(key)
        if steps is None:
            if len(self._sets) >= self.max_sets:
                if key not in self._eager:
                    self._eager.add(key)
                    warnings.warn(f"cuda_graphs: blocks with inputs {[list(a.shape) for a in args[:2]]} run "
                                  f"eagerly: {self.max_sets} input signature(s) captured already (pad "
                                  f"micro-batches to one length to replay them all)", stacklevel=2)
                return None
            steps = self._sets[key] = self._capture(args, fwd.aux)
        graphed = steps[id(block)]
        y, *terms = graphed(*args)
        n = graphed.step.n_indexer
        fwd.indexer_terms.extend(terms[:n])
        fwd.balance_terms.extend(terms[n:])
        return y

    def _capture(self, args: tuple[torch.Tensor, ...], aux: frozenset[str]) -> dict[int, _Graphed]:
        m = self.model
        blocks = [*m.layers, *m.mtp]  # the order they run in
        if not all(hasattr(p, "main_grad") for b in blocks for p in b.parameters() if p.requires_grad):
            raise RuntimeError("cuda_graphs: train under Megatron's DDP (miles.train.worker.TrainWorker): the "
                               "backward graph adds each parameter's gradient into its main_grad")
        inv = {"swa": m.inv_freq_swa, "compressed": m.inv_freq_compressed}
        steps = [_BlockStep(b, inv, aux) for b in blocks]
        gates = self.gates
        loads = [g.expert_load.clone() for g in gates]
        # Warm-up (autotuning, lazy allocations), then every forward in run order and every
        # backward in reverse, on one side stream and one memory pool: replays must come in
        # that order, one micro-batch at a time, so each reuses memory as its capture did.
        stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        stream.wait_stream(torch.cuda.current_stream())
        graphed = [_Graphed(s, args, stream) for s in steps]
        with torch.cuda.stream(stream):
            for g in graphed:
                for _ in range(2):
                    g.warm_up()
        torch.cuda.synchronize()
        chain = len(m.layers)  # main layer i+1 takes layer i's output as it is
        for i, g in enumerate(graphed):
            if 0 < i < chain:
                g.take_input(graphed[i - 1].out[0])
            g.capture_forward(pool)
        for i in reversed(range(len(graphed))):
            if i + 1 < chain and graphed[i + 1].grad_in[0] is not None and graphed[i].grad_out[0] is not None:
                graphed[i].take_grad_out(graphed[i + 1].grad_in[0])
            graphed[i].capture_backward(pool)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.no_grad():  # the warm-up's routing counted nothing
            for g, load in zip(gates, loads, strict=True):
                g.expert_load.copy_(load)
        self.captures += 1
        return {id(b): g for b, g in zip(blocks, graphed, strict=True)}
