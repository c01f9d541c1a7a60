"""The SGLang launcher's command line (SGLang cannot run on these machines)."""

from __future__ import annotations

import sys

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


@pytest.mark.parametrize("key", ["model_path", "port", "host", "model-path"])
def test_options_miles_sets_are_refused(key):
    with pytest.raises(ValueError, match="set by miles"):
        launch_command("/m", "127.0.0.1", 1, {key: "x"})
