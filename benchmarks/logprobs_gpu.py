"""Per-token log-probabilities for the training losses, forward + backward in fp32, in one
process: PyTorch's fused cross-entropy (what `ParallelContext.token_logprobs` runs on one TP
rank), the max/exp/sum form its TP ranks run (here on one rank: the sums over ranks are
identities), and a logsumexp-based form that was tried and not kept. Checks values and
gradients against the fused one first.

    PYTHONPATH=. python3 benchmarks/logprobs_gpu.py
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from plugins.deepseek_v4.parallel import ParallelContext


def tp_form(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The TP ranks' arithmetic on one rank: max, exp and sum each a pass over [S, V]."""
    m = logits.detach().amax(-1)
    lse = m + torch.log(torch.exp(logits - m[..., None]).sum(-1))
    return logits.gather(-1, labels[..., None])[..., 0] - lse


def logsumexp_form(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp per shard, ranks combined on [S]-sized tensors (tried: slower)."""
    return logits.gather(-1, labels[..., None])[..., 0] - torch.logsumexp(logits, -1)


def fused_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(logits, labels, reduction="none")


def timed(fn, logits, labels, g, iters: int) -> float:
    ts = []
    for i in range(iters + 2):
        x = logits.detach().requires_grad_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        (fn(x, labels) * g).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            ts.append(start.elapsed_time(end))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 129280])
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    variants = {"fused cross-entropy (1 rank)": ParallelContext().token_logprobs, "max/exp/sum (TP ranks)": tp_form,
                "logsumexp (not kept)": logsumexp_form}
    print(f"{torch.cuda.get_device_name()}  fp32 logits [{a.tokens}, V], fwd+bwd, median of {a.iters}")
    print(f"{'V':>7}  {'variant':28} {'ms':>7} {'vs fused CE':>11} {'max |dlogp|':>12} {'max |dgrad|':>12}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for v in a.vocab:
        logits = torch.randn(a.tokens, v, device="cuda", generator=gen) * 3
        labels = torch.randint(0, v, (a.tokens,), device="cuda", generator=gen)
        g = torch.randn(a.tokens, device="cuda", generator=gen)
        ref_x = logits.detach().requires_grad_()
        ref = fused_ce(ref_x, labels)
        (ref * g).sum().backward()
        base = timed(fused_ce, logits, labels, g, a.iters)
        for name, fn in variants.items():
            x = logits.detach().requires_grad_()
            out = fn(x, labels)
            (out * g).sum().backward()
            assert torch.isfinite(out).all() and torch.isfinite(x.grad).all(), name
            dv, dg = (out - ref).abs().max().item(), (x.grad - ref_x.grad).abs().max().item()
            ms = timed(fn, logits, labels, g, a.iters)
            print(f"{v:>7}  {name:28} {ms:7.2f} {ms / base:10.2f}x {dv:12.2e} {dg:12.2e}")


if __name__ == "__main__":
    main()
