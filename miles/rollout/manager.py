"""The rollout manager: engines, SGLang's router in front of them, their weight updates, and
generation through the router (miles.rollout.client: no sample lost).

A health monitor checks each engine's /health; an engine that fails `health_failures` checks in a row
(dead, hung, or stuck with work waiting) is removed from the router, killed and replaced,
and the replacement gets the latest weights before it is added back. Runs in the driver or
as a Ray actor (`ray.remote(RolloutManager)`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass

import httpx
import ray

from miles.cluster.node import device_options
from miles.config import RolloutConfig
from miles.rollout.client import RolloutError, RouterClient
from miles.rollout.embedded import EmbeddedEngine
from miles.rollout.router import Router
from miles.rollout.sglang import SGLangEngine
from miles.rollout.updates import apply_update
from miles.rollout.weights import WeightSyncError

log = logging.getLogger(__name__)
PEER_COPY_TIMEOUT = 600.0  # seconds a live engine may take to put its weights for a replacement


@dataclass
class EngineSlot:
    actor: object
    url: str
    pid: int
    failures: int = 0
    alive: bool = True  # False once it is being replaced: no update or generation goes to it
    bundle: int | None = None  # its bundle of the colocation's placement group (a replacement takes it over)


class RolloutManager:
    def __init__(self, cfg: dict | RolloutConfig, spec: dict, log_dir: str | None = None,
                 version: int | None = None, colocation: tuple | None = None):
        """cfg: the job's `rollout` section; spec: the EngineSpec fields every engine shares
        (model config or HF directory, seed, dtype); version: the trainer step whose weights
        the engines start from (SGLang's: spec's directory), None where they are not the
        trainer's; colocation: (placement group, miles.cluster.placement.Colocation) on GPUs
        shared with the trainer: engine e in bundle colocation.engine_bundles[e]."""
        self.cfg = cfg if isinstance(cfg, RolloutConfig) else RolloutConfig.model_validate(cfg)
        c = self.cfg
        # The run's key: its engines (embedded or SGLang's) answer only the router and this
        # manager (they listen on the node's address on a cluster).
        self.api_key = secrets.token_urlsafe(24)
        self.spec = {**spec, "max_running": c.max_running, "max_len": c.max_len, "prefill_tokens": c.prefill_tokens,
                     "hang_timeout": c.hang_timeout, "api_key": self.api_key}
        if c.tokenizer is not None:
            from miles.data.sft import tokenizer_path

            self.spec["tokenizer"] = tokenizer_path(c.tokenizer)  # "tiny": the bundled file
        if c.engine == "sglang" and not spec.get("hf"):
            raise ValueError("rollout.engine: sglang serves a model directory (DeepSeek's HF layout): set its path")
        cls = EmbeddedEngine if c.engine == "embedded" else SGLangEngine
        self._actor_cls = ray.remote(cls)
        self._actor_opts = {"num_cpus": c.cpus_per_engine, **device_options(c.gpus_per_engine), "max_restarts": 0}
        self._pg, plan = colocation or (None, None)
        if plan is not None:
            if len(plan.engine_bundles) != c.num_engines:
                raise ValueError(f"the colocation places {len(plan.engine_bundles)} engines, rollout.num_engines is "
                                 f"{c.num_engines}")
            self._actor_opts = {"num_cpus": plan.engine["CPU"], "num_gpus": plan.engine["GPU"], "max_restarts": 0}
        # The last weight update, replayed to replacement engines; version: the trainer step the
        # engines' weights come from (None: unknown). Both change under the update lock only:
        # with an update, or (version) when a replacement could not be brought up to date.
        self.latest: dict | None = ({"path": spec["hf"], "version": version}
                                    if c.engine == "sglang" and version is not None else None)
        self.version = version
        self.engines = self._start_engines(plan.engine_bundles if plan is not None else [None] * c.num_engines)
        self.router = Router([e.url for e in self.engines], c.router_policy, request_timeout=c.request_timeout,
                             health_interval=c.health_interval, extra_args=list(c.router_args),
                             log_file=f"{log_dir}/router.log" if log_dir else None, api_key=self.api_key)
        self.stats = {"restarts": 0, "retries": 0, "timeouts": 0, "aborted": 0, "wrong_weights": 0}
        self.client = RouterClient(self.router.url, self.router.headers, c, self.stats)
        self._lock = threading.RLock()
        self._update_lock = threading.RLock()  # an update and a replacement's catch-up never interleave
        self._broadcast = None  # rollout.sync.BroadcastGroup, opened at the first broadcast and kept
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ engines
    def _start_engines(self, bundles: list[int | None]) -> list[EngineSlot]:
        """One engine per entry: in that bundle of the colocation's placement group, or (None)
        wherever Ray places it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, n = self.cfg, len(bundles)
        cls = [self._actor_cls.options(**self._actor_opts) if b is None else self._actor_cls.options(
            **self._actor_opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=b)) for b in bundles]
        if c.engine == "sglang":  # a replacement starts from the weights the others serve
            path = self.latest["path"] if self.latest and "path" in self.latest else self.spec["hf"]
            actors = [k.remote(path, dict(c.sglang), startup_timeout=c.startup_timeout, api_key=self.api_key)
                      for k in cls]
        else:
            actors = [k.remote(self.spec) for k in cls]
        try:  # an engine's constructor returns once it serves (SGLang's: its own wait, same timeout)
            urls = ray.get([a.url.remote() for a in actors], timeout=c.startup_timeout)
        except ray.exceptions.GetTimeoutError:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise RolloutError(f"{n} engine(s) did not start within rollout.startup_timeout={c.startup_timeout:g} s "
                               "(loading a large model's weights can take longer: raise it)") from None
        except ray.exceptions.RayActorError as e:  # an engine's constructor raised (its reason inside)
            for a in actors:
                ray.kill(a, no_restart=True)
            raise RolloutError(f"an engine failed to start: {e}") from None
        pids = ray.get([a.pid.remote() for a in actors])
        return [EngineSlot(a, u, p, bundle=b) for a, u, p, b in zip(actors, urls, pids, bundles, strict=True)]

    def engine_actors(self) -> list:
        with self._lock:
            return [e.actor for e in self.engines if e.alive]

    def engine_info(self) -> list[dict]:
        with self._lock:
            return [{"url": e.url, "pid": e.pid, "failures": e.failures} for e in self.engines]

    def _healthy(self, url: str) -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=self.cfg.health_timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.health_interval):
            with self._lock:
                engines = list(self.engines)
            for e in engines:
                if self._stop.is_set():
                    return
                if self._healthy(e.url):
                    e.failures = 0
                    continue
                e.failures += 1
                if e.failures >= self.cfg.health_failures:
                    try:
                        self._replace(e)
                    except Exception:
                        log.exception("replacing engine %s failed; will retry", e.url)

    def _replace(self, dead: EngineSlot) -> None:
        """Kill `dead`, start a new engine, bring it to the latest weights and put it in its
        place. Updates in the meantime skip the dead slot; the catch-up and the swap happen
        under the update lock, so the new engine gets every update (none lands between)."""
        log.warning("engine %s (pid %d) failed %d health checks: replacing it", dead.url, dead.pid, dead.failures)
        if dead.alive:
            self.router.remove(dead.url)
            with self._lock:
                dead.alive = False
            ray.kill(dead.actor, no_restart=True)
        new = self._start_engines([dead.bundle])[0]
        try:
            with self._update_lock:
                # A broadcast is not kept to replay: then the new engine copies a live one's weights.
                behind = self.version is not None and (self.latest or {}).get("version") != self.version
                if behind and self._copy_from_peer(new):
                    behind = False
                elif self.latest is not None:
                    apply_update([new], self.latest)
                if behind:  # the next sync brings every engine up to date
                    log.warning("engine %s serves older weights than version %s until the next weight sync",
                                new.url, self.version)
                with self._lock:  # one change as the monitor's readers see it
                    if behind:
                        self.version = None
                    self.engines = [new if e is dead else e for e in self.engines]
                    self.stats["restarts"] += 1
        except BaseException:  # not left running beside the next try
            ray.kill(new.actor, no_restart=True)
            raise
        self.router.add(new.url)

    def _copy_from_peer(self, new: EngineSlot) -> bool:
        """Bring `new` to the weights a live embedded engine serves at `version` (object-store
        buckets, MD5s checked); False where none could give them (SGLang's engines keep no such
        call). A peer that fails or hangs is passed over; `new` failing raises."""
        if self.cfg.engine != "embedded":
            return False
        with self._lock:
            peers = [e for e in self.engines if e.alive and e is not new and not e.failures]
        for peer in peers:
            try:
                served = ray.get(peer.actor.put_weight_buckets.remote(self.cfg.bucket_mb << 20),
                                 timeout=PEER_COPY_TIMEOUT)
            except ray.exceptions.RayError as err:  # GetTimeoutError is one
                log.warning("engine %s could not give its weights to %s: %s", peer.url, new.url, err)
                continue
            if served["version"] != self.version:  # a sync that reached only some engines
                continue
            buckets = served["buckets"]
            apply_update([new], {"buckets": buckets, "names": [n for _, s in buckets for n in s],
                                "version": self.version})
            log.info("engine %s copied version %s from %s", new.url, self.version, peer.url)
            return True
        return False

    # ------------------------------------------------------------------ weights
    def update_weights(self, buckets: list[tuple], names: list[str], version: int) -> dict:
        """Object-store path: buckets [(ObjectRef of {name: tensor}, {name: md5})] from the
        trainer's owning ranks go to every engine; each verifies and swaps them in whole."""
        if self.cfg.engine == "sglang":
            raise WeightSyncError("object-store weight sync serves the embedded engine; SGLang engines take "
                                  "weights from a directory (rollout.sync: disk)")
        return self._update({"buckets": buckets, "names": names, "version": version})

    def update_shared(self, buckets: list[tuple], names: list[str], version: int) -> dict:
        """Colocated path: buckets [(share handle, spec, {name: fingerprint})] that the trainer's
        ranks keep in their own memory (CUDA IPC on GPUs); every engine opens them in place.
        Not kept to replay (the buffers go once the engines have them): a later replacement
        copies a live engine's weights."""
        if self.cfg.engine == "sglang":
            raise WeightSyncError("shared-buffer weight sync serves the embedded engine (SGLang: rollout.sync: disk)")
        with self._update_lock:
            with self._lock:
                engines = [e for e in self.engines if e.alive]
            try:
                res = apply_update(engines, {"shared": buckets, "names": names, "version": version})
            except ray.exceptions.RayActorError as e:
                raise WeightSyncError(f"an engine died during the weight update: {e}") from None
            self.version = version
            return res

    def update_from_disk(self, path: str, version: int) -> dict:
        """Disk path: every engine loads the weights at `path` (DeepSeek's HF layout, every
        tensor) whole; SGLang's engines take them only this way."""
        return self._update({"path": path, "version": version})

    def update_by_broadcast(self, trainer, bucket_bytes: int, version: int, backend: str) -> dict:
        """Broadcast path (`rollout.sync.sync_broadcast`) to every live engine, under the update
        lock (a replacement catches up before or after it, never during). Not kept to replay:
        a later replacement copies a live engine's weights."""
        from miles.rollout.sync import BroadcastGroup, sync_broadcast

        if self.cfg.engine == "sglang":
            raise WeightSyncError("broadcast weight sync serves the embedded engine; SGLang engines take weights "
                                  "from a directory (rollout.sync: disk)")
        with self._update_lock:
            if self._broadcast is None or self._broadcast.backend != backend:
                if self._broadcast is not None:
                    self._broadcast.close()
                self._broadcast = BroadcastGroup(backend)
            try:
                res = sync_broadcast(trainer, self.engine_actors(), bucket_bytes, version, backend, self._broadcast)
            except ray.exceptions.RayActorError as e:  # died mid-update: the monitor replaces it
                raise WeightSyncError(f"an engine died during the weight broadcast: {e}") from None
            self.version = version
            return res

    def _update(self, update: dict) -> dict:
        with self._update_lock:
            with self._lock:
                engines = [e for e in self.engines if e.alive]
            try:
                res = apply_update(engines, update)
            except ray.exceptions.RayActorError as e:  # died mid-update: the monitor replaces it
                raise WeightSyncError(f"an engine died during the weight update: {e}") from None
            self.latest, self.version = update, update["version"]
            return res

    # ------------------------------------------------------------------ generation
    def generate(self, requests: list[dict], version: int | None = None, each=None) -> list:
        """RouterClient.generate through this manager's router."""
        return self.client.generate(requests, version, each)

    def generate_transcripts(self, samples: list[dict], fn: str = "miles.rollout.multiturn:single_turn",
                             version: int | None = None) -> list:
        """RouterClient.generate_transcripts through this manager's router."""
        return self.client.generate_transcripts(samples, fn, version)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self._stop.set()
        self._monitor.join(timeout=30)
        with self._update_lock:
            if self._broadcast is not None:
                self._broadcast.close()
        self.router.stop()
        with self._lock:
            for e in self.engines:
                try:
                    ray.get(e.actor.shutdown.remote(), timeout=10)
                except Exception:
                    pass
                ray.kill(e.actor, no_restart=True)
            self.engines = []
