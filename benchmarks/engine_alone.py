"""The serving benchmark's load through weir's engine alone: no HTTP, no load generator, no pipe.

The same chat prompts (rendered with the model's chat template), the same greedy requests and
max_tokens, at most `concurrency` running at once (`max_num_seqs`), driven straight through
`EngineCore` with every core. What the engine could serve if the rest cost nothing: the ceiling
the served figures are read against (benchmarks/serving.py `--engine-alone`). Prints one JSON
line per level: {"concurrency", "output_tok_s", "output_tokens", "prompt_tokens", "wall_s"}.

    python -m benchmarks.engine_alone --model llama-6layer --concurrency 64 --requests 128
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.common import bench_model
from benchmarks.loadgen import prompts
from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams


def run(model: str, concurrency: int, texts: list[str], max_tokens: int) -> dict:
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
    t0 = time.perf_counter()
    for i, x in enumerate(ids):
        core.add(EngineRequest(str(i), x, SamplingParams(temperature=0, max_tokens=max_tokens)))
    tokens = 0
    while core.has_work:
        tokens += sum(len(o.new_token_ids) for o in core.step())
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "output_tok_s": tokens / wall,
        "output_tokens": tokens,
        "prompt_tokens": sum(len(x) for x in ids),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-6layer")
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--requests", type=int, default=32, help="per level (at least 2x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = bench_model(args.model)
    for c in (int(x) for x in args.concurrency.split(",")):
        n = max(args.requests, 2 * c)
        print(json.dumps(run(model, c, prompts(n, seed=c), args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
