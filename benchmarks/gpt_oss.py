"""gpt-oss on CPU, weir against llama.cpp, on the same MXFP4 experts: a model of gpt-oss-20b's layer
(hidden 2880, 64 query / 8 KV heads of 64, 32 experts of 2880 with 4 a token, every other layer a
window of 128, YaRN; random weights, the tests' trained tokenizer) with `--layers` layers (2: 1.6B
weights, 0.25B of them read a token), its experts written in MXFP4 as OpenAI's files hold them.

weir serves that folder (the experts in MXFP4 on its 4-bit kernels: gpu/quant/mxfp4.py, the rest
bfloat16);
llama.cpp serves its own converter's GGUF of it (the experts in its MXFP4 type, the rest bfloat16).
One server at a time, alternated for `--rounds`; greedy completions with ignore_eos at each level.

    LLAMA_CPP_HOME=~/.cache/weir-peers/llama-cpp python -m benchmarks.gpt_oss --rounds 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path

from benchmarks import read_bandwidth
from benchmarks.common import machine, save
from benchmarks.loadgen import weir_argv
from benchmarks.real_checkpoints import NAME, PEERS, gguf_of, run_server

SHAPE_20B = dict(
    hidden_size=2880,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=2880,
    num_experts=32,
    experts_per_token=4,
    sliding_window=128,
    vocab_size=2048,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    extra_eos=("<|endoftext|>",),
)


def model_of(layers: int) -> Path:
    """The MXFP4 folder (built once, cached)."""
    from gpu.cache import cache_dir
    from gpu.quant.mxfp4 import write_folder
    from gpu.tiny_model import build_tiny_model

    out = cache_dir() / f"bench-gpt-oss-20b-{layers}-mxfp4"
    if not (out / "config.json").exists():
        tmp = cache_dir() / f"bench-gpt-oss-20b-{layers}.tmp"
        build_tiny_model(tmp / "float", "gpt_oss", num_layers=layers, **SHAPE_20B)
        write_folder(tmp / "float", tmp / "mxfp4")
        (tmp / "mxfp4").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    model = model_of(args.layers)
    os.environ.setdefault("LLAMA_CPP_QUANT", "bf16")
    gguf = gguf_of(model, os.environ["LLAMA_CPP_QUANT"])
    weir = functools.partial(weir_argv, launcher="server")
    table = {
        "weir (MXFP4)": lambda port: weir(str(model), port, "--served-model-name", NAME),
        "llama.cpp (MXFP4)": lambda port: [
            str(PEERS / "llama_cpp.sh"), "serve-file", str(gguf), str(port), NAME
        ],
    }  # fmt: skip
    logs = Path("benchmarks/results/logs")
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {label: [] for label in table}
    bandwidth = 0.0
    for r in range(args.rounds):
        bandwidth = max(bandwidth, max(read_bandwidth.measure().values()))
        order = list(table) if r % 2 == 0 else list(reversed(table))
        for label in order:
            print(f"{label} (round {r + 1}):", flush=True)
            runs[label].append(run_server(label, table[label], levels, args.max_tokens, logs))
    report = {"machine": machine(), "read_bandwidth_gbs": bandwidth, "runs": runs}
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    for c in levels:
        rates = {k: [run[c]["output_tok_s"] for run in v] for k, v in runs.items()}
        weir_label, peer = list(table)
        ratios = [w / p for w, p in zip(rates[weir_label], rates[peer])]
        print(
            f"c={c}: "
            + ", ".join(f"{k} {[round(x, 1) for x in v]} tok/s" for k, v in rates.items())
            + f"; weir / llama.cpp {[round(x, 2) for x in ratios]} "
            f"(median {statistics.median(ratios):.2f})",
            flush=True,
        )
    save("gpt_oss", report)
    print(json.dumps({k: [run.get("rss") for run in v] for k, v in runs.items()}))


if __name__ == "__main__":
    main()
