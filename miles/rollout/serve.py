"""`miles serve PATH`: one embedded engine behind SGLang's router, for interactive use.

PATH is a DeepSeek HF directory (config.json + safetensors) or a miles checkpoint (an
iter_ directory or a save_dir; converted to the HF layout first). Serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path

from miles.rollout.router import Router
from miles.rollout.server import HttpServer, build_app
from miles.rollout.service import EngineService, EngineSpec


def stored_dtype(hf: Path) -> str:
    """The dtype a checkpoint's weights are stored in, as the engine takes it: float32 where its
    floating tensors are float32 (a model trained in fp32), bfloat16 otherwise (bf16, FP8)."""
    import json

    from safetensors import safe_open

    index = hf / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        [p.name for p in sorted(hf.glob("*.safetensors"))]
    with safe_open(str(hf / files[0]), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    return "float32" if "F32" in dtypes and not dtypes & {"BF16", "F16", "F8_E4M3"} else "bfloat16"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="miles serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("path", type=Path, help="an HF checkpoint directory, or a miles checkpoint / save_dir")
    ap.add_argument("--tokenizer", help='a tokenizer.json for text in and out ("tiny": the bundled one); default: '
                                        "the checkpoint's own (tokenizer.json beside its weights)")
    ap.add_argument("--host", default="127.0.0.1", help="the router's address")
    ap.add_argument("--port", type=int, default=30000, help="the router's port")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="default: the dtype its weights are stored in (float32 stays float32, else bfloat16)")
    ap.add_argument("--max-running", type=int, default=64, help="sequences decoded together")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens per sequence")
    args = ap.parse_args(argv)
    from miles.data.sft import tokenizer_path

    with tempfile.TemporaryDirectory(prefix="miles-serve-") as tmp:
        hf = args.path
        if not (hf / "config.json").is_file():
            from miles.ckpt.convert import dist_to_hf
            from miles.ckpt.store import CheckpointError

            try:
                hf = dist_to_hf(args.path, Path(tmp) / "hf")
            except (CheckpointError, ValueError, FileNotFoundError) as e:
                raise SystemExit(f"miles serve: {args.path}: neither an HF directory nor a checkpoint ({e})") from None
        tokenizer = tokenizer_path(args.tokenizer) or (str(hf / "tokenizer.json")
                                                        if (hf / "tokenizer.json").is_file() else None)
        svc = EngineService(EngineSpec(hf=str(hf), dtype=args.dtype or stored_dtype(hf),
                                       max_running=args.max_running, max_len=args.max_len, tokenizer=tokenizer))
        http = HttpServer(build_app(svc))
        router = Router([http.url], host=args.host, port=args.port)
        prompt = '"text": "What is 2 + 3?"' if tokenizer else '"input_ids": [1, 2, 3]'
        print(f"miles serve: {args.path} on {router.url} (engine {http.url}; {svc.spec.dtype}, "
              f"{'tokenizer ' + tokenizer if tokenizer else 'no tokenizer: token ids only'})\n"
              f"  curl {router.url}/generate -H 'content-type: application/json' "
              f"-d '{{{prompt}, \"sampling_params\": {{\"max_new_tokens\": 16}}}}'", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            stop.wait()
        finally:
            router.stop()
            http.stop()
            svc.stop()
            print("miles serve: stopped", flush=True)
