"""Shared test helpers: fresh seeds, finiteness-first comparisons, randomised models."""

from __future__ import annotations

import os
import secrets

# The CPU suite is the CPU suite on any machine: on a GPU host its GPUs are hidden from the
# tests and every process they start (Ray, jobs, engines), as on CI. MILES_TEST_GPU=1 (make
# test-gpu) keeps them: the kernels then run on CUDA. Set before torch first looks for CUDA.
if os.environ.get("MILES_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when
    # triton is first imported, and megatron-core imports triton: set it before any test.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM


def pytest_addoption(parser):
    parser.addoption("--bf16", action="store_true",
                     help="test_parallel_layouts in bf16 against one process's bf16 errors, as on GPUs")


# `make test` runs the files on 2 workers (pytest -n 2 --dist loadfile --no-loadscope-reorder):
# a file's tests stay on one worker (its module's Ray cluster with them) and the files go out in
# this order, longest first (measured on the 2-core machine: the demo ~260 s, the cluster ~140 s,
# ...), so neither worker ends the run alone on a long file. The rest follow in their own order.
LONGEST_FIRST = ["test_demo.py", "test_cluster.py", "test_ckpt_resume.py", "test_parallel_layouts.py",
                 "test_ckpt_reshard.py", "test_kernels.py", "test_rl.py", "test_megatron_cpu.py", "test_jobs.py",
                 "test_alignment.py", "test_determinism.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test, printed so a failure can be replayed (MILES_TEST_SEED=<it>)."""
    s = int(os.environ.get("MILES_TEST_SEED") or secrets.randbits(31))
    print(f"[{request.node.name}] seed={s}")
    return s


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster, started and stopped by the test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


def assert_finite(*tensors: torch.Tensor, what: str = "") -> None:
    for t in tensors:
        assert torch.isfinite(t).all(), f"non-finite values {what}"


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Finiteness first: a NaN must never pass as 'close'."""
    assert_finite(a, b, what=what)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape} {what}"
    err = (a.double() - b.double()).abs()
    bound = atol + rtol * b.double().abs()
    assert (err <= bound).all(), f"max abs err {err.max().item():.3e} {what}"


@torch.no_grad()
def randomize(model: DeepSeekV4ForCausalLM, seed: int, scale: float = 0.3) -> DeepSeekV4ForCausalLM:
    """Move every parameter (and router bias) off its init so zero/one inits (sink, ape,
    mHC base/scale, norms) cannot hide a bug."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith(("attn_sink", "ape", "_base", "_scale", "norm.weight")):
            p.add_((noise * scale).to(p.dtype))
        else:
            p.add_((noise * 0.5 * p.float().std().clamp_min(0.02)).to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("gate.bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


# The tiny preset with one main block of each attention kind (CSA, HCA, SWA; hash routing in the
# first two, learned in the third) and its MTP block: tests that run the Triton interpreter on
# CPU pay for every block's kernels.
TINY_EACH_ONCE = dict(num_hidden_layers=3, compress_ratios=[4, 16, 0, 0])


def tiny_model(seed: int, dtype: torch.dtype = torch.float32, **overrides) -> DeepSeekV4ForCausalLM:
    cfg = DeepSeekV4Config.tiny(**overrides)
    return randomize(DeepSeekV4ForCausalLM(cfg, dtype=dtype, seed=seed), seed + 1)


def random_ids(seed: int, batch: int, seq: int, vocab: int = 320) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randint(0, vocab, (batch, seq), generator=g)


NEAR_TIE = 1e-6  # a choice_margin under this is a near tie: a few ulps of fp32


def choice_margin(model: DeepSeekV4ForCausalLM, ids: torch.Tensor, greedy_at: torch.Tensor | None = None,
                  **forward) -> float:
    """The smallest relative gap, over a forward of `ids`, between the k-th and (k+1)-th
    candidates of the model's learned choices (`forward`: the forward's other arguments):
    each learned router's experts (score + bias) and each indexer's picks (visible scores);
    with `greedy_at` ([B, S] bool), also the top two logits at those positions (where the next
    token was chosen greedily). Two forwards that round differently (whole vs token by token,
    batched vs alone) can choose differently where a gap is within a few ulps; tests that
    compare such forwards draw inputs whose gaps are wider. Zeros (the indexer's relus) tie in
    every forward and do not count."""
    from plugins.deepseek_v4 import ops
    from plugins.deepseek_v4.model import Gate

    gaps = [float("inf")]

    def gap(s: torch.Tensor, k: int) -> None:  # s [..., candidates], -inf where not a candidate
        if k < 1 or s.shape[-1] <= k:
            return
        top = s.sort(-1, descending=True).values[..., k - 1:k + 1]
        ok = torch.isfinite(top).all(-1)
        if ok.any():
            a, b = top[ok].double().unbind(-1)
            rel = (a - b) / a.abs().clamp_min(1e-3)
            rel = rel[(a != b) | (a != 0)]  # zeros (the indexer's relus) tie in every forward
            if rel.numel():
                gaps.append(float(rel.min()))

    def router(m, _, out):
        if not m.is_hash:
            gap(out[2].float() + m.bias, m.topk)

    def picks(scores, visible, k):
        gap(scores.float().masked_fill(~visible, float("-inf")), min(k, scores.shape[-1]))
        return select(scores, visible, k)

    select = ops.topk_select
    hooks = [m.register_forward_hook(router) for m in model.modules() if isinstance(m, Gate)]
    ops.topk_select = picks  # model.py calls it through the module
    try:
        with torch.no_grad():
            out = model(ids, **forward)
            if greedy_at is not None:
                gap(out.head.logits()[greedy_at].float(), 1)  # [positions, V]
    finally:
        ops.topk_select = select
        for h in hooks:
            h.remove()
    return min(gaps)


def without_near_ties(model: DeepSeekV4ForCausalLM, draw, tries: int = 20, **forward):
    """draw() again until the model meets no near tie (choice_margin above NEAR_TIE) on what it drew:
    a [B, S] tensor of ids, or a list of [S] / [B, S] ones (each its own forward; `forward`: the
    forwards' other arguments)."""
    for _ in range(tries):
        got = draw()
        rows = got if isinstance(got, list) else [got]
        if min(choice_margin(model, t if t.dim() == 2 else t[None], **forward) for t in rows) > NEAR_TIE:
            return got
    return got


def answers_margin(model: DeepSeekV4ForCausalLM, prompts: list[list[int]], answers: list[dict],
                   greedy: bool = True) -> float:
    """choice_margin over each prompt + the output_ids an engine answered it with, packed as
    documents of one forward (greedy: its tokens were argmaxes, whose top two logits count too).
    Engine tests that compare two runs (batched vs alone, chunked vs whole prefill) check it on
    the reference run's answers and draw again under NEAR_TIE: a near tie there can choose
    otherwise in the other run."""
    seqs = [p + a["output_ids"] for p, a in zip(prompts, answers, strict=True)]
    doc = torch.cat([torch.full((len(t),), i) for i, t in enumerate(seqs)])
    pos = torch.cat([torch.arange(len(t)) for t in seqs])
    first = torch.tensor([len(p) for p in prompts])[doc] - 1  # each document's position that chose its first output
    last = torch.tensor([len(t) for t in seqs])[doc] - 1  # its last token chose nothing
    dev = next(model.parameters()).device
    return choice_margin(model, torch.tensor([t for s in seqs for t in s], device=dev)[None], doc_ids=doc.to(dev)[None],
                         greedy_at=((pos >= first) & (pos < last)).to(dev)[None] if greedy else None)


def engine_answers(model: DeepSeekV4ForCausalLM, prompts: list[list[int]], max_running: int, submit,
                   max_len: int = 96) -> dict[str, dict]:
    """Every prompt through one embedded Engine, submitted together (requests join a running
    batch); `submit(i)` -> (SamplingParams, Engine.submit keywords) of prompt i. Returns the
    answers by request id str(i)."""
    import threading

    from miles.rollout.engine import Engine

    engine = Engine(model, max_len=max_len, max_running=max_running)
    results: dict[str, dict] = {}
    done = threading.Event()

    def collect(r: dict) -> None:
        results[r["meta_info"]["id"]] = r
        if len(results) == len(prompts):
            done.set()

    try:
        for i, p in enumerate(prompts):
            params, kw = submit(i)
            engine.submit(p, params, collect, True, rid=str(i), **kw)
        assert done.wait(120), f"{len(results)}/{len(prompts)} finished"
    finally:
        engine.stop()
    return results
