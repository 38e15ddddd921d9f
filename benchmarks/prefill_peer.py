"""A long prompt's prefill through a running OpenAI-compatible server (weir, llama-server, vLLM):
one warm-up, then `reps` completions of `words` random words and `max_tokens` 1, one at a time,
each prompt starting with a different number so that no prompt or prefix cache helps. Prints the
prompt's tokens (the server's count), the median wall time and prompt tokens a second, as JSON.

Start one server, run this, stop it, start the next (never two at once):

    python -m benchmarks.prefill_peer 8000 MODEL --words 700 --reps 4 --name weir
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

WORDS = (
    "the river flows over stone and server streams tokens to every client while cache holds "
    "blocks of keys model request data"
).split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("model", help="the model name the server answers to")
    ap.add_argument("--words", type=int, default=700)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--name", default="server")
    args = ap.parse_args()
    rng = random.Random(args.name)
    client = httpx.Client(timeout=600)

    def one(seed: float) -> tuple[float, int]:
        pick = random.Random(seed)
        prompt = f"{seed} " + " ".join(pick.choice(WORDS) for _ in range(args.words))
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        reply = client.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body)
        took = time.perf_counter() - start
        reply.raise_for_status()
        return took, reply.json()["usage"]["prompt_tokens"]

    one(rng.random())
    runs = [one(rng.random()) for _ in range(args.reps)]
    median = statistics.median(t for t, _ in runs)
    tokens = statistics.median(n for _, n in runs)
    print(
        json.dumps(
            {
                "server": args.name,
                "prompt_tokens": tokens,
                "median_s": round(median, 3),
                "prompt_tok_s": round(tokens / median, 1),
                "all_s": [round(t, 3) for t, _ in runs],
            }
        )
    )


if __name__ == "__main__":
    main()
