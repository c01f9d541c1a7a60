"""The controller's side of checkpoints: resume at the start, save on the policy's steps.

    ckpt = Checkpoints(job, report)      # recovers the save_dir, finds what ckpt.load names
    start = ckpt.restore(trainer, data)  # workers load their slices; the data source its position
    for step in start+1 ..:
        ...train...
        ckpt.maybe_save(step, trainer, data)
    ckpt.close()                         # waits for a save still being written

The workers write their shards (miles.ckpt.sharded) into `.tmp-iter_N`; this process then
adds miles.json (iteration, data position, layout, model config, the resolved job) and
commits the directory (miles.ckpt.store). With ckpt.async_save the workers write in the
background and the commit happens at a later step, when every rank has finished; a failed
background write raises here, at that step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from miles.ckpt import policy, store
from miles.ckpt.store import CheckpointError


class Checkpoints:
    def __init__(self, job, report: Callable[[str], None] = print):
        self.job, self.cfg, self.report = job, job.ckpt, report
        self.save_dir = Path(self.cfg.save_dir)
        store.recover(self.save_dir, report)
        self.load_dir = store.resolve(self.cfg.load, self.save_dir)
        have = store.iterations(self.save_dir)
        if have and (self.load_dir is None or self.load_dir.parent.resolve() != self.save_dir.resolve()):
            raise CheckpointError(f"ckpt.save_dir {self.save_dir} already holds checkpoints (newest "
                                  f"{policy.iter_name(have[-1])}) that this run would not continue from: resume "
                                  f"them (ckpt.load: auto) or choose another ckpt.save_dir")
        self.meta = store.read_meta(self.load_dir) if self.load_dir is not None else None
        if self.meta is not None:
            store.check_model(self.meta, job.model.arch.to_dict(), self.load_dir)
            problem, note = resume_notes(self.meta, job)
            if problem:
                raise CheckpointError(f"{self.load_dir}: {problem}")
            if note:
                report(f"checkpoint: {note}")
            if self.meta["iteration"] >= job.train.steps:
                raise CheckpointError(f"{self.load_dir}: already at iteration {self.meta['iteration']}, and "
                                      f"train.steps is {job.train.steps}: nothing left to train (raise train.steps)")
        self.first_step = 1
        self.pending: tuple[int, dict, float] | None = None  # an async save being written
        self.started_from = started_from(self.meta, self.cfg.hf, self.load_dir)

    @property
    def iteration(self) -> int:
        """The iteration the run resumes from (0: a fresh start, or weights alone)."""
        return self.meta["iteration"] if self.meta is not None else 0

    @property
    def model_only(self) -> bool:
        """A converted checkpoint (miles convert hf-to-dist): weights, no training state."""
        return bool(self.meta and self.meta.get("model_only"))

    def layout(self) -> dict:
        return self.job.train.parallel.model_dump()

    @property
    def resumes(self) -> bool:
        """Training state to continue (not a fresh start, nor weights alone)."""
        return self.meta is not None and not self.model_only

    def load_start_weights(self, trainer) -> None:
        """Load the weights the run started from (RL's reference policy on a resume):
        `started_from`'s HF or converted checkpoint; none for the seeded initialisation, which
        the trainer has from its start. Gone: an error (the reference never changes silently)."""
        load_weights(trainer, reference_weights(self.started_from, self.load_dir))

    def check_reference(self, named: Path | None) -> None:
        """A resumed run keeps its KL reference: one the run named (algo.kl_reference) must be
        named again; a job may name one for a run that had its starting weights (said here)."""
        if not self.resumes:
            return
        problem = reference_change(self.meta, named)
        if problem:
            raise CheckpointError(f"{self.load_dir}: {problem}")
        before = self.meta.get("job", {}).get("algo", {}).get("kl_reference")
        if named is not None and before is None:
            start = next(iter(self.started_from.values()), "its seeded initialisation")
            self.report(f"checkpoint: KL reference from here on: {named} (algo.kl_reference; the run started "
                        f"from {start})")

    def restore(self, trainer, data) -> int:
        """Load what ckpt.load names (or ckpt.hf's weights on a fresh start); returns the
        iteration to continue after."""
        t0 = time.perf_counter()
        if self.meta is None or self.model_only:  # a fresh start: ckpt.hf's or converted weights, if any
            if self.started_from:
                load_weights(trainer, self.started_from)
                self.report(f"checkpoint: weights from {next(iter(self.started_from.values()))} "
                            f"({time.perf_counter() - t0:.1f} s)")
            return 0
        same = self.meta.get("layout") == self.layout()
        trainer.call("load_checkpoint", str(self.load_dir), same_layout=same)
        if data is not None:
            data.load_state(self.meta["data"])
        self.first_step = self.iteration + 1
        self.report(f"checkpoint: resumed from {self.load_dir} ({time.perf_counter() - t0:.1f} s"
                    + ("" if same else f"; saved at {self.meta.get('layout')}, resharded") + f"); "
                    f"next step {self.first_step}")
        return self.iteration

    def maybe_save(self, step: int, trainer, data) -> None:
        self.poll(trainer, blocking=False)
        rule = (step, self.job.train.steps, self.cfg.save_interval, self.cfg.warmup_save, self.first_step,
                self.cfg.async_save)
        if policy.saves_at(*rule):
            self.save(step, trainer, data, warmup=policy.is_warmup(*rule))

    def save(self, step: int, trainer, data, warmup: bool = False) -> None:
        """`warmup`: a warm-up save (policy.is_warmup), marked so retention reaps it later."""
        self.poll(trainer, blocking=True)  # one save in flight at a time
        t0 = time.perf_counter()
        tmp = store.begin(self.save_dir, step)
        meta = {"data": data.state() if data is not None else {}, "layout": self.layout(),
                "model": self.job.model.arch.to_dict(), "job": self.job.resolved(), "saved_at": time.time(),
                "started_from": self.started_from, "warmup": warmup}
        trainer.call("save_checkpoint", str(tmp), self.cfg.async_save)
        if self.cfg.async_save:
            self.pending = (step, meta, t0)
            return
        self._commit(step, meta, t0)

    def poll(self, trainer, blocking: bool) -> None:
        """Commit the async save once every rank has written it (a collective on the workers)."""
        if self.pending is None:
            return
        done = trainer.call("finish_save", blocking)
        if all(done):
            step, meta, t0 = self.pending
            self.pending = None
            self._commit(step, meta, t0)

    def _commit(self, step: int, meta: dict, t0: float) -> None:
        final = store.commit(self.save_dir, step, meta)
        self.report(f"checkpoint: saved {final} ({time.perf_counter() - t0:.1f} s)")
        store.reap(self.save_dir, self.cfg.save_interval, self.cfg.keep_every, self.cfg.keep_last, self.report)

    def close(self, trainer) -> None:
        self.poll(trainer, blocking=True)


def load_weights(trainer, source: dict[str, str]) -> None:
    """Weights alone into the trainer: {"hf": dir} (DeepSeek's HF checkpoint) or {"dist": dir}
    (a converted checkpoint, at any layout); {} leaves the seeded initialisation."""
    if "hf" in source:
        trainer.call("load_hf", source["hf"])
    elif "dist" in source:
        trainer.call("load_checkpoint", source["dist"], same_layout=False, with_optimizer=False)


def started_from(meta: dict | None, hf, load_dir: Path | None) -> dict[str, str]:
    """Where a run's weights came from at its step 0: {"hf": dir} (DeepSeek's HF checkpoint),
    {"dist": dir} (a converted, weights-only checkpoint) or {} (the seeded initialisation). A
    fresh start knows it; a resume reads what its checkpoint recorded (one saved before this
    record existed: ckpt.hf if the job names it, else the seeded initialisation)."""
    if meta is not None and meta.get("model_only"):  # these weights are the start
        return {"dist": str(load_dir)}
    if meta is not None and "started_from" in meta:
        return dict(meta["started_from"])
    return {"hf": str(hf)} if hf is not None else {}


def resume_notes(meta: dict, job) -> tuple[str, str]:
    """(why the job cannot resume this checkpoint, what the resume changes) -- '' where
    nothing: an RL job given an SFT run's checkpoint (its steps are no rollouts: start from
    its weights instead); train.steps changed, which stretches or squeezes the learning-rate
    schedule from the next step on."""
    saved = meta.get("job") or {}
    loss = saved.get("algo", {}).get("loss")
    if job.algo.loss == "policy" and loss == "lm" and not meta.get("model_only"):
        return (f"an SFT run's checkpoint (iteration {meta['iteration']} of algo.loss: lm); an RL job resumes RL "
                "runs only: start from its weights with ckpt.hf=<that run>/hf (ckpt.save_hf: true writes it; "
                "miles convert dist-to-hf makes it from this checkpoint)"), ""
    before = saved.get("train", {}).get("steps")
    if before is not None and before != job.train.steps:
        return "", (f"train.steps {before} -> {job.train.steps}: the learning-rate schedule (warm-up, "
                    f"{job.train.optim.decay} decay) now spans {job.train.steps} steps, so the lr of the next steps "
                    f"is not the saved run's")
    return "", ""


def reference_weights(started: dict[str, str], load_dir) -> dict[str, str]:
    """Where to read a resumed run's starting weights (its KL reference): what it recorded;
    gone (moved, reaped, a submission's temporary upload): an error naming the fix."""
    path = next(iter(started.values()), None)
    if path is None or Path(path).exists():
        return started
    raise CheckpointError(f"{load_dir}: this run started from {path} (its KL reference), which is gone: restore it "
                          f"there, or name the reference's weights: algo.kl_reference=<DeepSeek HF directory>")


def reference_change(meta: dict | None, named) -> str:
    """Why a resume from `meta` with algo.kl_reference `named` would change the run's KL
    reference ('' when it would not): a reference the run named must be named again."""
    before = (meta or {}).get("job", {}).get("algo", {}).get("kl_reference")
    if before is None or (named is not None and Path(named).absolute() == Path(before).absolute()):
        return ""
    return (f"the run's KL reference is {before} (algo.kl_reference); this job names "
            f"{named or 'none (the starting weights)'}: set algo.kl_reference={before}")


