"""`miles convert`: DeepSeek's HF layout <-> our sharded checkpoints, through real workers.

    miles convert hf-to-dist --hf DIR --out SAVE_DIR [--tp N --pp N --ep N]
        workers at that layout each read their own slices of the safetensors shards (FP8/FP4
        dequantized) and write a model-only checkpoint, SAVE_DIR/iter_0000000 (a job loads it
        with ckpt.load: SAVE_DIR and trains from step 1 with a fresh optimizer)
    miles convert dist-to-hf --ckpt DIR --out DIR [--tp N --pp N --ep N]
        workers at that layout (default one) load the checkpoint's model (saved at any layout)
        and each writes the tensors it owns under DeepSeek's names; this process writes the
        index and config.json (no weights pass through it)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time
from pathlib import Path

from miles.ckpt import store


@contextlib.contextmanager
def _workers(tp: int, pp: int, ep: int):
    """A TrainGroup of the smallest world with this layout, on the Ray cluster this process
    joined or a local one started (and stopped) here."""
    import ray

    from miles.cluster.train_group import TrainGroup

    dp = ep // math.gcd(ep, tp)  # expert ranks are carved from dp x tp
    world = tp * pp * dp
    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=world, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level=logging.ERROR)  # Ray's start-up lines are not the user's business
    try:
        group = TrainGroup(world, tp=tp, pp=pp, ep=ep)
        try:
            yield group
        finally:
            group.shutdown()
    finally:
        if own:
            ray.shutdown()


def hf_to_dist(hf: Path, out: Path, tp: int = 1, pp: int = 1, ep: int = 1, report=print) -> Path:
    from plugins.deepseek_v4 import DeepSeekV4Config

    cfg = DeepSeekV4Config.from_pretrained(hf)
    t0 = time.perf_counter()
    with _workers(tp, pp, ep) as group:
        group.call("build_model", cfg.to_dict(), 0)
        group.call("load_hf", str(hf))
        tmp = store.begin(out, 0)
        group.call("save_checkpoint", str(tmp), model_only=True)
        final = store.commit(out, 0, {"model_only": True, "model": cfg.to_dict(), "data": {},
                                      "layout": {"tp": tp, "pp": pp, "ep": ep}, "source": str(hf)})
    report(f"miles convert: {hf} -> {final} (tp={tp} pp={pp} ep={ep}, {time.perf_counter() - t0:.1f} s)")
    return final


def dist_to_hf(ckpt: Path, out: Path, tp: int = 1, pp: int = 1, ep: int = 1, report=print) -> Path:
    from plugins.deepseek_v4 import DeepSeekV4Config

    path = store.resolve(str(ckpt), Path(ckpt))
    meta = store.read_meta(path)
    cfg = DeepSeekV4Config.from_dict(meta["model"], source=str(path / store.META))
    t0 = time.perf_counter()
    dtype = meta.get("job", {}).get("model", {}).get("dtype", "float32")  # the dtype it trained in
    with _workers(tp, pp, ep) as group:
        group.call("build_model", cfg.to_dict(), 0, dtype=dtype)
        group.call("load_checkpoint", str(path), same_layout=False, with_optimizer=False)
        nbytes = group.save_hf(Path(out), cfg)
    data = meta.get("job", {}).get("data")
    if data is not None:  # the tokenizer the run trained with, so the weights serve text on their own
        from miles.data.sft import copy_tokenizer

        copy_tokenizer(data.get("tokenizer"), data.get("template", "deepseek_v4"), Path(out))
    report(f"miles convert: {path} -> {out} ({nbytes / 2**30:.2f} GiB, tp={tp} pp={pp} ep={ep}, "
           f"{time.perf_counter() - t0:.1f} s)")
    return Path(out)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="miles convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("hf-to-dist", help="an HF checkpoint -> a sharded, model-only checkpoint")
    a.add_argument("--hf", type=Path, required=True, help="a directory with config.json and safetensors shards")
    a.add_argument("--out", type=Path, required=True, help="a save_dir: the checkpoint goes to OUT/iter_0000000")
    for k in ("tp", "pp", "ep"):
        a.add_argument(f"--{k}", type=int, default=1, help=f"{k} of the workers that read and write")
    b = sub.add_parser("dist-to-hf", help="a checkpoint (iter_ directory or save_dir) -> DeepSeek's HF layout")
    b.add_argument("--ckpt", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    for k in ("tp", "pp", "ep"):
        b.add_argument(f"--{k}", type=int, default=1, help=f"{k} of the workers that read and write")
    args = ap.parse_args(argv)
    try:
        if args.what == "hf-to-dist":
            if not (args.hf / "config.json").is_file():
                raise store.CheckpointError(f"{args.hf}: not an HF checkpoint directory (no config.json)")
            hf_to_dist(args.hf, args.out, args.tp, args.pp, args.ep)
        else:
            dist_to_hf(args.ckpt, args.out, args.tp, args.pp, args.ep)
    except (store.CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"miles convert: {e}")
        raise SystemExit(1) from None
