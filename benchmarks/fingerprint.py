"""The weight sync's device checksum against a plain copy of the same bytes (the memory floor):
`checksum.packed_fingerprints` over one buffer holding a 1b-sized model's tensors, by torch's
scans and (CUDA) by the block-sum kernel.

    python3 benchmarks/fingerprint.py [--gb 2.708] [--device cuda]
    .venv/bin/python benchmarks/fingerprint.py --gb 0.2 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins.deepseek_v4.checksum import packed_fingerprints  # noqa: E402


def timed(fn, device: str, reps: int = 3) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.708, help="bytes in the buffer (1b's bf16 weights: 2.708)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    n = int(a.gb * 1e9) // 2 * 2
    flat = torch.randint(0, 256, (n,), dtype=torch.uint8, device=a.device)
    g = torch.Generator().manual_seed(0)
    spans, off = [], 0
    while off < n:  # tensors of 2 KB to 16 MB, as a model's
        size = min(int(torch.randint(1_000, 8_000_000, (1,), generator=g)) * 2, n - off)
        spans.append((f"t{len(spans)}", off, size))
        off += size
    dst = torch.empty_like(flat)
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"{where}: {n / 1e9:.3f} GB in {len(spans)} tensors, medians of 3\n")
    print(f"{'pass':34s} {'ms':>9s} {'GB/s':>8s}")
    passes = [("copy of the bytes (the floor)", lambda: dst.copy_(flat)),
              ("packed_fingerprints, torch's scans", lambda: packed_fingerprints(flat, spans, kernel=False))]
    if a.device == "cuda":  # the GPU's default
        passes.append(("packed_fingerprints, block kernel", lambda: packed_fingerprints(flat, spans, kernel=True)))
    for name, fn in passes:
        s = timed(fn, a.device)
        print(f"{name:34s} {s * 1e3:9.1f} {n / s / 1e9:8.1f}")


if __name__ == "__main__":
    main()
