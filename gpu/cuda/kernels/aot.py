"""Compile every Triton kernel ahead of time for a GPU architecture, without a GPU.

Triton's CPU interpreter checks what the kernels compute; this checks that they compile (types,
control flow, tensor-core shapes) all the way to a cubin for the target, with the ptxas shipped in
the triton wheel. Run it outside TRITON_INTERPRET:

    python -m gpu.cuda.kernels.aot --arch 90        # sm_90: H100/H200
"""

from __future__ import annotations

import argparse
import os
import sys

CASES = [  # (kernel, dtype, head_dim or size, extra constexprs)
    ("store", "bf16", 128, {}),
    # FP8 caches (--kv-cache-dtype fp8 / fp8_e5m2: "model/cache"), written and read
    ("store", "fp16/fp8e5", 64, {"KIND": 2}),
    ("store", "bf16/fp8e5", 128, {"KIND": 2}),
    ("rope_store", "bf16/fp8e4nv", 128, {"NORM": True, "KIND": 1}),
    ("rope_store", "bf16/fp8e4nv", 128, {"NORM": False, "KIND": 1, "SCALED": True}),  # k_scale
    ("prefill", "bf16/fp8e5", 128, {"SLIDING": False, "SOFTCAP": False, "SINKS": False}),
    (
        "decode",
        "bf16/fp8e4nv",
        128,
        {"NUM_SPLITS": 4, "SLIDING": False, "SOFTCAP": False, "SINKS": False},
    ),
    # (gpt-oss's sinks ride along on variants that exist anyway: its windows are on bf16 models)
    ("prefill", "bf16", 128, {"SLIDING": False, "SOFTCAP": False, "SINKS": True}),
    ("prefill", "fp32", 64, {"SLIDING": True, "SOFTCAP": True, "SINKS": False}),  # Gemma 2's
    ("decode", "bf16", 128, {"NUM_SPLITS": 1, "SLIDING": True, "SOFTCAP": False, "SINKS": True}),
    ("decode", "bf16", 256, {"NUM_SPLITS": 8, "SLIDING": False, "SOFTCAP": True, "SINKS": False}),
    ("decode", "fp16", 64, {"NUM_SPLITS": 4, "SLIDING": True, "SOFTCAP": False, "SINKS": False}),
    ("reduce", "bf16", 128, {"NUM_SPLITS": 8, "SINKS": True}),
    # the CUDA backend's fused kernels; "size" is the hidden or intermediate size for the norm
    # and the activation, and "fp32/bf16" a float32 model over a bfloat16 cache
    ("rms_norm", "bf16", 1024, {"ADD": True}),
    ("rms_norm", "fp32", 4096, {"ADD": False}),
    ("gated_act", "bf16", 3072, {"ACT": 0}),
    ("gated_act", "fp16", 3072, {"ACT": 1}),
    ("gated_act", "fp32", 3072, {"ACT": 2}),
    ("rope_store", "bf16", 128, {"NORM": True}),
    ("rope_store", "fp16", 64, {"NORM": False}),
    ("rope_store", "fp32/bf16", 128, {"NORM": True}),
    # the 4-bit product: decode rows with k split, prefill rows, a float32 model
    ("w4a16", "bf16", 0, {"BLOCK_M": 16, "SPLIT_K": 4, "UPCAST": False, "FP4": False}),
    ("w4a16", "fp16", 0, {"BLOCK_M": 64, "SPLIT_K": 1, "UPCAST": False, "FP4": False}),
    ("w4a16", "fp32", 0, {"BLOCK_M": 16, "SPLIT_K": 2, "UPCAST": True, "FP4": False}),
    ("w4a16", "bf16", 0, {"BLOCK_M": 16, "SPLIT_K": 4, "UPCAST": False, "FP4": True}),  # MXFP4
    ("w4a16", "bf16", 0, {"BLOCK_M": 16, "SPLIT_K": 4, "UPCAST": False, "INT8": True}),  # Q8_0
    # the same weights dequantized once for torch's product (DEQUANT_ROWS rows and more)
    ("w4a16_dequant", "bf16", 0, {"FP4": False}),
    ("w4a16_dequant", "fp32", 0, {"FP4": True}),
    ("w4a16_dequant", "bf16", 0, {"INT8": True}),
    # LoRA's shrink and expand; "size" is the rank axis (R_PAD): decode rows with k split,
    # prefill rows, a float32 model, and "fp32/bf16" float32 activations over bfloat16 slots
    ("lora_shrink", "bf16", 16, {"SPLIT_K": 4, "UPCAST": False}),
    ("lora_shrink", "fp32", 64, {"SPLIT_K": 1, "UPCAST": True}),
    ("lora_shrink", "fp32/bf16", 16, {"SPLIT_K": 2, "UPCAST": True}),
    ("lora_expand", "bf16", 16, {"SPLIT_K": 4, "UPCAST": False}),
    ("lora_expand", "fp16", 32, {"SPLIT_K": 1, "UPCAST": False}),
    ("lora_expand", "fp32", 64, {"SPLIT_K": 1, "UPCAST": True}),
    ("lora_expand", "fp32/bf16", 16, {"SPLIT_K": 2, "UPCAST": True}),
    # a mixture's experts in one pass: gate/up by token (gpt-oss's biases), down weighted;
    # dense, 4-bit integer codes (Q4_0 / Q4_1, AWQ, GPTQ) or MXFP4 (gpt-oss's experts)
    ("moe", "bf16", 0, {"BY_TOKEN": True, "HAS_BIAS": True, "SCALE": False, "QUANT": 0}),
    ("moe", "fp16", 0, {"BY_TOKEN": False, "HAS_BIAS": False, "SCALE": True, "QUANT": 0}),
    ("moe", "fp16", 0, {"BY_TOKEN": True, "HAS_BIAS": False, "SCALE": False, "QUANT": 1}),
    ("moe", "bf16", 0, {"BY_TOKEN": False, "HAS_BIAS": True, "SCALE": True, "QUANT": 2}),
    # an FP8 product's input quantized per token, or with a checkpoint's static scale
    ("fp8_quant", "bf16", 1024, {"STATIC": False}),
    ("fp8_quant", "fp16", 4096, {"STATIC": True}),
]


def _signature(fn, pointers: dict[str, str], consts: dict):
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in pointers:
            sig[n] = pointers[n]
        elif n in ("scale", "eps", "static_scale", "softcap", "k_mul", "v_mul"):
            sig[n] = "fp32"
        elif "stride" in n:
            sig[n] = "i64"
        else:
            sig[n] = "i32"
    return ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})


def compile_case(kind: str, dtype: str, head_dim: int, extra: dict, arch: int) -> int:
    """Compile one kernel variant; returns the cubin's size in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    from gpu.cuda.kernels import decode_attention as da
    from gpu.cuda.kernels import fp8_quant as fq
    from gpu.cuda.kernels import fused_moe as fm
    from gpu.cuda.kernels import gated_act as ga
    from gpu.cuda.kernels import lora as lo
    from gpu.cuda.kernels import prefill_attention as pa
    from gpu.cuda.kernels import rms_norm as rn
    from gpu.cuda.kernels import rope_store as rs
    from gpu.cuda.kernels import store_kv as sk
    from gpu.cuda.kernels import w4a16 as wq

    dtype, _, cache = dtype.partition("/")
    p, c = f"*{dtype}", f"*{cache or dtype}"
    i32 = "*i32"
    precision = "ieee" if dtype == "fp32" else "tf32"
    size = head_dim
    if kind == "fp8_quant":
        fn = fq._quantize_kernel
        ptrs = dict(x_ptr=p, q_ptr="*fp8e4nv", scale_ptr="*fp32")
        consts = dict(FP8_LIMIT=fq.FP8_MAX, BLOCK=min(size, fq.BLOCK))
    elif kind == "w4a16":
        fn = wq._w4a16_kernel
        ptrs = dict(
            x_ptr=p, qweight_ptr="*i32", scales_ptr="*fp16", mins_ptr="*fp16", out_ptr="*fp32"
        )
        consts = dict(GROUP=32, BLOCK_N=64, BLOCK_K=64, FP4=False, INT8=False)
    elif kind == "w4a16_dequant":
        fn = wq._dequant_kernel
        ptrs = dict(qweight_ptr="*i32", scales_ptr="*fp16", mins_ptr="*fp16", out_ptr=p)
        consts = dict(GROUP=32, BLOCK_N=64, BLOCK_K=64, FP4=False, INT8=False)
    elif kind == "lora_shrink":
        fn = lo._lora_shrink_kernel
        ptrs = dict(
            x_ptr=p,
            a_ptr=c,
            ranks_ptr=i32,
            order_ptr=i32,
            counts_ptr=i32,
            starts_ptr=i32,
            v_ptr="*fp32",
        )
        consts = dict(R_PAD=size, BLOCK_M=lo.BLOCK_M, BLOCK_K=lo.BLOCK_K, PRECISION=precision)
    elif kind == "lora_expand":
        fn = lo._lora_expand_kernel
        ptrs = dict(
            v_ptr="*fp32",
            b_ptr=c,
            ranks_ptr=i32,
            cols_ptr="*i64",
            order_ptr=i32,
            counts_ptr=i32,
            starts_ptr=i32,
            y_ptr=p,
        )
        consts = dict(R_PAD=size, BLOCK_M=lo.BLOCK_M, BLOCK_N=lo.BLOCK_N, PRECISION=precision)
    elif kind == "moe":
        fn = fm._moe_kernel
        quant = extra["QUANT"] != 0
        ptrs = dict(a_ptr=p, w_ptr="*i32" if quant else p, bias_ptr=p, scale_ptr=p, out_ptr=p)
        ptrs.update(scales_ptr="*fp16" if quant else p, mins_ptr="*fp16" if quant else p)
        ptrs.update(sorted_ptr="*i64", block_expert_ptr="*i64")
        consts = dict(BLOCK_M=fm.BLOCK_M, BLOCK_N=64, BLOCK_K=64, UPCAST=False, GROUP=32)
    elif kind == "rms_norm":
        fn = rn._rms_norm_kernel
        ptrs = dict(x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, sum_ptr=p)
        consts = dict(ROWS=max(rn.TILE // size, 1), BLOCK=size)
    elif kind == "gated_act":
        fn = ga._gated_act_kernel
        consts = dict(ROWS=1, BLOCK=ga.TILE)
        ptrs = dict(y_ptr=p, out_ptr=p)
    elif kind == "rope_store":
        fn = rs._rope_store_kernel
        ptrs = dict(
            q_ptr=p,
            k_ptr=p,
            v_ptr=p,
            q_out_ptr=p,
            k_cache_ptr=c,
            v_cache_ptr=c,
            slot_ptr="*i64",
            cos_ptr=p,
            sin_ptr=p,
            q_weight_ptr=p,
            k_weight_ptr=p,
        )
        consts = dict(
            HEAD_DIM=head_dim,
            HEAD_PAD=head_dim,
            ROWS=2048 // head_dim,
            KIND=0,
            EMULATE=False,
            SCALED=False,
        )
    elif kind == "store":
        fn = sk._store_kv_kernel
        ptrs = dict(key_ptr=p, value_ptr=p, k_cache_ptr=c, v_cache_ptr=c, slot_ptr="*i64")
        consts = dict(HEAD_DIM=head_dim, HEAD_PAD=head_dim, HEADS_PAD=8, KIND=0, EMULATE=False)
    elif kind == "prefill":
        fn = pa._prefill_kernel
        ptrs = dict(
            out_ptr=p,
            q_ptr=p,
            k_cache_ptr=c,
            v_cache_ptr=c,
            block_tables_ptr=i32,
            query_start_ptr=i32,
            seq_lens_ptr=i32,
            seq_ids_ptr=i32,
            sinks_ptr="*fp32",
        )
        consts = dict(
            HEAD_DIM=head_dim,
            HEAD_PAD=head_dim,
            BLOCK_M=16,
            BLOCK_N=32,
            PRECISION=precision,
            UPCAST=False,
        )
    elif kind == "decode":
        fn = da._decode_kernel
        ptrs = dict(
            out_ptr=p,
            part_out_ptr="*fp32",
            part_lse_ptr="*fp32",
            q_ptr=p,
            k_cache_ptr=c,
            v_cache_ptr=c,
            block_tables_ptr=i32,
            query_start_ptr=i32,
            seq_lens_ptr=i32,
            seq_ids_ptr=i32,
            sinks_ptr="*fp32",
        )
        consts = dict(
            HEAD_DIM=head_dim,
            HEAD_PAD=head_dim,
            GROUP_PAD=16,
            BLOCK_N=64,
            PRECISION=precision,
            UPCAST=False,
        )
    else:
        fn = da._reduce_kernel
        ptrs = dict(
            out_ptr=p,
            part_out_ptr="*fp32",
            part_lse_ptr="*fp32",
            query_start_ptr=i32,
            seq_ids_ptr=i32,
            sinks_ptr="*fp32",
        )
        consts = dict(HEAD_DIM=head_dim, HEAD_PAD=head_dim, SPLITS_PAD=extra["NUM_SPLITS"])
    consts.update(extra)
    kernel = triton.compile(_signature(fn, ptrs, consts), target=GPUTarget("cuda", arch, 32))
    return len(kernel.asm["cubin"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    from concurrent.futures import ProcessPoolExecutor

    cases = [(*case, args.arch) for case in CASES]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:  # the cases compile independently
        sizes = list(pool.map(_compile, cases))
    for (kind, dtype, head_dim, extra), size in zip(CASES, sizes):
        print(f"sm_{args.arch} {kind} {dtype} head_dim={head_dim} {extra}: cubin {size} bytes")
    return 0


def _compile(case: tuple) -> int:
    return compile_case(*case)


if __name__ == "__main__":
    sys.exit(main())
