"""Where a run's numbers go: `<run_dir>/metrics.jsonl` (one JSON object per step), a wandb run
(offline by default) with the same names and steps, and the terminal (a progress bar on a
terminal, one line per `log.interval` steps otherwise).

Metric names follow docs/algorithms.md: train/loss, train/grad_norm, train/lr,
train/mtp_loss, train/indexer_loss, perf/step_time, perf/train_tok_per_s, eval/<source>/...
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import TextIO

from miles.config import LogConfig
from miles.observe import records

FILE = "metrics.jsonl"
WANDB_ID = "wandb_run_id"  # in the run directory: a resumed run continues the same wandb run
# What a log line shows, in order, when the step has it.
LINE = (("train/loss", "loss {:.4f}"), ("train/lm_loss", "lm {:.4f}"), ("train/mtp_loss", "mtp {:.4f}"),
        ("train/indexer_loss", "indexer {:.4f}"), ("train/grad_norm", "grad_norm {:.3f}"), ("train/lr", "lr {:.2e}"),
        ("rollout/raw_reward", "reward {:+.3f}"), ("rollout/accuracy", "acc {:.1%}"),
        ("eval/loss", "eval {:.4f}"), ("perf/train_tok_per_s", "{:,.0f} tok/s"),
        ("perf/trainer_idle_time", "idle: trainer {:.1f}s"), ("perf/engine_idle_time", "engines {:.1f}s"))


def line(metrics: dict[str, float]) -> str:
    """A step's log line: LINE's fields it has, then each held-out accuracy (RL's evaluations)."""
    parts = [fmt.format(metrics[k]) for k, fmt in LINE if k in metrics and math.isfinite(metrics[k])]
    parts += [f"{k.split('/')[1]} acc {v:.1%}" for k, v in metrics.items()
              if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2 and math.isfinite(v)]
    return "  ".join(parts)


def read(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order (a bad line names the file and line)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics log (is {run_dir} a run directory?)")
    return records.read(path, {"step"}, "a metrics record")


class Monitor:
    def __init__(self, cfg: LogConfig, run_dir: Path, total_steps: int, config: dict,
                 stream: TextIO | None = None):
        self.cfg, self.run_dir, self.total = cfg, Path(run_dir), total_steps
        self.stream = stream or sys.stdout
        self.bar = None
        self.wandb = self._start_wandb(config)
        self.file = (self.run_dir / FILE).open("a")
        bar = cfg.progress == "bar" or (cfg.progress == "auto" and self.stream.isatty())
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, file=self.stream, unit="step", dynamic_ncols=True)

    def _start_wandb(self, config: dict):
        w = self.cfg.wandb
        if w.mode == "disabled":
            return None
        mode = w.mode
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            self.print("wandb: log.wandb.mode is online but WANDB_API_KEY is not set; logging offline "
                       f"(upload later with `wandb sync {self.run_dir / 'wandb'}/offline-run-*`)")
            mode = "offline"
        import wandb

        # One wandb run id per run directory: online, a resume (ckpt.load: auto) continues the run
        # (steps it redoes after its checkpoint are ones wandb has: it keeps a step's first values,
        # which a bitwise resume computes again); offline, each attempt is an offline run of that id.
        id_file = self.run_dir / WANDB_ID
        run_id = (id_file.read_text().strip() if id_file.is_file() else "") or secrets.token_hex(6)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        return wandb.init(mode=mode, project=w.project, entity=w.entity, group=w.group, tags=w.tags,
                          name=w.name or self.run_dir.name, dir=str(self.run_dir), config=config,
                          id=run_id, resume="allow", settings=wandb.Settings(console="off", quiet=True, silent=True))

    def print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=self.stream, flush=True)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Record metrics in metrics.jsonl and wandb (e.g. the evaluation before step 1).
        Non-finite values are recorded as they are (JSON null) and reported: a NaN never
        passes silently."""
        bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        self.file.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else None)
                                                    for k, v in metrics.items()}}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if bad:
            self.print(f"step {step}: non-finite {', '.join(bad)}")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics everywhere and show its progress."""
        self.record(step, metrics)
        text = line(metrics)
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step == 1 or step % self.cfg.interval == 0 or step == self.total:
            self.print(f"step {step:5d}/{self.total}  {text}")

    def summary(self, metrics: dict[str, float]) -> None:
        """Values of the finished run (evaluations) under their own names, not a step."""
        self.print("  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        if self.wandb is not None:
            self.wandb.summary.update(metrics)
        (self.run_dir / "summary.json").write_text(json.dumps(metrics, indent=2) + "\n")

    def close(self, failed: bool = False) -> None:
        """Flush and close everything; a failed run is marked failed in wandb."""
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            try:
                self.wandb.finish(exit_code=1 if failed else 0)
            except Exception as e:  # a stopped job's wandb service may be gone (Ray signals every child)
                self.print(f"wandb: the run could not be closed ({type(e).__name__}: {e}); what it logged is in "
                           f"{self.run_dir / 'wandb'} and metrics.jsonl")
                import wandb

                with contextlib.suppress(Exception):  # or wandb's exit hook tries the dead service again
                    wandb.teardown()
