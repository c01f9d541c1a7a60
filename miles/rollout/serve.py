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


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="miles serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="an HF checkpoint directory, or a miles checkpoint / save_dir")
    ap.add_argument("--tokenizer", help='a tokenizer.json for text in and out ("tiny": the bundled one)')
    ap.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=30000, help="the router's port")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=4096)
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
        svc = EngineService(EngineSpec(hf=str(hf), dtype=args.dtype, max_running=args.max_running,
                                       max_len=args.max_len, tokenizer=tokenizer_path(args.tokenizer)))
        http = HttpServer(build_app(svc))
        router = Router([http.url], host=args.host, port=args.port)
        print(f"miles serve: {args.path} on {router.url} (engine {http.url})\n"
              f"  curl {router.url}/generate -H 'content-type: application/json' "
              "-d '{\"input_ids\": [1, 2, 3], \"sampling_params\": {\"max_new_tokens\": 16}}'", flush=True)
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
