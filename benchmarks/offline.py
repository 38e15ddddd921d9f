"""Offline throughput: weir's engine vs transformers `generate` on the same model and prompts.

The nano-vllm protocol scaled to the machine: N requests with input and output lengths uniform in
a range, random token prompts, `ignore_eos`, fixed seed. transformers runs static left-padded
batches (each batch generates until its longest request; only requested tokens count) at several
batch sizes, and the best is reported. Also reports weir's engine overhead per step: step time
minus model forward time, at the largest batch.

    python -m benchmarks.offline [--model qwen3-100m] [--requests 64]
    python -m benchmarks.offline --model qwen3-0.6b --requests 256 --input-len 100,1024 \
        --output-len 100,1024 --hf-batch-sizes 32,64,128,256      # the GPU protocol
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import time

import torch

from benchmarks.common import bench_model, machine, save
from benchmarks.hf_generate import run_transformers
from gpu.assemble import resident_weights


def workload(
    n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int = 0
):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write), measured now: the practical
    memory bandwidth a decode step is bounded by."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t)


def run_weir(
    model: str,
    prompts,
    outputs,
    max_num_seqs: int,
    device: str,
    dtype: str,
    enforce_eager: bool = False,
    profile: str | None = None,
    async_scheduling: bool | None = None,
) -> dict:
    """`profile`: a file to write a cProfile of the measured run to (steps only, no start-up);
    its slowest functions are printed, and its tok/s is the profiler's, not weir's."""
    from core.sampling import SamplingParams
    from weir import LLM

    llm = LLM(
        model,
        dtype=dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    core = llm.engine
    runner = core.runner
    forward_times: list = []  # seconds, or (start, end) CUDA events read after the run

    def timed(fn):
        # On a GPU, events around the forward: a host sync here would stop the next step's
        # host work from overlapping this one (asynchronous scheduling).
        def wrapper(*a, **kw):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                out = fn(*a, **kw)
                end.record()
                forward_times.append((start, end))
                return out
            t = time.perf_counter()
            out = fn(*a, **kw)
            forward_times.append(time.perf_counter() - t)
            return out

        return wrapper

    # The forward pass, eager or replayed as a CUDA graph (captured at load, before this wrap).
    runner.model.forward = timed(runner.model.forward)
    if runner.graphs is not None:
        runner.graphs.run = timed(runner.graphs.run)
    # Warm up (allocator, kernels) on a couple of requests, then the measured run.
    llm.generate(
        prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    forward_times.clear()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    step_times: list[tuple[int, float, int]] = []  # (running, seconds, context tokens read)
    real_step = core.step

    def timed_step():
        t = time.perf_counter()
        before = len(forward_times)
        context = sum(r.num_computed_tokens + 1 for r in core.scheduler.running)
        out = real_step()
        if len(forward_times) > before:
            step_times.append((len(core.scheduler.running), time.perf_counter() - t, context))
        return out

    core.step = timed_step
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    results = llm.generate(prompts, params, use_tqdm=False)
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
        forward_times[:] = [s.elapsed_time(e) / 1e3 for s, e in forward_times]
    if profiler is not None:
        print_profile(profiler, profile)
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outputs)
    # Overhead at the largest batch: decode steps with the most running requests.
    biggest = max(b for b, _, _ in step_times)
    rows = [(st, ft, c) for (b, st, c), ft in zip(step_times, forward_times) if b == biggest]
    overhead = statistics.median(st - ft for st, ft, _ in rows)
    result = {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "tok_s": generated / elapsed,
        "largest_batch": biggest,
        "steps": len(step_times),
        "overhead_per_step_ms": overhead * 1e3,
        "forward_per_step_ms": statistics.median(ft for _, ft, _ in rows) * 1e3,
        "cuda_graphs": runner.graphs is not None,
        "async_scheduling": core.async_scheduling,
    }
    bandwidth = copy_bandwidth(device)
    if bandwidth:
        # Decode step bound: every weight byte plus every cached K/V byte read once.
        spec = runner.model.spec
        elt = torch.finfo(getattr(torch, dtype)).bits // 8
        # the weights as the backend holds them (fused products are not module parameters)
        weight_bytes = sum(resident_weights(runner.model).values())
        kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elt
        context = statistics.median(c for _, _, c in rows)
        bound_s = (weight_bytes + context * kv_per_token) / bandwidth
        result.update(
            bandwidth_gb_s=bandwidth / 1e9,
            weight_bytes=weight_bytes,
            median_context_tokens=context,
            bound_per_step_ms=bound_s * 1e3,
        )
    return result


def report(weir: dict) -> None:
    mode = "CUDA graphs" if weir["cuda_graphs"] else "eager"
    mode += ", async scheduling" if weir.get("async_scheduling") else ", synchronous"
    print(
        f"  weir ({mode}): {weir['tok_s']:.0f} tok/s; overhead "
        f"{weir['overhead_per_step_ms']:.2f} ms per step at batch {weir['largest_batch']} "
        f"(forward {weir['forward_per_step_ms']:.1f} ms)"
    )
    if "bound_per_step_ms" in weir:
        print(
            f"  decode step {weir['forward_per_step_ms']:.2f} ms vs bandwidth bound "
            f"{weir['bound_per_step_ms']:.2f} ms ({weir['bandwidth_gb_s']:.0f} GB/s copy)"
        )


def print_profile(profiler: cProfile.Profile, path: str, top: int = 35) -> None:
    """Save the run's profile and print where its host time went, by own time and cumulative."""
    profiler.dump_stats(path)
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def compare_async(args, model, prompts, outputs, n, device, dtype, first: dict) -> dict | None:
    """--compare-async: weir with asynchronous scheduling off, alternated with it on (`first`
    is the first run with it on) --repeats times; medians reported, `first` updated."""
    if not args.compare_async:
        return None
    runs: dict[bool, list[dict]] = {True: [first], False: []}
    for i in range(args.repeats):
        runs[False].append(
            run_weir(model, prompts, outputs, n, device, dtype, args.enforce_eager, None, False)
        )
        release()
        report(runs[False][-1])
        if i + 1 < args.repeats:
            again = run_weir(
                model, prompts, outputs, n, device, dtype, args.enforce_eager, None, True
            )
            runs[True].append(again)
            release()
            report(runs[True][-1])
    median = {
        k: dict(
            sorted(v, key=lambda r: r["tok_s"])[len(v) // 2], tok_s_runs=[r["tok_s"] for r in v]
        )
        for k, v in runs.items()
    }
    first.clear()
    first.update(median[True])
    print(
        f"async / sync scheduling (medians of {args.repeats}): "
        f"{median[True]['tok_s'] / median[False]['tok_s']:.2f}x"
    )
    return median[False]


def release() -> None:
    """Free a finished engine's device memory (its KV cache, CUDA graph pools): the next engine
    in this process sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def meta(args, n: int, dtype: str) -> dict:
    return {
        **machine(),
        "model": args.model,
        "requests": n,
        "dtype": dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="qwen3-100m",
        help="a benchmark shape (qwen3-100m, qwen3-3layer) or a model directory",
    )
    ap.add_argument("--requests", type=int, default=None, help="default: 256 on GPU, 64 on CPU")
    ap.add_argument("--input-len", default="32,256")
    ap.add_argument("--output-len", default="32,128")
    ap.add_argument(
        "--hf-batch-sizes", default="8,16,32,64", help="transformers' batch sizes; none: skip it"
    )
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--enforce-eager", action="store_true", help="weir without CUDA graphs")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of weir and of transformers at its best batch size (medians reported)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="profile weir's measured run (cProfile, steps only) into FILE and print its top",
    )
    ap.add_argument(
        "--compare-async",
        action="store_true",
        help="also run weir with asynchronous scheduling off (on: its default on CUDA) and "
        "report both, alternated with --repeats",
    )
    ap.add_argument(
        "--warm-runs",
        type=int,
        default=0,
        help="untimed runs of the whole workload first (Triton compiles each kernel variant "
        "the first time a step needs it)",
    )
    ap.add_argument(
        "--compare-eager",
        action="store_true",
        help="on CUDA, also run weir with --enforce-eager and report both",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    n = args.requests or (256 if device == "cuda" else 64)
    model = bench_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, outputs = workload(
        n,
        tuple(map(int, args.input_len.split(","))),
        tuple(map(int, args.output_len.split(","))),
        vocab,
    )
    print(f"{n} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens")
    for _ in range(args.warm_runs):
        run_weir(model, prompts, outputs, n, device, dtype, args.enforce_eager)
        release()
    on = True if args.compare_async else None  # compared: on (even on a CPU) against off
    weir = run_weir(model, prompts, outputs, n, device, dtype, args.enforce_eager, args.profile, on)
    release()
    report(weir)
    sync = compare_async(args, model, prompts, outputs, n, device, dtype, weir)
    eager = None
    if args.compare_eager and device == "cuda" and not args.enforce_eager:
        eager = run_weir(model, prompts, outputs, n, device, dtype, enforce_eager=True)
        release()
        report(eager)
    hf_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b not in ("", "none")]
    if not hf_sizes:  # weir alone (on a GPU, beside the published anchors)
        save(
            "offline",
            {"meta": meta(args, n, dtype), "weir": weir, "weir_sync": sync, "weir_eager": eager},
        )
        return
    hf = run_transformers(
        model,
        prompts,
        outputs,
        [b for b in hf_sizes if b <= n],
        device,
        dtype,
    )
    # This machine is noisy: repeat weir and transformers at its best batch, interleaved, and
    # compare medians (the first pass counts as one repeat).
    weir_runs, hf_runs = [weir["tok_s"]], [hf["tok_s"]]
    for _ in range(args.repeats - 1):
        weir_runs.append(
            run_weir(model, prompts, outputs, n, device, dtype, args.enforce_eager)["tok_s"]
        )
        release()
        best = run_transformers(model, prompts, outputs, [hf["best_batch"]], device, dtype)
        hf_runs.append(best["tok_s"])
    weir["tok_s_runs"], hf["tok_s_runs"] = weir_runs, hf_runs
    weir["tok_s"], hf["tok_s"] = statistics.median(weir_runs), statistics.median(hf_runs)
    ratio = weir["tok_s"] / hf["tok_s"]
    print(
        f"weir / transformers (best batch {hf['best_batch']}, medians of {args.repeats}): "
        f"{ratio:.2f}x"
    )
    save(
        "offline",
        {
            "meta": meta(args, n, dtype),
            "weir": weir,
            "weir_eager": eager,
            "transformers": hf,
            "ratio": ratio,
        },
    )


if __name__ == "__main__":
    main()
