"""One architecture against another of the same shape, offline on CPU: greedy decode at 1 and 16
streams, rounds alternated, each configuration's best round, the ratio to the baseline. For a
layer form new to the one-call stack (OLMo 2's norms, say) beside Llama's, and for the same model
in the stack and layer by layer (`--modules`).

    python -m benchmarks.arch_stack [--arch olmo2] [--baseline llama] [--modules] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

# untied heads for every architecture (a float32 tied head is computed after the call, through
# torch: Granite's and SmolLM3's default would measure that, not their layers)
SHAPE = dict(
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    intermediate_size=2816,
    tie_word_embeddings=False,
)
TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="olmo2")
    ap.add_argument("--baseline", default="llama")
    ap.add_argument("--modules", action="store_true", help="also --arch layer by layer")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from gpu.tiny_model import build_tiny_model
    from weir import LLM, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="arch-stack-"))
    runs = [(args.baseline, "auto"), (args.arch, "auto")]
    if args.modules:
        runs.append((args.arch, "modules"))
    llms = {}
    for arch, mode in runs:
        path = root / arch
        if not path.exists():
            build_tiny_model(path, arch, **SHAPE)
        llm = LLM(str(path), num_kv_blocks=256, max_model_len=1024, cpu_forward=mode)
        ran = "stack" if llm.engine.runner.model.stack is not None else "modules"
        llms[(arch, mode)] = (llm, ran)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    best: dict[tuple, list[float]] = {key: [0.0, 0.0] for key in llms}
    for key, (llm, _) in llms.items():  # warm up
        llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    for _ in range(args.rounds):
        for key, (llm, _) in llms.items():
            for j, streams in enumerate((1, 16)):
                t = time.perf_counter()
                llm.generate([[5, 6, 7, 8]] * streams, params, use_tqdm=False)
                best[key][j] = max(best[key][j], TOKENS * streams / (time.perf_counter() - t))
    base = best[(args.baseline, "auto")]
    print(f"shape {SHAPE}, {TOKENS} tokens a stream, best of {args.rounds} alternated rounds")
    print("| model | path | 1 stream tok/s | x baseline | 16 streams tok/s | x baseline |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key, (one, many) in best.items():
        ran = llms[key][1]
        print(f"| {key[0]} | {ran} | {one:.1f} | {one / base[0]:.2f} | {many:.1f} | "
              f"{many / base[1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
