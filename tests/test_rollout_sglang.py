"""The SGLang launcher's command line (SGLang cannot run on these machines) and `miles serve`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.rollout.sglang import launch_command


def test_every_option_is_passed_through_unchanged():
    opts = {"tp_size": 8, "mem_fraction_static": 0.7, "enable_dp_attention": True, "disable_radix_cache": False,
            "kv_cache_dtype": "fp8_e4m3", "cuda_graph_bs": [1, 2, 4], "chunked-prefill-size": 4096,
            "log_level": None}
    assert launch_command("/models/v4", "127.0.0.1", 30000, opts) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/v4", "--host", "127.0.0.1",
        "--port", "30000", "--tp-size", "8", "--mem-fraction-static", "0.7", "--enable-dp-attention",
        "--kv-cache-dtype", "fp8_e4m3", "--cuda-graph-bs", "1", "2", "4", "--chunked-prefill-size", "4096"]


def test_the_runs_key_is_given_as_one_argument():
    """SGLang's --api-key guards every endpoint but /health*; a key may start with '-' (one in
    64 of token_urlsafe's), so it goes as --api-key=KEY."""
    cmd = launch_command("/m", "127.0.0.1", 1, {"tp_size": 2}, api_key="-k3y")
    assert cmd[-3:] == ["--api-key=-k3y", "--tp-size", "2"]
    assert not any(x.startswith("--api-key") for x in launch_command("/m", "127.0.0.1", 1, {}))


@pytest.mark.parametrize("key", ["model_path", "port", "host", "model-path", "api_key", "api-key"])
def test_options_miles_sets_are_refused(key):
    with pytest.raises(ValueError, match="set by miles"):
        launch_command("/m", "127.0.0.1", 1, {key: "x"})


def test_miles_serve_answers_curl(tmp_path):
    """`miles serve HF_DIR` starts an engine behind the router; a plain HTTP client gets
    tokens from the router's port; SIGTERM stops everything. With nothing but the directory it
    serves in the dtype of the weights (fp32 here: it served a float32-trained model in bf16)
    and with the tokenizer saved beside them (text was refused for want of one), and the
    printed curl example asks with text and gets text back."""
    import os
    import signal
    import subprocess
    import time

    import httpx

    from miles.cluster.node import free_port
    from miles.data.sft import copy_tokenizer
    from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

    DeepSeekV4ForCausalLM(DeepSeekV4Config.tiny(vocab_size=512), seed=2).save_pretrained(tmp_path / "hf")
    copy_tokenizer("tiny", "deepseek_v4", tmp_path / "hf")  # as ckpt.save_hf and miles convert write it
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "serve", str(tmp_path / "hf"), "--port", str(port),
                             "--max-len", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in line and "float32, tokenizer " in line, line
        example = proc.stdout.readline()
        assert example.strip().startswith("curl") and '"text"' in example, example
        deadline = time.monotonic() + 30
        while True:
            try:
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
                r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=30, json=body)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
        import json

        asked = json.loads(example.split("-d '", 1)[1].rsplit("'", 1)[0])  # the printed example, as it is
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=30, json=asked)
        assert r.status_code == 200 and isinstance(r.json()["text"], str) and r.json()["output_ids"], r.text
        # a chat, as OpenAI clients send it, through the router: rendered with V4's chat encoding
        chat = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 6,
                "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json=chat)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length") and r.json()["usage"]["completion_tokens"] >= 1
        # the same chat streamed through the router: its deltas join to the same answer
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                          json={**chat, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["delta"].get("content", "") for c in chunks).strip() == choice["message"]["content"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "wizard", "content": "x"}]})
        assert bad.status_code == 400 and "messages" in bad.text, bad.text
        assert httpx.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [999]}).status_code == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped" in out, out


def test_engines_get_the_jobs_startup_timeout(tmp_path, monkeypatch):
    """Guards two start-up limits that disagreed (the manager gave engines 300 s, SGLang's
    launcher 1,800; a V4-Flash engine loading its weights takes longer than 300): both take
    rollout.startup_timeout. An SGLang that never answers (a stand-in package that only
    sleeps) fails the launcher after its timeout, and the rollout manager's start after the
    job's, naming the key, its engines stopped."""
    import os
    import threading

    import ray

    from miles.rollout.manager import RolloutError, RolloutManager
    from miles.rollout.sglang import SGLangEngine

    def error_within(seconds: float, fn) -> Exception:
        """What fn() raised, failing the test if it is still waiting after `seconds`."""
        out: dict = {}

        def call():
            try:
                fn()
            except Exception as e:
                out["error"] = e

        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(timeout=seconds)
        assert not t.is_alive(), f"still waiting after {seconds} s: the start-up timeout was not applied"
        return out.get("error")

    fake = str(Path(__file__).parent / "helpers" / "fake_sglang")
    path = os.pathsep.join([fake, *filter(None, [os.environ.get("PYTHONPATH")])])
    monkeypatch.setenv("PYTHONPATH", path)
    err = error_within(30, lambda: SGLangEngine(str(tmp_path), {}, host="127.0.0.1", startup_timeout=2))
    assert isinstance(err, RuntimeError) and "sglang.launch_server did not answer" in str(err), err
    assert "within 2 s" in str(err)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        err = error_within(60, lambda: RolloutManager({"engine": "sglang", "sync": "disk", "startup_timeout": 3.0},
                                                      {"hf": str(tmp_path)}))
        assert isinstance(err, RolloutError) and "rollout.startup_timeout=3" in str(err), err
    finally:
        ray.shutdown()
