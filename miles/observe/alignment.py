"""Alignment records: per step, the bits of the loss and of each loss term (lm, mtp,
indexer), of the grad norm, and an MD5 of every parameter group's gradients, appended to
`<run_dir>/alignment.jsonl`. Two runs that should compute the same thing are compared with
`miles check-alignment RUN_A RUN_B`, which counts matching steps per loss term as well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from miles.observe import records
from plugins.deepseek_v4.checksum import named_md5, tensor_md5

FILE = "alignment.jsonl"
# The loss terms counted apart, as DeepSeek-V4 alignment reports count them.
LOSSES = {"lm_loss": "lm", "mtp_loss": "mtp", "indexer_loss": "indexer"}


def param_group(name: str) -> str:
    """Checksum group of a parameter: 'layers.3', 'mtp.0', or its top-level module name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") and len(parts) > 1 else parts[0]


def grad_checksums(named_grads: list[tuple[str, torch.Tensor | None]]) -> dict[str, str]:
    """MD5 per parameter group over (name, gradient bytes) of its parameters, by name order."""
    groups: dict[str, list] = {}
    for name, g in sorted(named_grads, key=lambda kv: kv[0]):
        groups.setdefault(param_group(name), []).append((name, g))
    return {k: named_md5(v) for k, v in sorted(groups.items()) if any(g is not None for _, g in v)}


def _value_md5(x: float) -> str:
    return tensor_md5(torch.tensor(x, dtype=torch.float64))


def ranks_record(step: int, losses: dict[str, float], grad_norm: float, rank_grad_md5s: list[dict[str, str]]) -> dict:
    """A step's record: the bits of the total loss, of each loss term (LOSSES present in
    `losses`) and of the grad norm, and a checksum per parameter group of the reduced
    gradients; each rank reports an MD5 per group of its own, and a group's checksum covers
    all ranks, in rank order."""
    groups: dict[str, list] = {}
    for rank_md5s in rank_grad_md5s:
        for g, h in sorted(rank_md5s.items()):
            groups.setdefault(g, []).append(h)
    return {"step": step, "loss": losses["loss"], "loss_md5": _value_md5(losses["loss"]),
            "losses": {k: _value_md5(losses[k]) for k in LOSSES if k in losses},
            "grad_norm": grad_norm, "grad_norm_md5": _value_md5(grad_norm),
            "grads": {g: hashlib.md5("".join(hs).encode()).hexdigest() for g, hs in sorted(groups.items())}}


def append(run_dir: str | Path, record: dict) -> None:
    path = Path(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def load(run: str | Path) -> list[dict]:
    path = Path(run)
    path = path / FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no alignment record (expected {FILE} in the run directory)")
    return records.read(path, {"step", "loss_md5", "grad_norm_md5", "grads"}, "an alignment record")


@dataclass
class Comparison:
    matches: int  # steps whose whole record agrees (every loss, grad norm, every gradient group)
    total: int
    first_diff: tuple[int, str] | None  # (step, what differs)
    loss_matches: dict[str, int]  # per loss term (lm, mtp, indexer): steps whose bits agree

    def line(self) -> str:
        diff = "none" if self.first_diff is None else f"step={self.first_diff[0]}:{self.first_diff[1]}"
        per = "".join(f" {k}_matches={n}/{self.total}" for k, n in self.loss_matches.items())
        return f"main_matches={self.matches}/{self.total}{per} first_diff={diff}"


def compare(a: list[dict], b: list[dict]) -> Comparison:
    """Step by step: loss bits (total and per term), grad-norm bits and every group's gradient
    checksum. A loss term is counted where both runs record it."""
    total = max(len(a), len(b))
    terms = [k for k in LOSSES if any(k in r.get("losses", {}) for r in a + b)]
    matches, first, per = 0, None, {LOSSES[k]: 0 for k in terms}
    for i in range(total):
        if i >= len(a) or i >= len(b):
            what = "missing step"
        else:
            ra, rb = a[i], b[i]
            la, lb = ra.get("losses", {}), rb.get("losses", {})
            for k in terms:
                per[LOSSES[k]] += k in la and la.get(k) == lb.get(k)
            diffs = [k for k in ("step", "loss_md5") if ra.get(k) != rb.get(k)]
            diffs += [f"losses[{k}]" for k in terms if la.get(k) != lb.get(k)]
            diffs += ["grad_norm_md5"] if ra.get("grad_norm_md5") != rb.get("grad_norm_md5") else []
            diffs += [f"grads[{g}]" for g in sorted(set(ra["grads"]) | set(rb["grads"]))
                      if ra["grads"].get(g) != rb["grads"].get(g)]
            what = ",".join(diffs)
        if what:
            first = first or (a[i]["step"] if i < len(a) else b[i]["step"], what.split(",")[0])
        else:
            matches += 1
    return Comparison(matches, total, first, per)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="miles check-alignment",
                                 description="Compare two runs' alignment records (loss and gradient checksums).")
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    args = ap.parse_args(argv)
    try:
        result = compare(load(args.run_a), load(args.run_b))
    except (FileNotFoundError, ValueError) as e:
        print(f"check-alignment: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(result.line())
    if result.first_diff is not None or result.total == 0:
        raise SystemExit(1)
