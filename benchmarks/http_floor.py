"""What the HTTP stack alone costs per SSE event at the serving benchmark's 64-stream load:
`python -m benchmarks.http_floor [--ticks 0,15] [--rounds 2]`.

Runs benchmarks/bare_sse.py (Quart + Hypercorn, canned chunks, no engine) under the serving
load's shape (128 streamed requests of 128 tokens, 64 at a time), free-running (tick 0: as fast
as the loop goes) and with every stream's next event released together every TICK ms, as the
engine's steps release them (a 64-row decode step takes about 15 ms on a 2-core box), rounds
alternated, and prints the server's CPU per event and the cores it took. weir's own HTTP process
on the same load is in benchmarks.serving's output (HTTP process µs CPU a token); the difference
is what weir adds per event.
"""

from __future__ import annotations

import argparse
import functools
import sys

import trio

from benchmarks.loadgen import ServerProcess, free_port, prompts, run_level, summarize


def one(tick_ms: float, concurrency: int, requests: int, max_tokens: int) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.bare_sse", str(port)]
    if tick_ms:
        argv.append(str(tick_ms))
    srv = ServerProcess(argv, port, f"/tmp/weir-bare-sse-{tick_ms}.log")
    try:
        srv.wait_ready()
        trio.run(functools.partial(run_level, srv.url, "bare", prompts(16, seed=1), 16, 8))
        cpu0 = srv.cpu_seconds()
        results, wall = trio.run(
            functools.partial(
                run_level, srv.url, "bare", prompts(requests, seed=2), concurrency, max_tokens
            )
        )
        cpu = srv.cpu_seconds() - cpu0
    finally:
        srv.stop()
    s = summarize(results, wall)
    events = sum(len(r.itl) + 1 for r in results if r.ttft is not None)
    return {
        "us_per_event": cpu / max(1, events) * 1e6,
        "cores": cpu / wall if wall else 0.0,
        "events": events,
        "errors": s["errors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", default="0,15", help="ms between released events; 0 free-running")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    ticks = [float(t) for t in args.ticks.split(",")]
    for r in range(args.rounds):
        for tick in ticks if r % 2 == 0 else ticks[::-1]:
            s = one(tick, args.concurrency, 2 * args.concurrency, args.max_tokens)
            print(
                f"round {r + 1} tick {tick:g} ms: {s['us_per_event']:.1f} µs CPU an event, "
                f"{s['cores']:.2f} cores, {s['events']} events, errors {s['errors']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
