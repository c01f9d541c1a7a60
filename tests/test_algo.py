"""RL formulas against hand-computed values (docs/algorithms.md)."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.advantages import group_advantages
from miles.algo.losses import response_weights, token_terms
from miles.algo.rewards import dapo_reward, extract_answer, overlong_penalty
from miles.algo.sampling import DynamicSamplingError, dynamic_filter, informative


def test_group_advantages_by_hand():
    """Group (1, 0, 0, 1): mean 0.5, sample std sqrt(1/3), so +-0.866025; a group of equal
    rewards gets 0 (not NaN); Dr. GRPO only centres."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4, "grpo")
    s = 0.5 / math.sqrt(1 / 3)
    assert torch.isfinite(a).all()
    assert torch.allclose(a, torch.tensor([s, -s, -s, s, 0, 0, 0, 0]), atol=1e-5)
    assert torch.equal(group_advantages(r, 4, "dr_grpo"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages(torch.ones(4), 2, "ppo")


def _one(ratio: float, adv: float, **kw):
    """token_terms (the trainer's per-token formula) of one token: (pg, clipped)."""
    lp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    return token_terms(lp, torch.zeros_like(lp), torch.tensor([[adv]], dtype=torch.float64), **kw)


@pytest.mark.parametrize("ratio, adv, want, clipped", [
    (1.5, 1.0, -1.28, 1),  # positive advantage, above 1 + eps_high: clipped at 1.28
    (0.5, 1.0, -0.5, 0),  # positive advantage, below 1 - eps_low: the lower bound does not bind
    (0.5, -1.0, 0.8, 1),  # negative advantage, below 1 - eps_low: clipped at 0.8
    (1.5, -1.0, 1.5, 0),  # negative advantage, above 1 + eps_high: unclipped (pessimistic)
    (1.1, 2.0, -2.2, 0),  # inside the trust region
])
def test_clip_higher_at_both_bounds(ratio, adv, want, clipped):
    pg, c = _one(ratio, adv)
    assert pg.item() == pytest.approx(want, abs=1e-9)
    assert c.item() == clipped


def test_dual_clip_caps_negative_advantages():
    assert _one(5.0, -1.0)[0].item() == pytest.approx(5.0)
    assert _one(5.0, -1.0, dual_clip=3.0)[0].item() == pytest.approx(3.0)
    assert _one(2.0, -1.0, dual_clip=3.0)[0].item() == pytest.approx(2.0)  # below the cap: untouched
    assert _one(5.0, 1.0, dual_clip=3.0)[0].item() == pytest.approx(-1.28)  # positive advantages: no effect
    with pytest.raises(ValueError, match="dual_clip"):
        _one(1.0, 1.0, dual_clip=0.5)


def test_aggregations_differ_where_lengths_differ():
    """Token losses (1, 3) in a 2-token response, (5) in a 1-token one and none in a response
    with no trained token (a multi-turn one whose turns were all the environment's), norm 4:
    token mean (1+3+5)/3 = 3; mean of the two sequence means (2+5)/2 = 3.5 (the empty one is no
    sequence to average: 7/3 if it counted); Dr. GRPO sums / 4 averaged over two: 1.125. The
    weights are the RL loop's (response_weights), summed as the trainer's loss sums them."""
    losses = [[1.0, 3.0], [5.0], []]
    want = {"token_mean": 3.0, "seq_mean_token_mean": 3.5, "seq_mean_token_sum_norm": 1.125}
    for agg, v in want.items():
        w = response_weights([len(x) for x in losses], agg, norm_len=4)
        assert w[2] == 0.0
        assert sum(wi * t for wi, x in zip(w, losses, strict=True) for t in x) == pytest.approx(v), agg
    with pytest.raises(ValueError, match="unknown aggregation"):
        response_weights([1], "mean", 4)


def test_truncated_importance_sampling_and_gradient():
    """w = min(exp(old - rollout), C) scales the token's loss and gradient (not differentiated);
    the gradient of the unclipped term is -A r."""
    lp = torch.tensor([[0.1]], requires_grad=True)
    old = torch.zeros(1, 1)
    roll = torch.tensor([[-math.log(3.0)]])
    loss, _ = token_terms(lp, old, torch.tensor([[1.0]]), rollout_logp=roll, tis_cap=2.0)
    loss.sum().backward()
    r = math.exp(0.1)
    assert torch.isfinite(lp.grad).all()
    assert loss.item() == pytest.approx(-2 * r, rel=1e-6)
    assert lp.grad.item() == pytest.approx(-2 * r, rel=1e-6)


def test_overlong_shaping_in_its_three_regions():
    got = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    assert got.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty(3, max_len=4, cache_len=5)


def test_dapo_answer_verifier():
    assert dapo_reward("so the sum is 12.\nAnswer: 1,234.", "1234") == 1.0
    assert dapo_reward("Answer: 7\nwait, no.\nAnswer: $8$", "8") == 1.0  # the last answer counts
    assert dapo_reward("Answer: 8", "9") == -1.0
    assert dapo_reward("no answer here", "9") == -1.0
    assert extract_answer("x" * 1000 + "Answer: 5") == "5"
    assert extract_answer("Answer: 5" + "x" * 1000) is None  # only the end is read


@pytest.mark.parametrize("spec,expect", [
    ("miles.algo.rewards", "expected 'package.module:function'"),
    ("no_such_module_x:f", "cannot load it: No module named 'no_such_module_x'"),
    ("miles.algo.rewards:no_such_fn", "cannot load it: module 'miles.algo.rewards' has no attribute"),
    ("miles.algo.rewards:BUILTIN", "is not a function"),
])
def test_a_bad_reward_function_is_refused_naming_the_field_and_path(spec, expect):
    from miles.algo.rewards import load_reward

    with pytest.raises(ValueError, match=f"algo.reward '{spec}'") as e:
        load_reward(spec)
    assert expect in str(e.value)
    assert load_reward("miles.algo.rewards:dapo_reward") is dapo_reward and load_reward("dapo") is dapo_reward


def test_dynamic_filter_keeps_informative_groups_and_gives_up_clearly():
    rounds = [[("a", torch.tensor([1.0, 1.0])), ("b", torch.tensor([-1.0, 1.0])), ("c", torch.tensor([-1.0, -1.0]))],
              [("d", torch.tensor([1.0, -1.0])), ("e", torch.tensor([1.0, -1.0]))]]
    kept, counts = dynamic_filter(lambda i: rounds[i], need=2, max_rounds=5)
    assert kept == ["b", "d"]
    assert counts == {"drop_all_correct": 1, "drop_all_wrong": 1, "rounds": 2, "surplus": 1}
    with pytest.raises(DynamicSamplingError, match="3 of 4 groups .* after 2 rounds"):
        dynamic_filter(lambda i: rounds[i], need=4, max_rounds=2)


def test_dynamic_sampling_drops_an_all_correct_group_that_shaping_made_differ():
    """Guards DAPO's filter reading the shaped reward: all four answers correct, two of them
    long enough for the overlong penalty, so their shaped rewards differ; the group's accuracy
    is 1 and dynamic sampling drops it (filter_scores: the raw rewards), while a group with
    one wrong answer is kept; the shaped rewards still carry the penalty for the advantages."""
    from miles.algo.rewards import Rewards
    from miles.config import load_job
    from miles.data.prompts import Prompt
    from miles.rl.rollout import Response, filter_scores, reward_groups

    job = load_job("jobs/dapo_tiny.yaml")  # overlong shaping on: max 12 tokens, buffer 4
    a = job.algo
    assert a.overlong_max_len == 12 and a.overlong_cache == 4 and a.reward == "dapo"
    p = Prompt("p:0", [1, 2], "7", [{"role": "user", "content": "3 + 4?"}])

    def group(texts_and_lengths):
        return [Response(p, list(range(n)), [0.0] * n, t, False) for t, n in texts_and_lengths]

    all_right = group([("Answer: 7", 4), ("Answer: 7", 6), ("Answer: 7", 11), ("Answer: 7", 12)])
    one_wrong = group([("Answer: 7", 4), ("Answer: 8", 6), ("Answer: 7", 5), ("Answer: 7", 3)])
    reward_groups(job, [all_right, one_wrong], Rewards.of(job.algo))
    shaped = [x.reward for x in all_right]
    assert len(set(shaped)) > 1 and shaped[0] == 1.0 and shaped[3] < 1.0, "precondition: shaping differs"
    keep, drops = informative(torch.stack([r for _, r in filter_scores([all_right, one_wrong])]))
    assert keep.tolist() == [False, True]
    assert drops == {"drop_all_correct": 1, "drop_all_wrong": 0}
    assert [x.raw for x in one_wrong] == [1.0, -1.0, 1.0, 1.0] and not one_wrong[1].correct


def test_kl_estimators_by_hand():
    from miles.algo.losses import kl_estimate

    lp, ref = torch.tensor([math.log(0.5)], dtype=torch.float64), torch.tensor([math.log(0.25)], dtype=torch.float64)
    d = math.log(2.0)  # log(pi / ref)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)  # ref/pi - 1 - log(ref/pi)
    assert kl_estimate(lp, lp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_sequence_weights_sum_to_the_aggregations():
    """Responses of 3, 1 and 0 trained tokens: token_mean weighs each token 1/4 (sum 1);
    seq_mean_token_mean each response 1/2 (two responses with tokens); Dr. GRPO 1/(8 x 2)."""
    tok = response_weights([3, 1, 0], "token_mean", 8)
    assert tok == pytest.approx([1 / 4, 1 / 4, 0.0]) and 3 * tok[0] + tok[1] == pytest.approx(1.0)
    assert response_weights([3, 1, 0], "seq_mean_token_mean", 8) == pytest.approx([1 / 6, 1 / 2, 0.0])
    assert response_weights([3, 1, 0], "seq_mean_token_sum_norm", 8) == pytest.approx([1 / 16, 1 / 16, 0.0])


def test_remote_reward_server_is_asked_each_item_retried_and_refusals_named():
    """algo.reward_url: every item POSTed to a real HTTP server ({"reward": r} back, in the
    items' order); a 503 is retried; a 400 and a server that never answers 200 fail with the
    URL and the status named."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from miles.algo.rewards import score

    seen: list[str] = []
    flaky = {"left": 2}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            item = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append(item["response"])
            if item["response"] == "bad":
                code, body = 400, b"no"
            elif item["response"] == "down" or (item["response"] == "flaky" and flaky["left"] > 0):
                flaky["left"] -= item["response"] == "flaky"
                code, body = 503, b"later"
            else:
                code, body = 200, json.dumps({"reward": len(item["response"]) + float(item["label"])}).encode()
            self.send_response(code)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/reward"
    try:
        items = [{"response": "x" * i, "label": str(i), "prompt": []} for i in range(1, 40)]
        items.append({"response": "flaky", "label": "0.5", "prompt": []})
        assert score(items, url=url, concurrency=8) == [2.0 * i for i in range(1, 40)] + [5.5]
        assert seen.count("flaky") == 3  # two 503s, then the answer
        with pytest.raises(RuntimeError, match=rf"reward server {url}: HTTP 400: no"):
            score([{"response": "bad", "label": "1", "prompt": []}], url=url)
        with pytest.raises(RuntimeError, match="HTTP 503: later"):
            score([{"response": "down", "label": "1", "prompt": []}], url=url)
        assert seen.count("bad") == 1 and seen.count("down") == 3
    finally:
        server.shutdown()


def test_math_rewards_run_off_the_main_thread():
    """Guards algo.reward: math dying on the first rollout: math-verify bounds its work with
    signal.alarm, which only a main thread may set, and rewards are scored in the rollout
    thread. Off the main thread (as the RL loop calls it) equal answers in other forms score
    +1, a wrong one -1."""
    import threading

    from miles.algo.rewards import Rewards

    items = [{"response": "so\nAnswer: 1/2", "label": "0.5", "prompt": []},
             {"response": "Answer: \\frac{3}{4}", "label": "0.75", "prompt": []},
             {"response": "Answer: 7", "label": "8", "prompt": []}]
    rewards, out = Rewards("math", timeout=60, concurrency=2), {}
    t = threading.Thread(target=lambda: out.setdefault("r", rewards(items)))
    try:
        t.start()
        t.join(timeout=120)
    finally:
        rewards.close()
    assert out.get("r") == [1.0, 1.0, -1.0], out


@pytest.mark.parametrize("fn", ["slow", "slow_async"])
def test_a_reward_call_past_its_timeout_scores_the_timeout_score_and_is_counted(fn):
    """A local reward function (sync: run in a worker process, killed at the timeout; async:
    awaited with the timeout) that runs past algo.reward_timeout does not hold up the rollout:
    it scores algo.reward_timeout_score and is counted; the others score what they return,
    several at a time (4 items of 1.5 s at concurrency 4 in well under 4 x 1.5 s)."""
    import time

    from miles.algo.rewards import Rewards

    rewards = Rewards(f"tests.helpers.rewards:{fn}", timeout=1.5, concurrency=4, timeout_score=-7.0)
    try:
        rewards([{"response": "warm", "label": "", "prompt": []}])  # the worker processes start
        t0 = time.monotonic()
        got = rewards([{"response": r, "label": "", "prompt": []} for r in ("ab", "slow", "slow", "abcd")])
        took = time.monotonic() - t0
    finally:
        rewards.close()
    assert got == [2.0, -7.0, -7.0, 4.0] and rewards.timeouts == 2
    assert took < 4.5, f"the calls did not run concurrently: {took:.1f} s"


def test_a_failing_reward_function_names_itself_and_the_response():
    """One line: the function, the response, the label, the error and where the user's code
    raised it (in the worker process); no chained traceback behind it (the job printed 80
    lines, the user's error twice)."""
    from miles.algo.rewards import RewardError, Rewards

    rewards = Rewards("tests.helpers.rewards:broken", timeout=30, concurrency=1)
    try:
        with pytest.raises(RewardError, match=r"algo.reward 'tests.helpers.rewards:broken' failed on the response "
                                              r"'x \+ y' \(label '3'\): KeyError: 'no such key' at "
                                              r".*tests/helpers/rewards.py:\d+ in broken$") as e:
            rewards([{"response": "x + y", "label": "3", "prompt": []}])
        assert e.value.__cause__ is None and e.value.__suppress_context__
    finally:
        rewards.close()


def test_a_response_cut_inside_a_character_reaches_user_code_without_a_replacement_character():
    """A response stopped at max_new_tokens can end on the first bytes of a multi-byte
    character: byte-level tokenizers decode those to U+FFFD, which reward functions then see
    (and `Answer: 4` + U+FFFD fails an exact match). The fragment is left out; invalid bytes
    inside a response stay what they are."""
    from miles.rl.rollout import response_text, response_tokenizer

    tok = response_tokenizer("tiny")
    text = "Answer: 4 é 😀 done"
    ids = tok.encode(text, add_special_tokens=False).ids
    seen_partial = False
    for k in range(1, len(ids) + 1):
        raw = tok.decode(ids[:k], skip_special_tokens=True)
        got = response_text(tok, ids[:k])
        seen_partial |= raw.endswith("\ufffd")
        assert "\ufffd" not in got and text.startswith(got), (k, raw, got)
        assert raw.startswith(got) and len(raw) - len(got) <= 1, (k, raw, got)
    assert seen_partial, "no prefix ended inside a character: the test shows nothing"
    assert response_text(tok, ids) == text
    lone = tok.encode("é", add_special_tokens=False).ids[-1:]  # a continuation byte alone: invalid, not cut off
    inside = ids[:3] + lone + ids[3:5]
    assert "\ufffd" in tok.decode(inside) and not tok.decode(inside).endswith("\ufffd")
    assert response_text(tok, inside) == tok.decode(inside)
