"""The machine's own matrix-product roofline for a model: how fast this CPU multiplies the model's
weight shapes, timed in the benchmark's own run, and what that makes the least time a load can
take.

A token costs 2 x (the weights it is multiplied by) FLOP: Q/K/V, O, gate/up and down of every
layer and the LM head (attention's own products are left out: a few percent at these contexts,
so the roofline is, if anything, generous to the servers). One pass of `rows` activations through
every product of the model, each with weights of its own, is timed (the best of repeats) on
torch's MKL path, on oneDNN's prepacked one (gpu/cpu/onednn.py) and on weir's own kernel
(gpu/cpu/gemm.py), each in a process of its own, and the fastest kept; decode tokens are costed
at the level's batch (one row per stream), prompt tokens at a 512-row prefill chunk.

    python -m benchmarks.roofline --model llama-6layer --rows 1,16,64,512
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PREFILL_ROWS = 512


def weight_shapes(model_dir: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of every product one token goes through, in order."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    m = cfg["intermediate_size"]
    layer = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * m, h), (h, m)]
    return layer * cfg["num_hidden_layers"] + [(cfg["vocab_size"], h)]


def flops_per_token(model_dir: str) -> float:
    return 2.0 * sum(o * i for o, i in weight_shapes(model_dir))


def _best_seconds(fn, min_time: float = 0.2) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_time:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


WAYS = ("mkl", "onednn", "weir")


def rate(model_dir: str, rows: int, way: str = "mkl") -> float:
    """FLOP/s of one pass of `rows` rows through all the model's products, each with its own
    weights (so the pass reads them from wherever they live, as a forward does), on one
    implementation: torch's MKL path, oneDNN prepacked (gpu/cpu/onednn.py) or weir's kernel
    (gpu/cpu/gemm.py); every core in use."""
    import torch
    import torch.nn.functional as F

    from gpu.cpu import gemm as cpu_gemm, onednn as cpu_linear

    torch.manual_seed(0)
    ops = []
    with torch.inference_mode():
        for out_f, in_f in weight_shapes(model_dir):
            w = torch.randn(out_f, in_f) * 0.02
            x = torch.randn(rows, in_f)
            linear = torch.nn.Linear(in_f, out_f, bias=False)
            linear.weight.data.copy_(w)
            if way == "mkl":
                ops.append(functools.partial(F.linear, x, w))
            elif way == "onednn":
                ops.append(functools.partial(cpu_linear.linear, x, cpu_linear.prepare(w, None)))
            else:
                ops.append(functools.partial(cpu_gemm.linear, x, cpu_gemm.prepare(w, None)))

        def one_pass() -> None:
            for op in ops:
                op()

        return flops_per_token(model_dir) * rows / _best_seconds(one_pass, 0.5)


def rates(model_dir: str, rows: list[int]) -> dict[int, float]:
    """{rows: FLOP/s}, the fastest implementation at each, each timed in a fresh process as it
    runs best: MKL and oneDNN with libgomp's threads spinning (OMP_WAIT_POLICY=ACTIVE), weir's
    pool with torch's team passive (a spinning team takes the core the pool needs)."""
    best: dict[int, float] = {}
    for way in WAYS:
        policy = "PASSIVE" if way == "weir" else "ACTIVE"
        env = {**os.environ, "OMP_WAIT_POLICY": policy}
        argv = [sys.executable, "-m", "benchmarks.roofline", "--model", model_dir, "--json"]
        argv += ["--rows", ",".join(map(str, rows)), "--way", way]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
        except subprocess.CalledProcessError:
            continue  # oneDNN or the compiler missing here
        for r, g in json.loads(done.stdout.splitlines()[-1]).items():
            best[int(r)] = max(best.get(int(r), 0.0), g)
    return best


def fraction(
    model_dir: str,
    prompt_tokens: int,
    output_tokens: int,
    wall_s: float,
    rates: dict[int, float],
    rows: int,
) -> dict:
    """The least time the load's products take at the measured rates, and the part of `wall_s`
    it is: prompt tokens at the prefill rate, output tokens at `rows` rows (the level's streams)."""
    f = flops_per_token(model_dir)
    least = prompt_tokens * f / rates[PREFILL_ROWS] + output_tokens * f / rates[rows]
    return {"roofline_s": least, "roofline_fraction": least / wall_s if wall_s else None}


def main() -> None:
    from benchmarks.common import bench_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-6layer")
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--json", action="store_true", help="one line: {rows: FLOP/s}")
    ap.add_argument("--way", choices=WAYS, help="one implementation, in this process")
    args = ap.parse_args()
    model = bench_model(args.model)
    rows = [int(x) for x in args.rows.split(",")]
    if args.json:
        print(json.dumps({r: rate(model, r, args.way) for r in rows}))
        return
    print(f"{flops_per_token(model) / 1e6:.1f} MFLOP a token")
    measured = rates(model, rows)
    for r in rows:
        g = measured[r]
        per_token = flops_per_token(model) * r / g
        print(f"rows {r:4d}: {g / 1e9:6.1f} GFLOP/s, {per_token * 1e3:6.3f} ms a pass")


if __name__ == "__main__":
    main()
