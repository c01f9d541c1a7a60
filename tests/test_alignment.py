"""Alignment records and `miles check-alignment`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from miles.observe import alignment


def _records(n: int) -> list[dict]:
    """n steps of a two-layer model whose loss has three terms, recorded as one rank."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    recs = []
    for step in range(1, n + 1):
        out = model(torch.full((1, 3), float(step)))
        terms = {"lm_loss": out.sum(), "mtp_loss": 0.5 * out.square().sum(), "indexer_loss": 0.1 * out.abs().sum()}
        loss = sum(terms.values())
        model.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        losses = {k: v.item() for k, v in terms.items()} | {"loss": loss.item()}
        md5s = alignment.grad_checksums([(k, p.grad) for k, p in model.named_parameters()])
        recs.append(alignment.ranks_record(step, losses, float(gn), [md5s]))
    return recs


def test_compare_counts_matches_and_names_first_difference():
    """Guards a checker that cannot fail: identical records match N/N, per loss term too; a
    gradient group that differs at step 3 (loss equal) is reported there, by name; an MTP
    loss that differs at step 2 counts against mtp only; a missing step counts."""
    a = _records(5)
    assert alignment.compare(a, copy.deepcopy(a)).line() == \
        "main_matches=5/5 lm_matches=5/5 mtp_matches=5/5 indexer_matches=5/5 first_diff=none"
    assert len({r["losses"]["mtp_loss"] for r in a}) == 5, "each step's loss bits differ"
    b = copy.deepcopy(a)
    b[2]["grads"]["1"] = "0" * 32
    r = alignment.compare(a, b)
    assert (r.matches, r.total, r.first_diff) == (4, 5, (3, "grads[1]"))
    b[1]["losses"]["mtp_loss"] = "1" * 32
    r = alignment.compare(a, b)
    assert (r.matches, r.first_diff, r.loss_matches) == (3, (2, "losses[mtp_loss]"), {"lm": 5, "mtp": 4, "indexer": 5})
    r = alignment.compare(a, a[:4])
    assert (r.matches, r.first_diff) == (4, (5, "missing step"))


def test_group_checksums_cover_every_rank_in_order():
    """A group's checksum is over all ranks' checksums in rank order: swapping two ranks'
    gradients (each rank still sums right) is a difference, as is a rank with none."""
    losses = {"loss": 1.0}
    r0, r1 = {"layers.0": "a" * 32}, {"layers.0": "b" * 32}
    one = alignment.ranks_record(1, losses, 1.0, [r0, r1])
    assert one["grads"] != alignment.ranks_record(1, losses, 1.0, [r1, r0])["grads"]
    assert one["grads"] != alignment.ranks_record(1, losses, 1.0, [r0, {}])["grads"]
    assert one["losses"] == {}, "terms the run did not report are not recorded"


def test_param_groups():
    """Gradient checksums are grouped per layer so a difference points at the layer."""
    assert alignment.param_group("layers.3.attn.wq_a.weight") == "layers.3"
    assert alignment.param_group("mtp.0.e_proj.weight") == "mtp.0"
    assert alignment.param_group("embed.weight") == "embed"
    assert alignment.param_group("hc_head_fn") == "hc_head_fn"


def test_bad_record_file_names_file_and_line(tmp_path):
    """A corrupt alignment file is a clear error naming the file and line."""
    (tmp_path / alignment.FILE).write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match=r"alignment.jsonl:1: .*missing"):
        alignment.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no alignment record"):
        alignment.load(tmp_path / "nothing")


def test_identical_ep2_runs_align_and_a_seed_change_differs_at_step_1(tmp_path, ray_cluster):
    """Deterministic mode end to end through the controller and Megatron workers (DP=2 in Ray
    actors with the experts split over them, EP=2: each step's tokens cross the all-to-all;
    2 micro-batches each, LR warm-up): two identical 20-step runs give
    check-alignment 20/20 and exit 0; a run with another seed (6 steps: the steps it lacks count
    as differing too) differs at step 1 and exits non-zero."""
    from miles.config import validate_job
    from miles.controller import run

    for name, seed, steps in (("a", 5, 20), ("b", 5, 20), ("c", 6, 6)):
        job = validate_job({
            "name": name, "data": {"seq_len": 32},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "seed": seed,
                      "deterministic": True, "parallel": {"dp": 2, "ep": 2},
                      "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "weight_decay": 0.01}},
            "log": {"run_dir": str(tmp_path / name), "alignment": True, "interval": 10,
                    "wandb": {"mode": "disabled"}}})
        history = run(job).history
        if name != "c":  # its 6 steps' schedule decays right after the warm-up
            assert history[-1]["train/lm_loss"] < history[0]["train/lm_loss"], "training must make progress"
            assert history[0]["train/lr"] < history[5]["train/lr"], "warm-up raises the learning rate"

    def check(x, y):
        return subprocess.run([sys.executable, "-m", "miles.cli", "check-alignment", str(tmp_path / x),
                               str(tmp_path / y)], capture_output=True, text=True, timeout=120)

    same = check("a", "b")
    assert same.returncode == 0 and same.stdout.strip() == \
        "main_matches=20/20 lm_matches=20/20 mtp_matches=20/20 indexer_matches=20/20 first_diff=none", same.stdout
    diff = check("a", "c")
    assert diff.returncode == 1 and diff.stdout.startswith(
        "main_matches=0/20 lm_matches=0/20 mtp_matches=0/20 indexer_matches=0/20 first_diff=step=1:"), diff.stdout
