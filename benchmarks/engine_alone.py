"""The serving benchmark's load through weir's engine alone: no HTTP, no load generator, no pipe.

The same chat prompts (rendered with the model's chat template), the same greedy requests and
max_tokens, at most `concurrency` running at once (`max_num_seqs`), driven straight through
`EngineCore` with every core. What the engine could serve if the rest cost nothing: the ceiling
the served figures are read against (benchmarks/serving.py `--engine-alone`). Prints one JSON
line per level: {"concurrency", "output_tok_s", "output_tokens", "prompt_tokens", "wall_s"}.
With --breakdown, also where the wall time went: the steps with prompt tokens (prefill chunks,
with any decodes beside them) and the pure decode steps, and within those the compiled CPU
forward's ops, the rest of the runner's execute and the engine around it.

    python -m benchmarks.engine_alone --model llama-6layer --concurrency 64 --requests 128
    python -m benchmarks.engine_alone --concurrency 64 --breakdown
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import Counter

from benchmarks.common import bench_model
from benchmarks.loadgen import prompts
from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams


def run(
    model: str, concurrency: int, texts: list[str], max_tokens: int, breakdown: bool = False
) -> dict:
    from gpu.launch import load

    # The server's defaults (weir_argv: --max-num-seqs 256) with the load's concurrency as the cap.
    loaded = load(EngineConfig(model=model, max_num_seqs=concurrency, cpu_threads=0))
    core, tok = loaded.core, loaded.tokenizer
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for t in texts
    ]
    gc.collect()
    gc.freeze()  # as the server and its engine process do once loaded (core/engine_process.py)
    t0 = time.perf_counter()
    for i, x in enumerate(ids):
        core.add(EngineRequest(str(i), x, SamplingParams(temperature=0, max_tokens=max_tokens)))
    spent: Counter = Counter()
    if breakdown:
        _time_steps(core, spent)
    tokens = 0
    while core.has_work:
        t = time.perf_counter()
        outs = core.step()
        if breakdown:
            spent[spent.pop("kind", "idle") + " steps"] += time.perf_counter() - t
        tokens += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - t0
    extra = {"breakdown_s": {k: round(v, 4) for k, v in spent.items()}} if breakdown else {}
    return {
        **extra,
        "concurrency": concurrency,
        "output_tok_s": tokens / wall,
        "output_tokens": tokens,
        "prompt_tokens": sum(len(x) for x in ids),
        "wall_s": wall,
    }


def _time_steps(core, spent: Counter) -> None:
    """Wrap the runner's execute: each step's kind (prefill: any prompt tokens; decode: one new
    token per request), and in decode steps the compiled forward's ops (gpu/cpu/forward.py
    profile) and the rest of execute."""
    from gpu.cpu import forward as cpu_forward

    execute = core.runner.execute

    def timed(out, *args, **kwargs):
        decode = out.num_tokens == len(out.scheduled)
        spent["kind"] = "decode" if decode else "prefill"
        if decode:
            spent["decode step count"] += 1
            cpu_forward.profile(True)
        t = time.perf_counter()
        result = execute(out, *args, **kwargs)
        if decode:
            spent["decode: runner execute"] += time.perf_counter() - t
            for op, seconds in cpu_forward.profile(False).items():
                spent[f"decode: forward {op}"] += seconds
        return result

    core.runner.execute = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-6layer")
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--requests", type=int, default=32, help="per level (at least 2x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--breakdown", action="store_true", help="where the wall time went")
    args = ap.parse_args()
    model = bench_model(args.model)
    for c in (int(x) for x in args.concurrency.split(",")):
        n = max(args.requests, 2 * c)
        result = run(model, c, prompts(n, seed=c), args.max_tokens, args.breakdown)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from gpu import openmp

    openmp.prepare(EngineConfig())  # as an engine process does, before torch is imported
    main()
