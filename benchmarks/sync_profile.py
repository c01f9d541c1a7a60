"""Where the colocated (CUDA IPC) weight sync's time goes, both ends, without Ray: a trainer
rank in this process (a TrainWorker) and an engine's staging in a second process on the same
GPU, each part timed with the device synchronised around it, at several bucket sizes.

    python3 benchmarks/sync_profile.py [--config 1b] [--bucket-mb 256 1024]

Trainer parts: walking the weights into buckets (views), packing them into flat buffers,
their fingerprints, the IPC handles. Engine parts: opening the handles, checking and staging
the buckets (Staging.add_bucket), the commit into the model, and closing the handles. The
trainer's share() is also profiled by cProfile (its top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout import PRESETS  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(parts: dict, key: str, fn, *args):
    """fn(*args), its seconds (device synchronised around it) in parts[key]."""
    sync()
    t = time.perf_counter()
    out = fn(*args)
    sync()
    parts[key] = time.perf_counter() - t
    return out


def engine_side(config: dict, inbox, outbox) -> None:
    """The engine's end: for each update (handles, specs, fingerprints, names), the parts' seconds."""
    from miles.rollout.weights import Staging, opened
    from plugins.deepseek_v4 import DeepSeekV4Config, DeepSeekV4ForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = DeepSeekV4ForCausalLM(DeepSeekV4Config.from_dict(config), dtype=torch.bfloat16, seed=1).to(dev).eval()

    def stage(st: Staging, flats: list, buckets: list) -> None:
        for f, (_, spec, fps) in zip(flats, buckets, strict=True):
            st.add_bucket(f, spec, fps)

    def close(flats: list) -> None:
        flats.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    while (msg := inbox.get()) is not None:
        buckets, names = msg
        parts = {}
        flats = timed(parts, "open", lambda bs: [opened(h) for h, _, _ in bs], buckets)
        st = Staging(model)
        timed(parts, "check and stage", stage, st, flats, buckets)
        timed(parts, "commit", st.commit, names)
        del st
        timed(parts, "close", close, flats)
        outbox.put(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from miles.rollout.weights import pack, share, spans_of, spec_of
    from miles.train import weight_export
    from miles.train.worker import TrainWorker
    from plugins.deepseek_v4.checksum import packed_fingerprints

    cfg = PRESETS[a.config](128).to_dict()
    w = TrainWorker(0, 1)
    w.init_distributed(*w.rendezvous_address())
    w.build_model(cfg, 0, dtype="bfloat16")
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=engine_side, args=(cfg, inbox, outbox))
    child.start()
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{a.config} on {where}, medians of {a.repeats} after one warm-up")
    try:
        for mb in a.bucket_mb:
            rows: dict[str, list[float]] = {}
            prof = None
            for rep in range(a.repeats + 1):
                parts = {}
                bs = timed(parts, "walk (views)", lambda n: list(weight_export.buckets(w.model, n)), mb << 20)
                flats = timed(parts, "pack", lambda b: [pack(x) for x in b], bs)
                specs = [spec_of(b) for b in bs]
                timed(parts, "fingerprints", lambda fs, ss: [packed_fingerprints(f, spans_of(s))
                                                             for f, s in zip(fs, ss, strict=True)], flats, specs)
                handles = timed(parts, "handles", lambda fs: [share(f) for f in fs], flats)
                del flats, bs
                if rep == a.repeats:  # the real share() (what the Ray call runs), profiled
                    prof = cProfile.Profile()
                    prof.enable()
                out = timed(parts, "share() whole", w.weights.share, mb << 20)
                if prof is not None:
                    prof.disable()
                names = [n for _, _, f in out for n in f]
                t = time.perf_counter()
                inbox.put((out, names))
                parts |= outbox.get()
                parts["engine round trip"] = time.perf_counter() - t
                w.weights.release()
                timed(parts, "release", torch.cuda.ipc_collect if torch.cuda.is_available() else sync)
                del handles
                if rep:
                    for k, v in parts.items():
                        rows.setdefault(k, []).append(v)
            total = sum(e.numel() * e.element_size() for e in w.model.state_dict().values()
                        if isinstance(e, torch.Tensor))
            print(f"\n== buckets of {mb} MB ({len(out)} buckets, ~{total / 1e9:.3f} GB in the model's state)")
            print(f"{'part':24s} {'ms':>9s}")
            for k, v in rows.items():
                print(f"{k:24s} {statistics.median(v) * 1e3:9.2f}")
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            print("\n".join(s.getvalue().splitlines()[4:22]))
    finally:
        inbox.put(None)
        child.join(60)
        w.shutdown()


if __name__ == "__main__":
    main()
