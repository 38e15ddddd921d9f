"""Speculative decoding on and off, offline, alternated: output tok/s and what was accepted.

Each stream's prompt repeats a short pattern, so the n-gram lookup always finds something to
propose. On the random-weight bench models the model's continuation almost never matches it:
this measures what speculation costs where nothing is accepted (the issue's goal: never below
0.95x of speculation off), and how fast a request that keeps failing stops proposing.

    python -m benchmarks.spec_offline [--model qwen3-6layer] [--streams 1,64] [--rounds 3]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']

Writes benchmarks/results/spec_offline.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import bench_model, machine, save

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def run(llm, streams: int, tokens: int, prompt_len: int) -> tuple[float, dict]:
    from core.sampling import SamplingParams

    prompts = [[(s * 31 + j % 8 * 7) % 900 + 10 for j in range(prompt_len)] for s in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    core = llm.engine
    take = core.take_stats

    def counting():
        s = take()
        counts["drafts"] += s.spec_drafts
        counts["draft_tokens"] += s.spec_draft_tokens
        counts["accepted"] += s.spec_accepted_tokens
        return s

    core.take_stats = counting
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    core.take_stats = take
    return streams * tokens / elapsed, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-6layer")
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculative-config", default=NGRAM)
    args = ap.parse_args()
    from weir import LLM

    model = bench_model(args.model)
    common = dict(max_num_seqs=64, enable_prefix_caching=False)
    llms = {
        "off": LLM(model, **common),
        "on": LLM(model, speculative_config=args.speculative_config, **common),
    }
    for llm in llms.values():  # warm up (kernels built, first-use allocations)
        run(llm, 2, 8, args.prompt_len)
    results: dict = {}
    print(f"{machine()['cpu']}, {args.model}, {args.speculative_config}")
    for streams in map(int, args.streams.split(",")):
        rates: dict[str, list[float]] = {"off": [], "on": []}
        counts = None
        for r in range(args.rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                rate, c = run(llms[name], streams, args.tokens, args.prompt_len)
                rates[name].append(rate)
                if name == "on":
                    counts = c
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        results[streams] = {"off": rates["off"], "on": rates["on"], "ratio": on / off, **counts}
        kept = counts["accepted"] / max(counts["draft_tokens"], 1)
        print(
            f"  {streams} streams: off {off:.0f} tok/s, on {on:.0f} tok/s ({on / off:.2f}x); "
            f"last round {counts['drafts']} proposals, {counts['draft_tokens']} tokens, "
            f"{kept:.1%} kept"
        )
    save("spec_offline", {"meta": {**machine(), **vars(args)}, "results": results})


if __name__ == "__main__":
    main()
