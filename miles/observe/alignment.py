"""Alignment records: per step, the loss and grad-norm bits and an MD5 of every parameter
group's gradients, appended to `<run_dir>/alignment.jsonl`. Two runs that should compute the
same thing are compared with `miles check-alignment RUN_A RUN_B`.
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

FILE = "alignment.jsonl"


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def param_group(name: str) -> str:
    """Checksum group of a parameter: 'layers.3', 'mtp.0', or its top-level module name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") and len(parts) > 1 else parts[0]


def grad_checksums(named_grads: list[tuple[str, torch.Tensor | None]]) -> dict[str, str]:
    """MD5 per parameter group over (name, gradient bytes) of its parameters, by name order."""
    groups: dict[str, hashlib._Hash] = {}
    for name, g in sorted(named_grads, key=lambda kv: kv[0]):
        if g is not None:
            h = groups.setdefault(param_group(name), hashlib.md5())
            h.update(name.encode())
            h.update(g.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {k: h.hexdigest() for k, h in sorted(groups.items())}


def step_record(step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                named_params: list[tuple[str, torch.nn.Parameter]]) -> dict:
    loss = loss.detach()
    return {"step": step, "loss": float(loss), "loss_md5": _md5(loss.float()), "grad_norm": float(grad_norm),
            "grad_norm_md5": _md5(torch.as_tensor(grad_norm).float()),
            "grads": grad_checksums([(n, p.grad) for n, p in named_params])}


def ranks_record(step: int, loss: float, grad_norm: float, rank_grad_md5s: list[dict[str, str]]) -> dict:
    """A step record from distributed workers: each rank reports an MD5 per parameter group
    of its (reduced) gradients; a group's checksum covers all ranks, in rank order."""
    groups: dict[str, hashlib._Hash] = {}
    for rank_md5s in rank_grad_md5s:
        for g, h in sorted(rank_md5s.items()):
            groups.setdefault(g, hashlib.md5()).update(h.encode())
    return {"step": step, "loss": loss, "loss_md5": _md5(torch.tensor(loss, dtype=torch.float64)),
            "grad_norm": grad_norm, "grad_norm_md5": _md5(torch.tensor(grad_norm, dtype=torch.float64)),
            "grads": {g: h.hexdigest() for g, h in sorted(groups.items())}}


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
    matches: int
    total: int
    first_diff: tuple[int, str] | None  # (step, what differs)

    def line(self) -> str:
        diff = "none" if self.first_diff is None else f"step={self.first_diff[0]}:{self.first_diff[1]}"
        return f"main_matches={self.matches}/{self.total} first_diff={diff}"


def compare(a: list[dict], b: list[dict]) -> Comparison:
    """Step by step: loss bits, grad-norm bits and every group's gradient checksum."""
    total = max(len(a), len(b))
    matches, first = 0, None
    for i in range(total):
        if i >= len(a) or i >= len(b):
            what = "missing step"
        else:
            ra, rb = a[i], b[i]
            diffs = [k for k in ("step", "loss_md5", "grad_norm_md5") if ra.get(k) != rb.get(k)]
            diffs += [f"grads[{g}]" for g in sorted(set(ra["grads"]) | set(rb["grads"]))
                      if ra["grads"].get(g) != rb["grads"].get(g)]
            what = ",".join(diffs)
        if what:
            first = first or (a[i]["step"] if i < len(a) else b[i]["step"], what.split(",")[0])
        else:
            matches += 1
    return Comparison(matches, total, first)


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
