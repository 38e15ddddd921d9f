"""Engine step time: the prefill phase and the decode steps of a batch, per tensor-parallel size.

For each batch size, B requests of the same prompt length are added at once to an engine core
(loaded as the server loads it); the prefill phase (every request's first token) and each
following decode step are timed. The sizes run in alternated rounds in one process, and the
medians are compared with the first size (TP=1 by default), the baseline of the same run.

    python -m benchmarks.step_time --tp 1,2                    # CPU, gloo: 6-layer Llama
    python -m benchmarks.step_time --tp 1 --batch 1 --prompt-len 3500   # one long stream
    python -m benchmarks.step_time --tp 1 --batch 1,64 --breakdown      # where a step goes
    python -m benchmarks.step_time --batch 64 --kv-cache-dtype auto,bfloat16 --breakdown
    python -m benchmarks.step_time --batch 8 --prompt-len 3500 --kv-cache-dtype auto,fp8,fp8_e5m2
    python -m benchmarks.step_time --device cuda --model qwen3-0.6b --tp 1,2,4 \\
        --batch 1,16,64,256 --prompt-len 512                    # a multi-GPU machine, NCCL
    python -m benchmarks.step_time --model FILE.gguf --cpu-forward auto,modules  # the stack

On a CPU the ranks share the machine's cores (each gets cores / N torch threads) and add two
all-reduces per layer and a logits all-gather: expect TP=N to be slower than TP=1 there. It is
for models larger than one device's memory; on GPUs it also adds memory bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import bench_model, machine, save
from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams


def run_once(
    core, batch: int, prompt_len: int, steps: int, seed: int, breakdown: dict | None = None
) -> tuple[float, float]:
    """(prefill seconds, median decode step seconds) for one batch; with `breakdown`, the
    compiled CPU forward's seconds per op kind over the decode steps are added into it."""
    vocab = core.runner.vocab_size
    for i in range(batch):
        ids = [(seed * 7919 + i * 131 + j * 17) % (vocab - 1) + 1 for j in range(prompt_len)]
        p = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        core.add(EngineRequest(f"r{seed}-{i}", ids, p))
    t0 = time.perf_counter()
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in core.step() if o.new_token_ids}
    prefill = time.perf_counter() - t0
    times = []
    if breakdown is not None:
        from gpu.cpu import forward as cpu_forward

        cpu_forward.profile(True)
    while core.has_work:
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    if breakdown is not None:
        breakdown["steps"] = breakdown.get("steps", 0) + len(times)
        breakdown["step"] = breakdown.get("step", 0.0) + sum(times)
        for op, seconds in cpu_forward.profile(False).items():
            breakdown[op] = breakdown.get(op, 0.0) + seconds
    return prefill, statistics.median(times) if times else 0.0


def _collective(rank: int, world: int, init: str, rows: int, hidden: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = torch.randn(rows, hidden)
    for _ in range(20):
        dist.all_reduce(x)
    t = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t) / 200)
    dist.destroy_process_group()


def all_reduce_seconds(world: int, rows: int, hidden: int) -> float:
    """One gloo all-reduce of a [rows, hidden] float32 activation among `world` processes on
    this machine: what each decoder layer pays twice per step on CPU."""
    import torch.multiprocessing as mp

    from gpu.dist.node import local_init_method

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = local_init_method()
    procs = [
        ctx.Process(target=_collective, args=(r, world, init, rows, hidden, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    seconds = out.get(timeout=120)
    for p in procs:
        p.join()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-6layer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes, the first the baseline")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtypes (auto,bfloat16,...), each with every TP size; the first the baseline",
    )
    ap.add_argument(
        "--cpu-forward",
        default="auto",
        help="CPU: auto (the one-call stack where it runs the model), modules; the first the "
        "baseline",
    )
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="CPU: where a decode step goes, per op kind of the compiled forward (TP=1)",
    )
    args = ap.parse_args()

    from gpu.launch import load

    sizes = [int(x) for x in args.tp.split(",")]
    kv_dtypes = args.kv_cache_dtype.split(",")
    forwards = args.cpu_forward.split(",")
    variants = [(tp, kv, fwd) for fwd in forwards for kv in kv_dtypes for tp in sizes]
    batches = [int(x) for x in args.batch.split(",")]
    model = bench_model(args.model)
    results: dict[tuple, dict[int, list[tuple[float, float]]]] = {
        v: {b: [] for b in batches} for v in variants
    }
    breakdowns: dict[tuple, dict] = {(v, b): {} for v in variants for b in batches}
    for r in range(args.rounds):
        for tp, kv, fwd in variants if r % 2 == 0 else reversed(variants):
            config = EngineConfig(
                model=model,
                device=args.device,
                dtype=args.dtype,
                kv_cache_dtype=kv,
                tensor_parallel_size=tp,
                cpu_threads=0,
                max_num_seqs=max(batches),
                enable_prefix_caching=False,
                cpu_forward=fwd,
            )
            core = load(config).core
            try:
                run_once(core, 2, 16, 2, seed=-1)  # warm-up
                for b in batches:
                    into = breakdowns[(tp, kv, fwd), b] if args.breakdown and tp == 1 else None
                    results[tp, kv, fwd][b].append(
                        run_once(core, b, args.prompt_len, args.steps, r, into)
                    )
            finally:
                core.close()

    base = variants[0]
    rows = []
    collectives = {}
    if args.device == "cpu" and len(sizes) > 1:  # (a GGUF file as --model: TP=1 alone)
        import json

        hidden = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
        for tp in sizes[1:]:
            collectives[tp] = {b: all_reduce_seconds(tp, b, hidden) for b in batches}
    print(f"\n{args.model} on {args.device}, prompt {args.prompt_len}, medians of {args.rounds}")
    print("| TP | KV cache | forward | batch | prefill ms | decode step ms | decode vs the first |")
    print("|---|---|---|---|---|---|---|")
    for tp, kv, fwd in variants:
        for b in batches:
            runs = results[tp, kv, fwd][b]
            prefill = statistics.median(x[0] for x in runs) * 1e3
            decode = statistics.median(x[1] for x in runs) * 1e3
            ref = statistics.median(x[1] for x in results[base][b]) * 1e3
            rows.append(
                dict(tp=tp, kv_cache=kv, forward=fwd, batch=b, prefill_ms=prefill,
                     decode_ms=decode, decode_ms_rounds=[x[1] * 1e3 for x in runs])
            )  # fmt: skip
            print(
                f"| {tp} | {kv} | {fwd} | {b} | {prefill:.1f} | {decode:.2f} | "
                f"{decode / ref:.2f}x |"
            )
    for tp, by_batch in collectives.items():
        for b, sec in by_batch.items():
            print(f"gloo all-reduce of [{b}, hidden] among {tp} processes: {sec * 1e6:.0f} us")
    per_step = {}
    if args.breakdown:
        print("\nDecode step breakdown (TP=1), ms a step: the compiled forward's ops, and the rest")
        for ((tp, kv, fwd), b), d in breakdowns.items():
            n = d.pop("steps", 0)
            if not n:
                continue
            step = d.pop("step")
            key = f"{b}" + (f" kv={kv}" if len(kv_dtypes) > 1 else "")
            key += f" {fwd}" if len(forwards) > 1 else ""
            per_step[key] = {op: sec / n * 1e3 for op, sec in d.items()}
            per_step[key]["rest of the step"] = (step - sum(d.values())) / n * 1e3
            parts = ", ".join(f"{op} {ms:.2f}" for op, ms in per_step[key].items())
            print(f"batch {key}: step {step / n * 1e3:.2f} = {parts}")
    save(
        "step_time",
        {
            "machine": machine(),
            "args": vars(args),
            "rows": rows,
            "all_reduce_s": collectives,
            "breakdown_ms": per_step,
        },
    )


if __name__ == "__main__":
    from gpu import openmp

    openmp.prepare(EngineConfig())  # as an engine process does, before torch is imported
    main()
