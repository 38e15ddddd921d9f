"""Decode attention on the GPU: weir's Triton paged kernel vs torch SDPA, as memory bandwidth.

Decode attention reads every cached K and V row once per step, so its speed limit is the GPU's
memory bandwidth. For batch 1, 32, 256 and contexts of 1k, 4k, 16k tokens this reports the bytes
each kernel must read (K and V of every sequence, plus queries and outputs) over its measured time,
as a fraction of the bandwidth a large device-to-device copy reaches on the same GPU in the same
run. The baseline is torch's scaled_dot_product_attention over the same K/V laid out densely
(gathered beforehand, not timed): what attention costs without paging. The Triton kernel is timed
twice: call by call (the host's launch cost included, which dominates at small batches) and
replayed from a CUDA graph, as a decode step runs it. Inputs under the GPU's L2 (batch 1 at 1k
and 4k) are read from the cache on repeats.

    python -m benchmarks.attention [--heads 32 --kv-heads 8 --head-dim 128 --block-size 16]

Needs CUDA; exits with a message otherwise. Writes benchmarks/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Published peak HBM bandwidth, for reference beside the measured copy bandwidth.
SPEC_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "A800": 2.0e12,
    "L40S": 0.864e12,
}


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_time(fn, iters: int = 20, replays: int = 5) -> float:
    """Median seconds per call with `iters` calls captured in one CUDA graph and replayed: the
    kernels' own time, without the host's launch cost (a decode step runs as a graph). NaN when
    the call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compile and warm up outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(times)
    except RuntimeError as e:  # torch.AcceleratorError is one
        print(f"  graph timing failed: {type(e).__name__}: {e}")
        return float("nan")


def copy_bandwidth(device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 31, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters=10)
    return 2 * (1 << 32) / t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    ap.add_argument(
        "--split-sweep",
        default="",
        help="also time the decode kernel in a graph at each of these KV split counts "
        "(e.g. 1,2,4,8,16,32) against the count weir chooses",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.attention needs a CUDA GPU; none found.", file=sys.stderr)
        return 2

    from gpu.attention.backend import AttentionMetadata
    from gpu.cuda.attention import TritonAttention

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    spec = next((v for k, v in SPEC_BANDWIDTH.items() if k in name), None)
    measured = copy_bandwidth(device)
    dtype = torch.bfloat16
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    elem = torch.tensor([], dtype=dtype).element_size()
    backend = TritonAttention()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            blocks_per_seq = -(-ctx // bs)
            num_blocks = batch * blocks_per_seq
            try:
                k_cache = torch.randn((num_blocks, bs, hkv, d), dtype=dtype, device=device)
                v_cache = torch.randn_like(k_cache)
            except torch.OutOfMemoryError:
                print(f"skip batch {batch} ctx {ctx}: out of memory")
                continue
            perm = torch.randperm(num_blocks, device=device).int()
            tables = perm.view(batch, blocks_per_seq)
            meta = AttentionMetadata.build(
                [0] * batch,
                tables.tolist(),
                [1] * batch,
                [ctx] * batch,
                lambda data, dt: torch.tensor(data, dtype=dt, device=device),
            )
            q = torch.randn((batch, h, d), dtype=dtype, device=device)
            scale = d**-0.5
            triton_s = cuda_time(lambda: backend.forward(q, k_cache, v_cache, meta, scale))
            triton_graph_s = graph_time(lambda: backend.forward(q, k_cache, v_cache, meta, scale))
            sweep = split_sweep(args.split_sweep, q, k_cache, v_cache, meta, ctx, scale)

            # Dense layout for SDPA: [batch, kv_heads, ctx, d], gathered once outside the timing.
            k_dense = k_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            v_dense = v_cache[tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            q4 = q.unsqueeze(2)
            try:
                sdpa_s = cuda_time(
                    lambda: F.scaled_dot_product_attention(
                        q4, k_dense, v_dense, scale=scale, enable_gqa=True
                    )
                )
            except torch.OutOfMemoryError:  # a math fallback that expands K/V per query head
                sdpa_s = float("nan")
            # The float32 reference on a few sequences (the math kernel expands K/V to every
            # query head: at batch 256 x 16k that alone would be 64 GiB).
            few = min(batch, 4)
            want = F.scaled_dot_product_attention(
                q4[:few].float(),
                k_dense[:few].float(),
                v_dense[:few].float(),
                scale=scale,
                enable_gqa=True,
            ).squeeze(2)
            got = backend.forward(q, k_cache, v_cache, meta, scale)[:few].float()
            max_err = (got - want).abs().max().item()
            k_dense = v_dense = want = got = None  # free before the next shape

            nbytes = 2 * batch * ctx * hkv * d * elem + 2 * batch * h * d * elem
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "bytes": nbytes,
                    "triton_us": triton_s * 1e6,
                    "triton_graph_us": triton_graph_s * 1e6,
                    "triton_graph_frac_of_copy_bw": nbytes / triton_graph_s / measured,
                    "sdpa_us": sdpa_s * 1e6,
                    "triton_frac_of_copy_bw": nbytes / triton_s / measured,
                    "sdpa_frac_of_copy_bw": nbytes / sdpa_s / measured,
                    "triton_frac_of_spec_bw": nbytes / triton_s / spec if spec else None,
                    "max_abs_err_vs_fp32": max_err,
                    "split_sweep_graph_us": sweep,
                }
            )
            k_cache = v_cache = None
            torch.cuda.empty_cache()

    meta_info = {
        "device": name,
        "date": time.strftime("%Y-%m-%d"),
        "dtype": "bfloat16",
        "heads": h,
        "kv_heads": hkv,
        "head_dim": d,
        "block_size": bs,
        "copy_bandwidth_Bps": measured,
        "spec_bandwidth_Bps": spec,
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta_info, "rows": rows}, indent=2))
    print(
        f"{name}: copy bandwidth {measured / 1e12:.2f} TB/s"
        + (f", spec {spec / 1e12:.2f} TB/s" if spec else "")
    )
    print(
        "| batch | context | triton µs | triton % of copy BW | triton in a graph µs | % of copy "
        "BW | SDPA µs | SDPA % of copy BW | max err |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['context']} | {r['triton_us']:.1f} | "
            f"{100 * r['triton_frac_of_copy_bw']:.0f}% | {r['triton_graph_us']:.1f} | "
            f"{100 * r['triton_graph_frac_of_copy_bw']:.0f}% | {r['sdpa_us']:.1f} | "
            f"{100 * r['sdpa_frac_of_copy_bw']:.0f}% | {r['max_abs_err_vs_fp32']:.1e} |"
        )
    for r in rows:
        if r["split_sweep_graph_us"]:
            times = ", ".join(f"{k}: {v:.1f}" for k, v in r["split_sweep_graph_us"].items())
            print(f"splits at batch {r['batch']} x {r['context']} (µs in a graph): {times}")
    return 0


def split_sweep(counts: str, q, k_cache, v_cache, meta, ctx: int, scale: float) -> dict:
    """The decode kernel alone, replayed in a graph, at each KV split count (and "auto", the
    count weir picks for this batch and context): data for choosing the split rule."""
    from gpu.cuda.kernels.decode_attention import decode_attention, num_splits_for

    if not counts:
        return {}
    out = torch.empty_like(q)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    auto = num_splits_for(q.shape[0], k_cache.shape[2], ctx, sms, 64)
    times = {}
    for splits in [*map(int, counts.split(",")), auto]:
        key = f"auto={splits}" if len(times) == len(counts.split(",")) else str(splits)
        times[key] = 1e6 * graph_time(
            lambda: decode_attention(
                out,
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.decode_seq_ids,
                ctx,
                scale,
                num_splits=splits,
            )
        )
    return times


if __name__ == "__main__":
    sys.exit(main())
