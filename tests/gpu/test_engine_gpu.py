"""The embedded engine on a GPU (skipped without CUDA; `make test-gpu`): the decode step
replayed from CUDA graphs, one per batch bucket, gives the tokens and log-probs of the eager
step and of the model's full forward; requests joining and leaving change no one's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, randomize, tiny_model

from miles.rollout.engine import Engine
from miles.rollout.sampling import SamplingParams
from tests.test_rollout_engine import _logprobs, _prompts, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU engine needs CUDA")


def _against_full_forward(model, prompt: list[int], result: dict, what: str, atol: float = 5e-2) -> None:
    """The engine's log-probs of its tokens against `model`'s full forward of prompt + them
    (bf16: the decode step and the packed forward round their sums differently)."""
    ids = torch.tensor(prompt + result["output_ids"], device="cuda")
    with torch.no_grad():
        full = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
    want = full[len(prompt) - 1:-1].gather(-1, ids[len(prompt):, None])[:, 0].float().cpu()
    assert_close(_logprobs(result), want, atol=atol, what=what)


@pytest.mark.parametrize("kv_quant", [None, "fp8"])
def test_graph_replayed_decode_equals_the_eager_step_and_the_full_forward(seed, kv_quant):
    """bf16 (the grouped expert GEMMs that need no host: fp32's loop falls back to eager). With
    kv_quant the cache is FP8 (kv_pool.Fp8KeyPool: its kernel reads the chosen rows' codes and
    scales in place) and the full forward rounds its keys alike; a key within noise of a rounding
    tie may round the other way in one path (one e4m3 step: up to ~4e-2 in a logit on CPU)."""
    model = randomize(tiny_model(seed, dtype=torch.bfloat16, kv_quant=kv_quant), seed).cuda().eval()
    prompts = _prompts(seed, 11)  # 11 requests: buckets 16 and, as they finish, smaller ones
    params = [SamplingParams(temperature=0, max_new_tokens=8 + 3 * (i % 4), ignore_eos=True) for i in range(11)]
    runs = {}
    for graphs in (True, False):
        engine = Engine(model, max_running=16, max_len=160, cuda_graphs=graphs)
        try:
            runs[graphs] = _run(engine, prompts, params, stagger=0.01)
            if graphs:
                assert engine.decoder.graph_error is None, engine.decoder.graph_error
                assert len(engine.decoder.graphs) >= 2, "the decode step was not replayed from graphs"
        finally:
            engine.stop()
    for i, p in enumerate(prompts):
        a, b = runs[True][str(i)], runs[False][str(i)]
        assert a["output_ids"] == b["output_ids"], f"request {i}: graphs and eager decode differ"
        assert_close(_logprobs(a), _logprobs(b), atol=1e-5, what=f"request {i} log-probs")
        _against_full_forward(model, p, a, f"request {i} against the full forward", atol=0.1 if kv_quant else 5e-2)


def test_memory_release_drops_the_graphs_and_decoding_goes_on(seed):
    """Colocated engines free their weights and cache while the trainer trains: the storages
    come back elsewhere, so the graphs captured over them must go, and the next steps capture
    again and decode as before."""
    from miles.rollout.service import EngineService, EngineSpec

    svc = EngineService(EngineSpec(config=tiny_model(seed).config.to_dict(), seed=seed, device="cuda",
                                   dtype="bfloat16", max_running=4, max_len=64))
    try:
        p = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        before = _run(svc.engine, [[5, 6, 7]], p)["0"]
        assert svc.engine.decoder.graphs
        svc.release_memory()
        assert not svc.engine.decoder.graphs
        svc.resume_memory()
        after = _run(svc.engine, [[5, 6, 7]], p)["0"]
        assert after["output_ids"] == before["output_ids"] and svc.engine.decoder.graphs
    finally:
        svc.stop()


def test_graphs_captured_before_a_weight_update_decode_with_the_new_weights(seed):
    """Disaggregated engines keep their graphs across weight syncs (nothing is released): an
    update must reach every tensor a replayed step reads (the copy is in place), so after it
    the engine decodes as an engine that started from the new weights, and as their full
    forward. (A stale-weights engine would show only as slower learning in a GPU RL job.)"""
    from miles.rollout.service import EngineService, EngineSpec
    from miles.rollout.weights import update_targets

    spec = EngineSpec(config=tiny_model(seed).config.to_dict(), seed=seed, device="cuda", dtype="bfloat16",
                      max_running=4, max_len=64)
    new_model = randomize(tiny_model(seed + 1, dtype=torch.bfloat16), seed + 1).cuda().eval()
    new = {k: v.detach().clone() for k, v in update_targets(new_model).items()}
    p = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = _prompts(seed, 3)
    svc, fresh = EngineService(spec), EngineService(spec)
    try:
        before = _run(svc.engine, prompts, p)
        assert svc.engine.decoder.graphs and svc.engine.decoder.graph_error is None
        svc.update_all(new, None, version=1)
        after = _run(svc.engine, prompts, p)
        fresh.update_all(new, None, version=1)
        want = _run(fresh.engine, prompts, p)
    finally:
        svc.stop()
        fresh.stop()
    assert any(before[k]["output_ids"] != after[k]["output_ids"] for k in after), "the update changed nothing"
    for i, prompt in enumerate(prompts):
        a, b = after[str(i)], want[str(i)]
        assert a["output_ids"] == b["output_ids"], f"request {i}: the updated engine decodes with other weights"
        assert_close(_logprobs(a), _logprobs(b), atol=1e-5, what=f"request {i} log-probs")
        _against_full_forward(new_model, prompt, a, f"request {i} against the new weights' full forward")


def test_chunked_prefill_on_the_kernels_matches_the_full_forward(seed):
    """model.extend on the GPU path (the sparse-attention and indexer kernels over [ring ;
    chunk ; entries]), fp32: the full forward's logits after every chunk and at the decode
    steps after them (1e-4: the kernels and the reference sum in different orders)."""
    from tests.test_model import check_chunked_prefill

    check_chunked_prefill(tiny_model(seed).cuda().eval(), seed, atol=1e-4)


@pytest.mark.parametrize("kv_quant", [None, "fp8"])
def test_an_engine_prefilling_in_chunks_decodes_as_the_full_forward(seed, kv_quant):
    """bf16 engine with a prefill budget of 16 tokens an iteration: prompts of up to 120
    tokens go in over many iterations between the decode steps (graphs on) of the others, and
    every request's log-probs are the full forward's (bounds as the decode test's)."""
    model = randomize(tiny_model(seed, dtype=torch.bfloat16, kv_quant=kv_quant), seed).cuda().eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 320, (int(n),), generator=g).tolist() for n in torch.randint(1, 120, (8,), generator=g)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine = Engine(model, max_running=8, max_len=160, prefill_tokens=16)
    try:
        got = _run(engine, prompts, params, stagger=0.01)
        assert engine.decoder.graph_error is None, engine.decoder.graph_error
    finally:
        engine.stop()
    for i, p in enumerate(prompts):
        _against_full_forward(model, p, got[str(i)], f"request {i} ({len(p)} prompt tokens)",
                              atol=0.1 if kv_quant else 5e-2)
