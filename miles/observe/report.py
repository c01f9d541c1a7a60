"""`miles report RUN_DIR`: a PNG plot of every curve in a run's metrics.jsonl.

One file per metric (`<run_dir>/report/train_loss.png`, ...) and an overview page with all
of them (`overview.png`), so a run can be looked at without wandb.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from miles.observe import metrics as metrics_log


def curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """metric name -> (steps, values), skipping steps where it is absent or not finite."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for rec in records:
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs, ys = out.setdefault(k, ([], []))
                xs.append(rec["step"])
                ys.append(float(v))
    return {k: out[k] for k in panel_order(list(out))}


LEAD = ("rollout/raw_reward", "rollout/reward", "rollout/accuracy", "eval/*/accuracy", "train/loss", "eval/loss",
        "train/pg_loss", "train/lm_loss", "train/grad_norm", "train/lr")  # what a run is judged by, first
GROUPS = ("rollout/", "eval/", "train/", "data/", "perf/")


def panel_order(names: list[str]) -> list[str]:
    """The overview's order: the curves a run is judged by (reward, accuracy, loss) first, then
    each group (rollout, eval, train, data, perf, the rest) alphabetically."""
    def key(name: str) -> tuple:
        for i, lead in enumerate(LEAD):
            if re.fullmatch(re.escape(lead).replace(r"\*", "[^/]+"), name):
                return (0, i, name)
        group = next((i for i, g in enumerate(GROUPS) if name.startswith(g)), len(GROUPS))
        return (1, group, name)

    return sorted(names, key=key)


def _draw(ax, name: str, xs: list[int], ys: list[float]) -> None:
    ax.plot(xs, ys, marker="." if len(xs) < 50 else None, linewidth=1.2)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if name.endswith("loss") and min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")


def render(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs; returns their paths (overview first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    data = curves(metrics_log.read(run_dir))
    if not data:
        raise ValueError(f"{run_dir / metrics_log.FILE}: no numeric metrics to plot")
    paths = []
    cols = min(3, len(data))
    rows = math.ceil(len(data) / cols)
    # constrained layout keeps the run's title above the panels (tight_layout let them overlap)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False, layout="constrained")
    for ax, (name, (xs, ys)) in zip(axes.flat, data.items(), strict=False):
        _draw(ax, name, xs, ys)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.suptitle(run_dir.name, fontsize=11)
    paths.append(out / "overview.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    for name, (xs, ys) in data.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _draw(ax, name, xs, ys)
        fig.tight_layout()
        paths.append(out / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="miles report", description="Plot every logged curve of a run as PNG files.")
    ap.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--out", help="where the PNGs go (default: RUN_DIR/report)")
    args = ap.parse_args(argv)
    try:
        paths = render(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"miles report: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {len(paths)} plots to {paths[0].parent} (overview: {paths[0]})")
