"""Prefix caching benchmark: caching on vs off in the same run, on the engine (no HTTP).

Workload "shared": N requests share one long prefix (an agent's system prompt) and differ in a
short suffix. Workload "unique": no two requests share a block, so caching can only cost (hashing
and lookups): its overhead. Each configuration runs `--repeats` times, interleaved, and the
medians are compared.

    python -m benchmarks.prefix_cache [--model DIR] [--requests 64] [--prefix 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams


def workload(kind: str, n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(prefix_len)]
    prompts = []
    for _ in range(n):
        head = shared if kind == "shared" else [rng.randrange(10, vocab) for _ in range(prefix_len)]
        prompts.append(head + [rng.randrange(10, vocab) for _ in range(suffix_len)])
    return prompts


class BookkeepingTimer:
    """Adds up the time the engine spends in prefix-cache lookups and registrations: a direct
    measure of caching's cost that the machine's noise does not swamp."""

    def __init__(self, kv) -> None:
        self.seconds = 0.0
        for name in ("find_cached", "cache_computed"):
            setattr(kv, name, self._wrap(getattr(kv, name)))

    def _wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def run_once(core, prompts, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(EngineRequest(f"r{i}", p, params))
    first: dict[str, float] = {}
    out_tokens = 0
    while core.has_work:
        for out in core.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now - t0)
            out_tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    ttft = sorted(first.values())
    return {
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: built-in tiny)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = ap.parse_args()

    from gpu.launch import load

    def engine(caching: bool):
        return load(
            EngineConfig(
                model=args.model,
                enable_prefix_caching=caching,
                max_model_len=args.prefix + args.suffix + args.max_tokens + 16,
                max_num_batched_tokens=2048,
            )
        ).core

    cores = {True: engine(True), False: engine(False)}
    timer = BookkeepingTimer(cores[True].kv)
    vocab = cores[True].runner.vocab_size
    results: dict[str, dict] = {}
    for kind in ("shared", "unique"):
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for rep in range(args.repeats):
            prompts = workload(kind, args.requests, args.prefix, args.suffix, vocab, seed=rep)
            for caching in (False, True) if rep % 2 == 0 else (True, False):
                core = cores[caching]
                # A fresh cache each run: "shared" measures reuse within the batch, not across runs.
                core.kv.pool.__init__(core.kv.num_blocks)
                timer.seconds = 0.0
                r = run_once(core, prompts, args.max_tokens)
                if caching:
                    r["bookkeeping_pct"] = 100 * timer.seconds / r["elapsed_s"]
                runs[caching].append(r)
        med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in runs[c][-1]} for c in runs}
        results[kind] = {
            "caching_on": med[True],
            "caching_off": med[False],
            "ttft_mean_ratio_off_over_on": med[False]["ttft_mean_s"] / med[True]["ttft_mean_s"],
            "throughput_ratio_on_over_off": med[True]["output_tok_s"] / med[False]["output_tok_s"],
            "time_overhead_pct": 100 * (med[True]["elapsed_s"] / med[False]["elapsed_s"] - 1),
            "bookkeeping_pct": med[True]["bookkeeping_pct"],
        }

    meta = {
        "model": args.model or "weir-tiny",
        "requests": args.requests,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))

    print("| workload | caching | TTFT mean (s) | TTFT p99 (s) | output tok/s | total (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind, r in results.items():
        for label, key in (("off", "caching_off"), ("on", "caching_on")):
            m = r[key]
            print(
                f"| {kind} | {label} | {m['ttft_mean_s']:.3f} | {m['ttft_p99_s']:.3f} | "
                f"{m['output_tok_s']:.0f} | {m['elapsed_s']:.2f} |"
            )
    s, u = results["shared"], results["unique"]
    print(
        f"\nshared prefix: TTFT {s['ttft_mean_ratio_off_over_on']:.2f}x lower with caching, "
        f"throughput {s['throughput_ratio_on_over_off']:.2f}x"
    )
    print(
        f"no sharing: total time {u['time_overhead_pct']:+.1f}% with caching (wall clock, "
        f"noisy); hashing and lookups took {u['bookkeeping_pct']:.2f}% of engine time"
    )


if __name__ == "__main__":
    main()
