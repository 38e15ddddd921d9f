"""One decoder layer's work besides attention and the products, on the GPU: torch's ops (the CUDA
path before gpu/cuda/backend.py) against the fused Triton kernels, each replayed from a CUDA graph
as a decode step runs.

The products' outputs are given (random, not timed), so what is timed is exactly what lies between
the products of one layer, in the decode step's order:

    before (TorchBackend's ops, the K/V write through the Triton store_kv):
        residual + down, RMSNorm | q/k RMSNorm, rotation, K/V write | residual + o, RMSNorm |
        silu(gate) * up
    after (CudaBackend):
        add + RMSNorm | norm, rotation, K/V write in one | add + RMSNorm | silu(gate) * up

For the Qwen3-0.6B shape (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, bf16) at batch 1,
32 and 256; "x28" is the whole model's share of a decode step. Also reported: the largest
difference between the two paths' outputs (the fused norms may differ from torch's by a rounding).

    python -m benchmarks.fused [--batches 1,32,256 --dtype bfloat16]

Needs CUDA; exits with a message otherwise. Writes benchmarks/results/fused.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPE = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, layers=28)


def layer_inputs(batch: int, dtype: torch.dtype, device: torch.device, block_size: int = 16):
    """The products' outputs and everything else one layer's in-between work reads."""
    from gpu.models.rope import Rope

    s = SHAPE
    h, d, heads, kv = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"]
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    blocks = -(-batch // block_size) + 1
    rope = Rope(SimpleNamespace(rope_theta=1e6), d, device)
    positions = torch.randint(0, 4096, (batch,), generator=g, device=device)
    cos, sin = rope.cos_sin(positions, dtype)
    return SimpleNamespace(
        residual=rand(batch, h),
        down=rand(batch, h),  # the previous layer's down product
        qkv=rand(batch, (heads + 2 * kv) * d),
        o=rand(batch, h),
        gate_up=rand(batch, 2 * s["intermediate"]),
        w_in=rand(h),
        w_post=rand(h),
        q_norm=rand(d),
        k_norm=rand(d),
        cos=cos,
        sin=sin,
        kv=(
            torch.zeros(blocks, block_size, kv, d, dtype=dtype, device=device),
            torch.zeros(blocks, block_size, kv, d, dtype=dtype, device=device),
        ),
        slots=torch.randperm(blocks * block_size, generator=g, device=device)[:batch],
    )


def layer_work(backend, x: SimpleNamespace, fused: bool):
    """One layer's work between its products on `backend`; returns its outputs."""
    s = SHAPE
    heads, kv, d, eps = s["heads"], s["kv_heads"], s["head_dim"], 1e-6
    t = x.qkv.shape[0]
    if fused:
        from gpu.cuda.kernels.gated_act import gated_act
        from gpu.cuda.kernels.rms_norm import add_rms_norm

        h, res = add_rms_norm(x.down, x.residual, x.w_in, eps)
    else:
        res = x.residual + x.down
        h = backend.rms_norm(res, x.w_in, eps)
    q, k, v = x.qkv.split([heads * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv, d), v.view(t, kv, d)
    q = backend.rope_store_kv(q, k, v, x.q_norm, x.k_norm, eps, x.cos, x.sin, x.kv, x.slots)
    q = q.contiguous()  # what the attention wrapper reads
    if fused:
        h2, res2 = add_rms_norm(x.o, res, x.w_post, eps)
        act = gated_act(x.gate_up, "silu")
    else:
        res2 = res + x.o
        h2 = backend.rms_norm(res2, x.w_post, eps)
        gate, up = x.gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
    return h, q, h2, res2, act


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", default="benchmarks/results/fused.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.fused needs a CUDA GPU; none found.", file=sys.stderr)
        return 2

    from benchmarks.attention import cuda_time, graph_time
    from gpu.backend import TorchBackend
    from gpu.cuda.attention import TritonAttention
    from gpu.cuda.backend import CudaBackend

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    before = TorchBackend(TritonAttention(), fuse=True, name="torch ops")
    after = CudaBackend(TritonAttention())
    for b in (before, after):
        b.bind(device, dtype)
    rows = []
    for batch in map(int, args.batches.split(",")):
        x = layer_inputs(batch, dtype, device)
        want = layer_work(before, x, fused=False)
        want_cache = [c.clone() for c in x.kv]
        got = layer_work(after, x, fused=True)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want)]
        cache_diff = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(x.kv, want_cache)
        )
        row = {"batch": batch, "max_abs_diff": max(diffs), "max_abs_diff_kv": cache_diff}
        for name, backend, fused in (("torch", before, False), ("fused", after, True)):
            row[f"{name}_eager_us"] = 1e6 * cuda_time(lambda: layer_work(backend, x, fused))
            row[f"{name}_graph_us"] = 1e6 * graph_time(lambda: layer_work(backend, x, fused))
        row["speedup_graph"] = row["torch_graph_us"] / row["fused_graph_us"]
        row["saved_per_step_ms_x28"] = (
            SHAPE["layers"] * (row["torch_graph_us"] - row["fused_graph_us"]) / 1e3
        )
        rows.append(row)

    name = torch.cuda.get_device_name(device)
    meta = {
        "device": name,
        "date": time.strftime("%Y-%m-%d"),
        "dtype": args.dtype,
        **SHAPE,
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{name}, {args.dtype}, Qwen3-0.6B layer shape: the work between a layer's products")
    print(
        "| batch | torch ops µs | in a graph µs | fused µs | in a graph µs | graph speed-up "
        "| x28 saved per step ms | max diff | max diff K/V |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['torch_eager_us']:.1f} | {r['torch_graph_us']:.1f} | "
            f"{r['fused_eager_us']:.1f} | {r['fused_graph_us']:.1f} | "
            f"{r['speedup_graph']:.2f}x | {r['saved_per_step_ms_x28']:.2f} | "
            f"{r['max_abs_diff']:.1e} | {r['max_abs_diff_kv']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
