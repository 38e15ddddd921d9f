"""`--api-server-count 1` against 2 on the one-layer model, where the HTTP process is the ceiling
(engine steps of well under a millisecond, as on a GPU): `python -m benchmarks.api_servers
[--levels 64,128,256] [--counts 1,2] [--rounds 2] [--max-tokens 128] [--model qwen3-1layer]`.

Each round starts a server of each count in turn (the order reversed every other round, so that
neither count always runs first on a machine whose speed drifts), and at each level runs 4c
streamed chat completions c at a time (greedy, ignore_eos, max_tokens tokens each, a warm-up
first), one server at a time. Reported per run: delivered output tok/s, TTFT and ITL p50, the
CPU of the HTTP processes (the supervisor's and API servers' together) and of the engine
process per output token, content events per token (below 1 where a stream's deltas merged
while its server was behind), and the share of requests each API server answered (from
X-Weir-Api-Server). Then, per level and round, the ratio of each count's tok/s to the first
count's, and the median ratio over the rounds. The load generator runs on the same machine: on
a 2-core box it takes a share of the cores the servers would use."""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys

import trio

from benchmarks.common import bench_model, machine, save
from benchmarks.loadgen import ServerProcess, free_port, prompts, run_level, summarize, weir_argv


def tree(pid: int) -> dict[int, str]:
    """Every process under `pid` (itself included), with its command line."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            found[p] = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def run_count(model: str, count: int, levels: list[int], max_tokens: int) -> dict:
    port = free_port()
    argv = weir_argv(model, port, "--num-kv-blocks", "16384", "--api-server-count", str(count))
    srv = ServerProcess(argv, port, f"/tmp/weir-api-servers-{count}.log")
    out = {}
    try:
        srv.wait_ready()
        procs = tree(srv.proc.pid)
        engine = [p for p, cmd in procs.items() if "core.engine_process" in cmd]
        http = [p for p in procs if p not in engine]  # the supervisor and the API servers
        trio.run(functools.partial(run_level, srv.url, model, prompts(16, seed=1), 16, 8))
        for level in levels:
            texts = prompts(4 * level, seed=level)
            http0, engine0 = cpu_seconds(http), cpu_seconds(engine)
            results, wall = trio.run(
                functools.partial(run_level, srv.url, model, texts, level, max_tokens)
            )
            s = summarize(results, wall)
            tokens = max(1, s["output_tokens"])
            s["http_cpu_us_per_token"] = (cpu_seconds(http) - http0) / tokens * 1e6
            s["engine_cpu_us_per_token"] = (cpu_seconds(engine) - engine0) / tokens * 1e6
            events = sum(len(r.itl) + 1 for r in results if r.ttft is not None)
            s["events_per_token"] = events / tokens
            served = collections.Counter(r.api_server or "-" for r in results)
            s["share_by_api_server"] = {k: v / len(results) for k, v in sorted(served.items())}
            out[level] = s
            print(
                f"  count {count} @{level}: {s['output_tok_s']:.0f} tok/s, TTFT p50 "
                f"{s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms, HTTP "
                f"{s['http_cpu_us_per_token']:.0f} µs CPU a token, engine "
                f"{s['engine_cpu_us_per_token']:.0f}, {s['events_per_token']:.2f} events a "
                f"token, shares {s['share_by_api_server']}, "
                f"errors {s['errors']}",
                flush=True,
            )
    finally:
        srv.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-1layer")
    ap.add_argument("--levels", default="64,128,256")
    ap.add_argument("--counts", default="1,2", help="the first is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = bench_model(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    counts = [int(x) for x in args.counts.split(",")]
    base, others = counts[0], counts[1:]
    result = {"meta": {**machine(), "model": args.model, "argv": sys.argv[1:]}, "rounds": []}
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]
        print(f"round {r + 1}: counts {order}", flush=True)
        runs = {count: run_count(model, count, levels, args.max_tokens) for count in order}
        ratios = {
            count: {
                level: runs[count][level]["output_tok_s"]
                / max(1e-9, runs[base][level]["output_tok_s"])
                for level in levels
            }
            for count in others
        }
        for count in others:
            for level, ratio in ratios[count].items():
                print(f"  round {r + 1} @{level}: {count} / {base} = {ratio:.2f}x", flush=True)
        result["rounds"].append({"order": order, "runs": runs, "ratio_over_first": ratios})
    result["median_ratio_over_first"] = {
        count: {
            level: statistics.median(r["ratio_over_first"][count][level] for r in result["rounds"])
            for level in levels
        }
        for count in others
    }
    for count, by_level in result["median_ratio_over_first"].items():
        for level, ratio in by_level.items():
            print(f"median @{level}: {count} API servers / {base} = {ratio:.2f}x", flush=True)
    save("api_servers", result)


if __name__ == "__main__":
    main()
