"""Engines failing under a rollout, through SGLang's real router: a killed engine and a hung
engine are replaced, their in-flight samples re-queued, and every sample finishes exactly once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from miles.rollout.manager import RolloutManager
from plugins.deepseek_v4 import DeepSeekV4Config

CFG = DeepSeekV4Config.tiny()
N = 64


@pytest.fixture(scope="module")
def manager():
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    cfg = {"num_engines": 2, "max_running": 16, "max_len": 256, "request_timeout": 20.0, "health_interval": 0.5,
           "health_timeout": 1.0, "health_failures": 2, "router_policy": "round_robin"}
    mgr = RolloutManager(cfg, {"config": CFG.to_dict(), "seed": 5})
    yield mgr
    mgr.shutdown()
    ray.shutdown()


def _requests(tag: str) -> list[dict]:
    return [{"id": f"{tag}-{i}", "input_ids": [2 + i % 50, 3 + i % 7, 9], "return_logprob": True,
             "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}} for i in range(N)]


def _rollout_with_fault(mgr: RolloutManager, tag: str, fault) -> tuple[list[dict], float, int]:
    """Start a rollout of N samples, apply `fault` to one engine once work is in flight;
    returns the results, seconds from the fault to that engine's replacement, and its pid."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("res", mgr.generate(_requests(tag))))
    t.start()
    time.sleep(1.5)
    victim = mgr.engine_info()[0]
    fault(victim["pid"])
    hit = time.monotonic()
    replaced = None
    while t.is_alive() or replaced is None:
        if replaced is None and victim["pid"] not in [e["pid"] for e in mgr.engine_info()]:
            replaced = time.monotonic() - hit
        assert time.monotonic() - hit < 120, "the rollout or the replacement hangs"
        time.sleep(0.1)
    t.join()
    return out["res"], replaced, victim["pid"]


def _exactly_once(res: list[dict], tag: str) -> None:
    assert [r["id"] for r in res] == [f"{tag}-{i}" for i in range(N)]
    assert all(len(r["output_ids"]) == 48 and r["meta_info"]["finish_reason"]["type"] == "length" for r in res)


def test_killed_engine_loses_no_sample(manager):
    """SIGKILL one of two engines while 64 samples are in flight: all 64 complete exactly
    once (ids compared), with the tokens an undisturbed rollout gives (greedy)."""
    want = {r["id"].split("-")[1]: r["output_ids"] for r in manager.generate(_requests("ref"))}
    restarts = manager.stats["restarts"]
    res, replaced, _ = _rollout_with_fault(manager, "kill", lambda pid: os.kill(pid, signal.SIGKILL))
    _exactly_once(res, "kill")
    assert all(r["output_ids"] == want[r["id"].split("-")[1]] for r in res)
    assert manager.stats["restarts"] == restarts + 1
    print(f"killed engine replaced after {replaced:.1f} s; retries {manager.stats['retries']}")


def test_hung_engine_is_detected_and_replaced(manager):
    """SIGSTOP one engine mid-rollout (it still holds its sockets but never answers): the
    health monitor replaces it within its budget (failures x (interval + timeout) plus an
    engine start), its samples are re-queued after their request timeout, and the rollout
    finishes with every sample exactly once."""
    restarts = manager.stats["restarts"]
    t0 = time.monotonic()
    res, replaced, pid = _rollout_with_fault(manager, "hang", lambda pid: os.kill(pid, signal.SIGSTOP))
    _exactly_once(res, "hang")
    c = manager.cfg
    assert replaced < c.health_failures * (c.health_interval + c.health_timeout) + 15
    assert time.monotonic() - t0 < c.request_timeout + 60
    assert manager.stats["restarts"] == restarts + 1
    with pytest.raises(ProcessLookupError):  # the hung process was killed, not left behind
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)


async def tool_turns(client, sample):
    """A toy two-turn environment: the policy speaks, a tool answers with fixed ids, the
    policy speaks again."""
    from miles.rollout.multiturn import Transcript

    t = Transcript.start(sample["input_ids"])
    params = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "seed": sample["seed"]}
    t.add_generated(await client.generate(t.request(params)))
    t.add_environment([7, 8, 9])
    t.add_generated(await client.generate(t.request(params)))
    return t


def test_multi_turn_transcripts_are_the_generated_tokens(manager):
    """Token in, token out through the router: each transcript is prompt + turn + tool ids +
    turn, the loss mask covers exactly the generated tokens, and the recorded log-probs are
    the model's own on the whole transcript (a full forward of the engines' weights, 1e-5)."""
    import torch
    from conftest import assert_close

    from plugins.deepseek_v4 import DeepSeekV4ForCausalLM

    samples = [{"id": f"mt-{i}", "input_ids": [3 + i, 11, 12 + i], "seed": i} for i in range(6)]
    out = manager.generate_transcripts(samples, f"{__name__}:tool_turns")
    model = DeepSeekV4ForCausalLM(CFG, seed=5).eval()  # the engines' spec: seeded init
    for s, t in zip(samples, out, strict=True):
        assert t.ids[:3] == s["input_ids"] and t.ids[8:11] == [7, 8, 9] and len(t.ids) == 16
        assert t.loss_mask == [0] * 3 + [1] * 5 + [0] * 3 + [1] * 5
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([t.ids])).logits[0, :-1], -1)
        ids = torch.tensor(t.ids)
        want = logp.gather(-1, ids[1:, None])[:, 0]
        on = torch.tensor(t.loss_mask[1:]).bool()
        assert_close(torch.tensor(t.logprobs[1:])[on], want[on], atol=1e-5, what=f"{s['id']} log-probs")
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        manager.generate_transcripts(samples, "no_colon")


def test_a_refused_request_fails_its_rollout_at_once_naming_the_sample(manager):
    """A request the engines refuse (a 4xx: prompt + max_new_tokens past max_len) is the
    request's fault: the rollout fails with the sample's id and the engine's reason, no retry."""
    from miles.rollout.manager import RolloutError

    retries = manager.stats["retries"]
    reqs = _requests("ok")[:4] + [{"id": "too-long", "input_ids": [5] * 200,
                                   "sampling_params": {"max_new_tokens": 100}}]
    with pytest.raises(RolloutError, match=r"sample too-long: the engine refused it: HTTP 400: .*context length 256"):
        manager.generate(reqs)
    assert manager.stats["retries"] == retries


def test_the_engines_and_the_router_answer_only_the_runs_key(manager):
    """Engines listen on their node's address on a cluster: without the run's key (SGLang's
    --api-key convention, Authorization: Bearer) a stranger's pause, abort or weight update is
    refused with 401, and so is a generation through the router; /health stays open (the
    router's and Ray's probes)."""
    import httpx

    url = manager.engine_info()[0]["url"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    for path in ("/abort_request", "/pause_generation", "/release_memory_occupation", "/update_weights_from_disk"):
        assert httpx.post(f"{url}{path}", json={}, timeout=10).status_code == 401, path
        assert httpx.post(f"{url}{path}", json={}, headers={"Authorization": "Bearer wrong"},
                          timeout=10).status_code == 401, path
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{manager.router.url}/generate", json=body, timeout=30).status_code == 401
    r = httpx.post(f"{manager.router.url}/generate", json=body, headers=manager.router.headers, timeout=30)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    # SGLang's servers get the same key (--api-key); the adapter's own call, a weight update from
    # disk, carries it (the embedded engine serves that call as SGLang does)
    from miles.rollout.sglang import SGLangClient

    with pytest.raises(RuntimeError, match="HTTP 401"):
        SGLangClient(url).update_from_disk("/nonexistent")
    with pytest.raises(RuntimeError, match=r"HTTP 4\d\d: .*nonexistent") as refused:
        SGLangClient(url, manager.api_key).update_from_disk("/nonexistent")
    assert "HTTP 401" not in str(refused.value)


def test_aborted_responses_are_generated_again_and_wrong_weights_never_returned(manager):
    """Guards training on what the engines did not finish or did not generate from the
    trainer's weights: responses aborted in flight (an /abort_request, as a weight swap or an
    operator may send) come back complete, generated again (stats "aborted"); answers from
    weights that are no trainer version (an engine's own initial ones, weight_version null)
    are asked again and, all attempts answered so, fail the rollout naming the sample and the
    version (stats "wrong_weights"); an older trainer version is returned as it is, for the
    caller to measure its staleness."""
    import httpx

    from miles.rollout.manager import RolloutError

    aborted = manager.stats["aborted"]
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("res", manager.generate(_requests("ab"), version=0)))
    t.start()
    deadline = time.monotonic() + 60
    while manager.stats["aborted"] == aborted:  # until some response came back aborted
        assert time.monotonic() < deadline and t.is_alive(), "no abort reached a response"
        for e in manager.engine_info():
            httpx.post(f"{e['url']}/abort_request", json={"abort_all": True}, headers=manager.router.headers,
                       timeout=10)
        time.sleep(0.2)
    t.join()
    _exactly_once(out["res"], "ab")  # complete: none came back as the abort
    assert {r["meta_info"]["weight_version"] for r in out["res"]} == {0}

    def set_version(v):
        ray.get([e.__ray_call__.remote(lambda a, v=v: setattr(a.svc.engine, "weight_version", v))
                 for e in manager.engine_actors()])

    wrong = manager.stats["wrong_weights"]
    set_version(None)
    try:
        with pytest.raises(RolloutError, match=r"sample nv-0: .* weight_version None, not the trainer's weights of "
                                               r"version 3"):
            manager.generate(_requests("nv")[:1], version=3)
        assert manager.stats["wrong_weights"] - wrong == manager.cfg.max_attempts
        set_version(2)  # older than asked: returned, its version for the caller to measure
        (res,) = manager.generate(_requests("old")[:1], version=3)
        assert res["meta_info"]["weight_version"] == 2 and res["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        set_version(0)


def test_a_key_that_starts_with_a_dash_reaches_the_router():
    """token_urlsafe keys start with '-' one time in 64: given as `--api-key KEY`, argparse took
    it for an option and the router exited 2 (a whole RL job failed at random)."""
    import httpx

    from miles.rollout.router import Router

    router = Router([], api_key="-starts-with-a-dash", health_interval=1)
    try:
        assert httpx.get(f"{router.url}/workers", timeout=10).status_code == 401
        assert router.client.get("/workers").status_code == 200
    finally:
        router.stop()
