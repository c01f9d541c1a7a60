"""One serving replica: the model, its engine, weight updates and memory release.

`EngineService` is what the HTTP server and the Ray actor (`embedded.py`) both drive. It is
built from an `EngineSpec`: a model config (seeded init, the same weights a trainer with
that seed starts from) or a DeepSeek HF directory, plus serving limits.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from miles.memory import offload, restore
from miles.rollout.engine import Engine
from miles.rollout.weights import Staging, WeightSyncError, bucket_buffer, read_dir, update_targets
from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

log = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    config: dict | None = None  # DeepSeekV4Config fields (seeded init) ...
    hf: str | None = None  # ... or a DeepSeek HF checkpoint directory
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when visible
    max_running: int = 64  # slots: sequences decoded together
    max_len: int = 4096  # tokens per sequence (prompt + generated)
    prefill_tokens: int = 8192  # prompt tokens prefilled an iteration (longer prompts: in chunks)
    tokenizer: str | None = None  # a tokenizer.json (text in and out, stop strings)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    hang_timeout: float = 60.0  # /health fails when work waits this long without a step
    weight_version: int | None = 0  # what the initial weights are called (None: no trainer's: an RL engine
    # waiting for its first weight sync)
    cuda_graphs: bool = True  # on CUDA: each decode batch bucket replayed as a CUDA graph
    return_routed_experts: bool = False  # every answer carries meta_info.routed_experts (sglang-router drops the
    # request's own flag on the way to the engine)
    return_indexer_picks: bool = False  # the same for meta_info.indexer_picks
    api_key: str | None = None  # every endpoint but /health then takes Authorization: Bearer <it> (SGLang's --api-key)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class EngineService:
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        dev = torch.device("cuda" if spec.device == "auto" and torch.cuda.is_available() else
                           ("cpu" if spec.device == "auto" else spec.device))
        dt = getattr(torch, spec.dtype)
        if spec.hf is not None:
            model = DeepSeekV4ForCausalLM.from_pretrained(spec.hf, dtype=dt)
        else:
            cfg = DeepSeekV4Config.from_dict(spec.config or {}, source="engine spec")
            model = DeepSeekV4ForCausalLM(cfg, dtype=dt, seed=spec.seed)
        self.model = model.to(dev).eval()
        self.tokenizer = _load_tokenizer(spec.tokenizer)
        # What /model_info names as the model: a local directory the router may read a tokenizer
        # from (given an id such as "seeded:3" it went to the HuggingFace hub for one)
        self._model_dir = tempfile.TemporaryDirectory(prefix="miles-engine-")
        if spec.tokenizer is not None:
            shutil.copyfile(spec.tokenizer, Path(self._model_dir.name) / "tokenizer.json")
        eos = {model.config.eos_token_id}
        if self.tokenizer is not None:
            tid = self.tokenizer.token_to_id("<｜end▁of▁sentence｜>")
            if tid is not None:
                eos = {tid}
        self.engine = Engine(self.model, spec.max_running, spec.max_len, self.tokenizer, tuple(eos),
                             spec.prefill_tokens, spec.cuda_graphs, spec.return_routed_experts,
                             spec.return_indexer_picks)
        self.engine.weight_version = spec.weight_version
        self.staging: Staging | None = None
        self.update_lock = threading.Lock()
        self._released = None
        self._group = None
        self.last_update: dict = {}

    # ------------------------------------------------------------------ health
    def healthy(self) -> tuple[bool, str]:
        e = self.engine
        if not e.alive:
            return False, "scheduler thread died"
        st = e.stats()
        stuck = time.monotonic() - e.last_progress
        if (st["waiting"] or st["running"] or st["prefilling"]) and not st["paused"] and stuck > self.spec.hang_timeout:
            return False, f"no decoding step for {stuck:.0f} s with work waiting"
        return True, "ok"

    def info(self) -> dict:
        cfg = self.model.config
        return {"model_path": self.spec.hf or self._model_dir.name, "tokenizer_path": self.spec.tokenizer,
                "weights": self.spec.hf or f"seeded:{self.spec.seed}",
                "is_generation": True, "vocab_size": cfg.vocab_size, "context_length": self.spec.max_len,
                "max_running_requests": self.spec.max_running, "weight_version": self.engine.weight_version,
                "dtype": self.spec.dtype, "device": str(next(self.model.parameters()).device)}

    # ------------------------------------------------------------------ weight updates
    def begin_update(self) -> None:
        with self.update_lock:
            if self._released is not None:
                raise WeightSyncError("memory is released: resume_memory_occupation first")
            self.staging = Staging(self.model)

    def stage(self, tensors: dict[str, torch.Tensor], sums: dict[str, str] | None) -> int:
        return self._staged(lambda st: st.add(tensors, sums), len(tensors))

    def _staged(self, add, n: int) -> int:
        """add(staging) under the update lock; a failure drops the whole update."""
        with self.update_lock:
            if self.staging is None:
                raise WeightSyncError("no update in progress (begin_update first)")
            try:
                add(self.staging)
            except Exception:
                self.staging = None
                raise
            return n

    def stage_shared(self, handle: tuple, spec: list, fingerprints: dict[str, int]) -> int:
        """A bucket a colocated trainer rank shared (weights.share): opened in place, checked
        by its fingerprints on the device, copied into the staging area."""
        from miles.rollout.weights import opened

        try:
            flat = opened(handle)
        except Exception as e:  # another node's buffer, or one already freed
            raise WeightSyncError(f"cannot open the trainer's shared buffer (colocated engines only): {e}") from e
        return self._staged(lambda st: st.add_bucket(flat, spec, fingerprints), len(spec))

    def commit(self, names: list[str], version: int | None = None) -> dict:
        """Swap the staged tensors in between two decoding steps; the engine keeps its old
        weights (and the error is raised) if anything is missing."""
        with self.update_lock:
            staging, self.staging = self.staging, None
            if staging is None:
                raise WeightSyncError("no update in progress (it failed earlier, or was never begun)")
            t0 = time.perf_counter()
            n = self.engine.run_exclusive(lambda: self._swap(staging, names, version))
            self.last_update = {"tensors": n, "bytes": staging.bytes, "swap_s": time.perf_counter() - t0,
                                "weight_version": self.engine.weight_version}
            return self.last_update

    def _swap(self, staging: Staging, names: list[str], version: int | None) -> int:
        n = staging.commit(names)
        self.engine.weight_version = (self.engine.weight_version or 0) + 1 if version is None else version
        return n

    def abort_update(self) -> None:
        with self.update_lock:
            self.staging = None

    def update_all(self, tensors: dict[str, torch.Tensor], sums: dict[str, str] | None,
                   version: int | None = None) -> dict:
        """One-shot update (a directory, an HTTP body): stage and commit together."""
        self.begin_update()
        try:
            self.stage(tensors, sums)
        except Exception:
            self.abort_update()
            raise
        return self.commit(list(tensors), version)

    def update_from_disk(self, path: str, version: int | None = None) -> dict:
        return self.update_all(read_dir(path), None, version)

    def with_weights(self, fn):
        """fn(the served tensors by name, their weight version) with no update swapping them meanwhile."""
        with self.update_lock:
            if self._released is not None:
                raise WeightSyncError("memory is released: the weights are not here to copy")
            return fn(update_targets(self.model), self.engine.weight_version)

    # ---- broadcast path: a process group of its own with the trainer's sending ranks
    def open_group(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        from miles.rollout.weights import open_group

        self._group = open_group(host, port, rank, size, backend)

    def receive_broadcast(self, plan: list[dict]) -> dict[str, str]:
        """Receive every bucket of `plan` ({"src": group rank, "spec": [(name, shape, dtype)]})
        into the staging area; returns the digest of each received tensor (weights.digests:
        MD5s on the host, fingerprints on a GPU) for the caller to compare with the sender's."""
        from miles.rollout.weights import bucket_digests

        if self._group is None:
            raise WeightSyncError("no broadcast group: open_group first")
        sums = {}
        dev = next(self.model.parameters()).device
        # Refuse a plan this model cannot take before the first broadcast: once one starts,
        # a member that leaves would stall the senders until the group's timeout.
        Staging(self.model).check_spec([x for bucket in plan for x in bucket["spec"]])
        for bucket in plan:
            flat, _ = bucket_buffer(bucket["spec"], dev)
            self._group.broadcast(flat, bucket["src"]).wait()
            sums.update(bucket_digests(flat, bucket["spec"]))
            # the caller compares the digests (staging them here would hash twice); the buffer is this update's
            spec = bucket["spec"]
            self._staged(lambda st, f=flat, sp=spec: st.add_bucket(f, sp, None, own=True), len(spec))
        return sums

    def close_group(self) -> None:
        self._group = None

    # ------------------------------------------------------------------ colocation
    def release_memory(self) -> int:
        """Free the device memory of the weights and the KV cache (the engine pauses)."""
        with self.update_lock:
            if self._released is not None:
                return 0
            self.engine.pause()

            tensors = list(self.model.parameters()) + list(self.model.buffers()) + self.engine.cache.tensors()
            def free() -> tuple:
                self.engine.decoder.reset()  # the storages come back elsewhere: graphs are captured again
                return offload(tensors)

            self._released, freed = self.engine.run_exclusive(free)
            return freed

    def resume_memory(self) -> None:
        with self.update_lock:
            if self._released is not None:
                self.engine.run_exclusive(lambda: restore(self._released))
                self._released = None
            self.engine.resume()

    def stop(self) -> None:
        self.engine.stop()
