"""The demo job end to end (short): loss falls, checkpoint saved, reload + decoding runs."""

from __future__ import annotations

from miles.demo import lr_at, run


def test_demo_trains_saves_reloads_and_generates(tmp_path):
    """Guards a broken `make demo`: 30 steps must cut the LM loss clearly, write DeepSeek's
    HF layout and decode from the reloaded checkpoint."""
    result = run(steps=25, out=tmp_path / "demo", seed=3)
    assert result["last"]["lm"] < 0.85 * result["first"]["lm"]
    assert (tmp_path / "demo" / "config.json").is_file()
    assert (tmp_path / "demo" / "model.safetensors.index.json").is_file()
    assert 0.0 <= result["accuracy"] <= 1.0


def test_lr_schedule_warms_up_then_decays():
    """Warm-up reaches the peak at the end of warm-up, then decays to 10% of peak."""
    assert lr_at(0, 100, 1.0, 10) == 0.1 and lr_at(9, 100, 1.0, 10) == 1.0
    assert abs(lr_at(100, 100, 1.0, 10) - 0.1) < 1e-9
    assert lr_at(50, 100, 1.0, 10) < lr_at(20, 100, 1.0, 10)
