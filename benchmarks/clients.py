"""The streaming load generator (benchmarks/loadgen.py run_level) spread over several client
processes, and the client's own CPU time, so that a served rate is not the client's ceiling.

One client process parses every SSE event of every stream it holds: at a few hundred streams and
tens of thousands of tokens a second it can saturate its core before the server does (the H200's
serving run of 2026-11-27 delivered 0.41x of the engine alone at 256 streams with one client).
With `clients` > 1, each process holds its share of the streams (the concurrency split as evenly
as it divides) and of the requests, and all start together once every one has imported; the
level's results are the union of theirs, its wall time from that start to the last one's end.

    results, wall, client_cpu = run_clients(url, model, texts, concurrency, max_tokens, clients=4)
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time

import trio

from benchmarks.loadgen import Result, run_level


def default_clients() -> int:
    """One client process per 4 cores, at most 4 (1 on a small machine, where the client's
    processes would take the cores the server being measured needs)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _client(args: tuple, go, out) -> None:
    """In a client process: wait for the start, run its share, send back (results, CPU s)."""
    url, model, texts, concurrency, max_tokens, extra = args
    out.put(("ready", None))
    go.wait()
    cpu0 = time.process_time()
    results, _ = trio.run(
        functools.partial(run_level, url, model, texts, concurrency, max_tokens, extra)
    )
    out.put((results, time.process_time() - cpu0))


def run_clients(
    url: str,
    model: str,
    texts: list[str],
    concurrency: int,
    max_tokens: int,
    extra: dict | None = None,
    clients: int = 1,
) -> tuple[list[Result], float, float]:
    """(every request's result, the level's wall seconds, the clients' CPU seconds together)."""
    clients = max(1, min(clients, concurrency, len(texts)))
    if clients == 1:
        cpu0 = time.process_time()
        results, wall = trio.run(
            functools.partial(run_level, url, model, texts, concurrency, max_tokens, extra)
        )
        return results, wall, time.process_time() - cpu0
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    shares = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    procs = [
        ctx.Process(
            target=_client,
            args=((url, model, texts[i::clients], shares[i], max_tokens, extra), go, out),
            daemon=True,
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, _ = out.get(timeout=120)
            assert kind == "ready"
        t0 = time.perf_counter()
        go.set()
        results: list[Result] = []
        cpu = 0.0
        for _ in procs:  # drained before the joins: a child exits once its results are read
            got, seconds = out.get(timeout=1800)
            results += got
            cpu += seconds
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results, wall, cpu
