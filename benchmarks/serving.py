"""Serving benchmark: weir vs `transformers serve --continuous-batching` under streaming load.

Both serve the same model and get the same greedy prompts with only standard OpenAI fields, so
they do the same work; weir runs twice, its engine in its own process (the default) and on a
thread (`--no-engine-process`). For each concurrency (1, 16, 64, 256): TTFT, TPOT and ITL at p50
and p99, output tokens/s (counted from the usage chunk) and errors. `--url` points the load
generator at any running server instead.

    python -m benchmarks.serving [--model qwen3-3layer] [--concurrency 1,16,64,256]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys

import trio

from benchmarks.common import bench_model, machine, save
from benchmarks.loadgen import ServerProcess, free_port, prompts, run_level, summarize, weir_argv


def bench(
    url: str, model: str, levels: list[int], max_tokens: int, per_level: int, repeats: int = 1
) -> dict:
    """Each level `repeats` times; the run with the median output tok/s is reported whole, with
    every run's tok/s beside it (a level lasts seconds, and this machine is shared)."""
    out = {}
    for c in levels:
        n = max(per_level, 2 * c)
        runs = []
        for _ in range(repeats):
            results, wall = trio.run(
                functools.partial(run_level, url, model, prompts(n, seed=c), c, max_tokens)
            )
            runs.append(summarize(results, wall))
        runs.sort(key=lambda r: r["output_tok_s"])
        s = out[c] = dict(runs[len(runs) // 2])
        s["tok_s_runs"] = [r["output_tok_s"] for r in runs]
        s["errors"] = sum(r["errors"] for r in runs)  # every run's: none may hide
        print(
            f"  c={c}: {s['output_tok_s']:.0f} tok/s (runs {[round(x) for x in s['tok_s_runs']]}), "
            f"TTFT p50 {s['ttft_p50_ms']} ms, errors {s['errors']}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-3layer")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32, help="per level (at least 2x concurrency)")
    ap.add_argument("--url", default=None, help="benchmark this running server only")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs per level; the median is kept")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    model = bench_model(args.model)
    if args.url:
        print(bench(args.url, model, levels, args.max_tokens, args.requests))
        return
    results = {}
    # weir twice: the engine in a process of its own (the default), where it does not share the
    # HTTP side's interpreter lock, and on a thread of the server process (--no-engine-process).
    for label, extra in (("weir", ()), ("weir --no-engine-process", ("--no-engine-process",))):
        port = free_port()
        weir = ServerProcess(weir_argv(model, port, *extra), port, "/tmp/weir-serving.log")
        try:
            weir.wait_ready()
            print(f"{label}:")
            results[label] = bench(
                weir.url, model, levels, args.max_tokens, args.requests, args.repeats
            )
        finally:
            weir.stop()
    if not args.skip_baseline:
        exe = shutil.which("transformers") or f"{sys.prefix}/bin/transformers"
        port = free_port()
        hf = ServerProcess(
            [
                exe,
                "serve",
                model,
                "--continuous-batching",
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            port,
            "/tmp/hf-serving.log",
        )
        try:
            hf.wait_ready()
            print("transformers serve:")
            results["transformers"] = bench(
                hf.url, model, levels, args.max_tokens, args.requests, args.repeats
            )
        finally:
            hf.stop()
    ratios = {}
    if "transformers" in results:
        for label in [k for k in results if k.startswith("weir")]:
            ratios[label] = {}
            for c in levels:
                base = results["transformers"][c]["output_tok_s"]
                ratios[label][c] = results[label][c]["output_tok_s"] / base if base else None
            print(
                f"{label} / transformers output tok/s:",
                {c: round(r, 2) if r else None for c, r in ratios[label].items()},
            )
    save(
        "serving",
        {
            "meta": {
                **machine(),
                "model": args.model,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
            },
            "results": results,
            "ratio": ratios,
        },
    )


if __name__ == "__main__":
    main()
