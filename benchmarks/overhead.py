"""Per-token overhead of the serving path, each beside its baseline in the same run:

(a) incremental detokenization with DecodeStream vs re-decoding the whole sequence each step,
    µs per token at lengths 100, 1k and 4k (256 sequences);
(b) SSE chunk encoding: msgspec Structs vs building a dict and `json.dumps`;
(c) 256 concurrent streams on a one-layer model: delivered tokens/s and server CPU per token,
    one token per SSE event vs weir's coalescing (a client that falls behind gets its pending
    deltas merged into one event: nothing dropped, nothing buffered without bound), and
    coalescing with `--stream-interval 8` (an event every 8 tokens, the first at once); each
    with the engine on a thread of the server process (`--no-engine-process`) and in its own
    process (the default).
    Server CPU is summed over the server's process tree (the engine process included). Beside
    them, the floor: the same Quart + Hypercorn stack streaming canned chunks with no engine.

    python -m benchmarks.overhead [--skip-streams]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time

from benchmarks.common import bench_model, machine, save


def detokenize(tokenizer, lengths=(100, 1000, 4000), sequences=256) -> dict:
    from core.detokenizer import Detokenizer

    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    out = {}
    for length in lengths:
        seqs = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(sequences)]
        # DecodeStream: every token of every sequence.
        t = time.perf_counter()
        for ids in seqs:
            d = Detokenizer(tokenizer, [])
            for tok in ids:
                d.step(tok)
        stream_us = (time.perf_counter() - t) / (length * sequences) * 1e6
        # Re-decoding: the cost of one step at this length (decode everything, take the new tail).
        sample = seqs[: max(8, sequences // (length // 100))]
        t = time.perf_counter()
        for ids in sample:
            prev = tokenizer.decode(ids[:-1])
            tokenizer.decode(ids)[len(prev) :]
        redecode_us = (time.perf_counter() - t) / len(sample) * 1e6
        out[length] = {
            "decodestream_us_per_token": stream_us,
            "redecode_us_per_token": redecode_us,
            "ratio": redecode_us / stream_us,
        }
        print(
            f"  detokenize @{length}: DecodeStream {stream_us:.2f} µs/token, "
            f"re-decode {redecode_us:.1f} µs/token ({redecode_us / stream_us:.0f}x)"
        )
    return out


def sse_encoding(n=200_000) -> dict:
    from server import sse
    from server.protocol import ChatCompletionChunk, ChunkChoice, Delta

    t = time.perf_counter()
    for i in range(n):
        sse.event(
            ChatCompletionChunk(
                id="chatcmpl-123",
                created=1700000000,
                model="m",
                choices=[ChunkChoice(index=0, delta=Delta(content=" tok"))],
            )
        )
    ms_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for i in range(n):
        payload = {
            "id": "chatcmpl-123",
            "created": 1700000000,
            "model": "m",
            "object": "chat.completion.chunk",
            "usage": None,
            "choices": [
                {"index": 0, "delta": {"content": " tok"}, "finish_reason": None, "logprobs": None}
            ],
        }
        b"data: " + json.dumps(payload).encode() + b"\n\n"
    js_us = (time.perf_counter() - t) / n * 1e6
    print(f"  SSE chunk: msgspec {ms_us:.2f} µs, json {js_us:.2f} µs ({js_us / ms_us:.1f}x)")
    return {"msgspec_us": ms_us, "json_us": js_us, "ratio": js_us / ms_us}


def streams(model: str, concurrency=256, max_tokens=128) -> dict:
    import trio

    from benchmarks.loadgen import (
        ServerProcess,
        free_port,
        prompts,
        run_level,
        summarize,
        weir_argv,
    )

    out = {}
    for label, launcher, extra in (
        ("one_per_event_thread", "benchmarks.serve_one_per_event", ("--no-engine-process",)),
        ("coalesced_thread", "server", ("--no-engine-process",)),
        (
            "coalesced_thread_stream_interval_8",
            "server",
            ("--no-engine-process", "--stream-interval", "8"),
        ),
        ("one_per_event_engine_process", "benchmarks.serve_one_per_event", ("--engine-process",)),
        ("coalesced_engine_process", "server", ("--engine-process",)),
        (
            "coalesced_engine_process_stream_interval_8",
            "server",
            ("--engine-process", "--stream-interval", "8"),
        ),
        # The floor: Quart + Hypercorn streaming canned chunks, no engine (benchmarks/bare_sse.py).
        ("http_stack_alone", "benchmarks.bare_sse", ()),
    ):
        port = free_port()
        argv = (
            [sys.executable, "-m", launcher, str(port)]
            if launcher == "benchmarks.bare_sse"
            else weir_argv(model, port, "--num-kv-blocks", "16384", *extra, launcher=launcher)
        )
        srv = ServerProcess(argv, port, f"/tmp/weir-{label}.log")
        try:
            srv.wait_ready()
            # Warm-up, then the measured run.
            trio.run(functools.partial(run_level, srv.url, model, prompts(16, seed=1), 16, 8))
            cpu0, http0 = srv.cpu_seconds(), srv.cpu_seconds(tree=False)
            results, wall = trio.run(
                functools.partial(
                    run_level, srv.url, model, prompts(concurrency, seed=2), concurrency, max_tokens
                )
            )
            cpu = srv.cpu_seconds() - cpu0
            http_cpu = srv.cpu_seconds(tree=False) - http0
        finally:
            srv.stop()
        s = summarize(results, wall)
        s["server_cpu_s"] = cpu
        s["server_cpu_us_per_token"] = cpu / max(1, s["output_tokens"]) * 1e6
        if "engine_process" in label:  # the split: HTTP process vs engine process
            s["http_cpu_us_per_token"] = http_cpu / max(1, s["output_tokens"]) * 1e6
            s["engine_cpu_us_per_token"] = s["server_cpu_us_per_token"] - s["http_cpu_us_per_token"]
        s["events"] = sum(len(r.itl) + 1 for r in results if r.ttft is not None)
        out[label] = s
        print(
            f"  {label}: {s['output_tok_s']:.0f} tok/s delivered, "
            f"{s['server_cpu_us_per_token']:.1f} µs server CPU per token, "
            f"{s['events']} content events, errors {s['errors']}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-1layer")
    ap.add_argument("--skip-streams", action="store_true")
    args = ap.parse_args()
    model = bench_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model).backend_tokenizer
    result = {"meta": {**machine(), "model": args.model}}
    print("(a) detokenization")
    result["detokenize"] = detokenize(tokenizer)
    print("(b) SSE encoding")
    result["sse"] = sse_encoding()
    if not args.skip_streams:
        print("(c) 256 concurrent streams")
        result["streams"] = streams(model)
    save("overhead", result)


if __name__ == "__main__":
    main()
