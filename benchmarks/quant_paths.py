"""The CPU products' paths against each other: the same packed weight (in cache: 2048 x 2048 by
default) through each of weir's kernel paths this CPU runs (gpu/cpu/csrc/quant_avx2.cpp,
quant_avx512.cpp), at several row counts, passes alternated in one process. Prints ms per
product, GOP/s (two per weight and row) and each path's time over the fastest's.

An AVX-512 CPU runs the AVX2 path too, so the path for CPUs without AVX-512 is measured here
(on Zen 4 AVX-512 is 256 bits wide inside, so the ratio is mostly the instructions each path
takes: maddubs + madd against VNNI's one, float FMAs against bf16 pair products).

    python -m benchmarks.quant_paths --formats bf16,f16,q4_k --rows 1,16,64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gpu.cpu import quant as cpu_quant
from gpu.quant.formats import FORMATS
from gpu.quant.gguf_random import random_blocks

SIXTEEN = {"bf16": torch.bfloat16, "f16": torch.float16}


def packed(fmt: str, n: int, k: int) -> cpu_quant.QuantWeight:
    f = FORMATS[fmt]
    if fmt in SIXTEEN:
        return cpu_quant.pack(torch.randn(n, k).to(SIXTEEN[fmt]), f, (n, k))
    return cpu_quant.pack(random_blocks(fmt, n, k, np.random.default_rng(0)), f, (n, k))


def measure(w, rows: int, paths: list[str], passes: int, calls: int) -> dict[str, float]:
    x = torch.randn(rows, w.in_features)
    for path in paths:
        cpu_quant.linear(x, w, path=path)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for i in range(passes):
        for path in paths if i % 2 == 0 else reversed(paths):
            t = time.perf_counter()
            for _ in range(calls):
                cpu_quant.linear(x, w, path=path)
            times[path].append((time.perf_counter() - t) / calls)
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,f16,q8_0,q4_0,q4_k,q6_k")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    paths = [p for p in cpu_quant.available_paths() if p != "ref"]
    print(f"paths {paths}, {args.threads} thread(s), weight {args.n} x {args.k}")
    for fmt in args.formats.split(","):
        w = packed(fmt, args.n, args.k)
        for rows in (int(r) for r in args.rows.split(",")):
            t = measure(w, rows, paths, args.passes, args.calls)
            best = min(t.values())
            ops = 2 * args.n * args.k * rows / 1e9
            cells = "  ".join(
                f"{p} {t[p] * 1e3:7.3f} ms {ops / t[p]:6.1f} GOP/s x{t[p] / best:.2f}"
                for p in paths
            )
            print(f"{fmt:5s} rows {rows:3d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
