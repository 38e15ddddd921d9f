"""Weights on huge pages against 4 KiB pages: one-row products over weights far larger than the
caches, the same packed bytes in both places, in one process, passes alternated.

weir packs weights into memory advised for transparent huge pages (gpu/cpu/csrc/huge_pages.h);
a copy made by torch's allocator (`clone`) is on 4 KiB pages wherever THP is in `madvise` mode
and THP_MEM_ALLOC_ENABLE is unset. Prints each layout's GB/s (median pass) and the ratio.

    python -m benchmarks.huge_pages --formats q4_k,q8_0 --threads 1,2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gpu.cpu import quant as cpu_quant
from gpu.quant.formats import FORMATS
from gpu.quant.gguf_random import random_blocks


def anon_huge_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def measure(fmt: str, threads: int, weights: int, passes: int, n: int, k: int) -> dict:
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    f = FORMATS[fmt]
    huge = [cpu_quant.pack(random_blocks(fmt, n, k, rng), f, (n, k)) for _ in range(weights)]
    small = [w._replace(packed=w.packed.clone()) for w in huge]  # torch's allocator
    x = torch.randn(1, k)
    total = sum(w.packed.numel() for w in huge)

    def one_pass(ws) -> float:
        t = time.perf_counter()
        for w in ws:
            cpu_quant.linear(x, w)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"4k": [], "huge": []}
    for p in range(passes + 2):
        order = (("4k", small), ("huge", huge))
        for name, ws in order if p % 2 else order[::-1]:
            dt = one_pass(ws)
            if p >= 2:  # two warm-up passes
                times[name].append(dt)
    rates = {name: total / statistics.median(ts) / 1e9 for name, ts in times.items()}
    held = anon_huge_kb() // 1024  # while both copies live
    return {**rates, "ratio": rates["huge"] / rates["4k"], "bytes": total, "huge_mb": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_k,q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--weights", type=int, default=16, help="weights cycled through a pass")
    ap.add_argument("--passes", type=int, default=28)
    ap.add_argument("--shape", default="8192,2048", help="n,k of each weight")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split(","))
    for fmt in args.formats.split(","):
        for t in (int(v) for v in args.threads.split(",")):
            r = measure(fmt, t, args.weights, args.passes, n, k)
            print(
                f"{fmt} one row, {t} thread(s), {r['bytes'] / 1e6:.0f} MB of weights: "
                f"4 KiB pages {r['4k']:.1f} GB/s, huge pages {r['huge']:.1f} GB/s, "
                f"{r['ratio']:.3f}x (AnonHugePages {r['huge_mb']} MB)",
                flush=True,
            )


if __name__ == "__main__":
    main()
