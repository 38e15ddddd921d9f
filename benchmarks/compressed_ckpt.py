"""compressed-tensors checkpoints at a real size on CPU: the 1B-class Llama of
benchmarks/real_checkpoints.py (hidden 2048, 16 layers, MLP 8192, bf16) written as llm-compressor
writes W4A16 (4-bit, groups of 128, symmetric) and W8A8 (int8 per channel), by the
`compressed-tensors` package's own compressors, and as GGUF Q4_0 and Q8_0 files of the same
weights (weir's writer). weir serves the compressed layers as those same blocks
(gpu/quant/compressed.py), so each pair should decode at the same speed: one stream's decode
step (engine alone, benchmarks/step_time.py's measure), each variant loaded in turn, the order
reversed every round, beside its floor (the weights' bytes over the machine's read bandwidth,
timed before the rounds) and its load time.

    python -m benchmarks.compressed_ckpt [--rounds 3] [--batch 1,16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from benchmarks import read_bandwidth
from benchmarks.common import machine, save
from benchmarks.real_checkpoints import model_of
from core.config import EngineConfig

PRESETS = {"ct-w4a16": ("W4A16", "pack-quantized"), "ct-w8a8": ("W8A8", "int-quantized")}
PAIRS = {"ct-w4a16": "gguf-q4_0", "ct-w8a8": "gguf-q8_0"}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed(src: Path, name: str) -> Path:
    """`src` with every linear layer but lm_head stored by the package (min-max scales)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    out = src.with_name(f"{src.name}-{name}")
    if (out / "done").exists():
        return out
    preset, fmt = PRESETS[name]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = BaseCompressor.load_from_registry(fmt)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for key, w in load_file(src / "model.safetensors").items():
        prefix = key.removesuffix(".weight")
        if not (key.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            tensors[key] = w
            continue
        a = scheme.weights
        group = a.group_size if a.strategy == "group" else w.shape[1]
        g = w.float().reshape(w.shape[0], -1, group)
        scale = (g.abs().amax(-1) / (2 ** (a.num_bits - 1) - 0.5)).to(torch.bfloat16)
        stored = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
        tensors.update({f"{prefix}.{p}": t.contiguous() for p, t in stored.items()})
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config))
    (out / "done").write_text("")
    return out


def gguf_file(src: Path, fmt: str) -> Path:
    from gpu.quant.gguf_write import uniform, write_gguf

    out = src.with_name(f"{src.name}-{fmt}.gguf")
    if not out.exists():
        write_gguf(src, out, uniform(fmt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()

    from benchmarks.step_time import run_once
    from gpu.launch import load

    src = model_of("llama-1b")
    paths = {name: compressed(src, name) for name in PRESETS}
    paths |= {PAIRS[n]: gguf_file(src, PAIRS[n].split("-")[1]) for n in PRESETS}
    batches = [int(b) for b in args.batch.split(",")]
    bandwidth = max(read_bandwidth.measure().values())  # GB/s, before any model is loaded
    steps: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in paths}
    loads: dict[str, list[float]] = {n: [] for n in paths}
    held: dict[str, int] = {}
    names = list(paths)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t = time.perf_counter()
            loaded = load(
                EngineConfig(model=str(paths[name]), cpu_threads=0, enable_prefix_caching=False)
            )
            loads[name].append(time.perf_counter() - t)
            held[name] = sum(loaded.weight_bytes.values())
            core = loaded.core
            try:
                run_once(core, 1, 16, 2, seed=-1)  # warm-up
                for b in batches:
                    steps[name][b].append(run_once(core, b, 128, args.steps, r)[1])
            finally:
                core.close()
    rows = []
    print(f"\n1B-class Llama on CPU, read bandwidth {bandwidth:.1f} GB/s, medians of {args.rounds}")
    print("| checkpoint | weights GB | load s | batch | decode ms | tok/s | of floor | vs pair |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        floor = held[name] / (bandwidth * 1e9)
        for b in batches:
            ms = statistics.median(steps[name][b])
            pair = PAIRS.get(name) or next(k for k, v in PAIRS.items() if v == name)
            ratio = statistics.median(steps[pair][b]) / ms
            row = dict(checkpoint=name, weight_bytes=held[name], batch=b, decode_s=ms,
                       load_s=statistics.median(loads[name]), floor_s=floor,
                       rounds=steps[name][b])  # fmt: skip
            rows.append(row)
            print(
                f"| {name} | {held[name] / 1e9:.2f} | {row['load_s']:.1f} | {b} | {ms * 1e3:.1f} "
                f"| {b / ms:.1f} | {floor / ms:.0%} | {ratio:.2f}x |"
            )
    save("compressed_ckpt", {"machine": machine(), "args": vars(args), "rows": rows,
                              "read_gbs": bandwidth})  # fmt: skip


if __name__ == "__main__":
    from gpu import openmp

    openmp.prepare(EngineConfig())  # as an engine process does, before torch is imported
    main()
