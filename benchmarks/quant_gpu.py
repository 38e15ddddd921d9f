"""Quantized weights on the GPU against the 16-bit model: 4-bit (a Q4_0 GGUF of the same weights,
on the W4A16 Triton product; "q4_0 tiles": its tiled product at every row count, where from
w4a16.DEQUANT_ROWS rows the weight is otherwise dequantized for torch's product), 8-bit (a Q8_0
GGUF: the same product's int8 mode, W8A16) and FP8 (`--quantization fp8`, torch's scaled FP8
product).

For each variant: decode tok/s at batch 1 (one stream) and at batch 64, alternated over
--rounds, and its agreement with a reference: teacher-forced along the reference's own greedy
continuations, the share of positions where the variant's top token is the reference's (prompt
log-probs of prompt + continuation), and the mean log-prob gap there. The 4-bit product's
reference is the same file dequantized to bf16 on torch's ops (what the blocks mean); FP8's is
its own weights dequantized to bf16 (what is left is the activations' quantization, per token);
both variants' distance from the original weights is against the bf16 model.

    python -m benchmarks.quant_gpu [--model qwen3-0.6b] [--rounds 2]

Needs CUDA for the GPU products (on a CPU the Q4_0 file runs on weir's CPU kernels and FP8 is
skipped). Writes benchmarks/results/quant_gpu.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import bench_model, machine, save


def tok_s(llm, batch: int, tokens: int, prompt_len: int = 64) -> float:
    from core.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - t)


def continuations(llm, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt with the model's greedy continuation of 32 tokens."""
    from core.sampling import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]


def agreement(llm, sequences: list[list[int]], prompt_len: int) -> tuple[float, float]:
    """(share of continuation positions whose top token is the reference's, mean gap in
    log-prob between the variant's top token and the reference's token)."""
    from core.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(sequences, params, use_tqdm=False)
    agree, gaps = 0, []
    for seq, out in zip(sequences, outs):
        entries = out.prompt_logprobs[prompt_len:]  # entry p scores token p
        for entry in entries:
            top = entry.top_logprobs[0] if entry.top_logprobs else entry.logprob
            agree += entry.top_ids[:1] == [entry.token_id]
            gaps.append(top - entry.logprob)
    return agree / max(len(gaps), 1), statistics.mean(gaps) if gaps else 0.0


def dequantized(fp8: bool = False):
    """A context in which models load on torch's ops with every weight dequantized; `fp8`: each
    product's weight first quantized to FP8 as `--quantization fp8` does, then dequantized."""
    from contextlib import contextmanager

    from gpu import assemble
    from gpu.attention.select import get_backend
    from gpu.backend import TorchBackend
    from gpu.quant.fp8 import Fp8Tensor

    class Fp8RoundTrip(TorchBackend):
        def prepare_linear(self, weight, bias):
            if isinstance(weight, torch.Tensor):
                weight = Fp8Tensor.quantize(self.dense(weight)).dequantize(self.dtype)
            return super().prepare_linear(weight, bias)

    @contextmanager
    def ctx():
        real = assemble.choose_backend
        kind = Fp8RoundTrip if fp8 else TorchBackend
        assemble.choose_backend = lambda c, d, t: kind(
            get_backend(c.attention_backend, d), fuse=True, name="dequantized"
        )
        try:
            yield
        finally:
            assemble.choose_backend = real

    return ctx()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-tokens", default="1:256,64:128", help="batch:tokens per run")
    args = ap.parse_args()
    from gpu.cuda.kernels import w4a16
    from gpu.quant.gguf_write import uniform, write_gguf
    from weir import LLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = bench_model(args.model)
    files = {}
    for fmt in ("q4_0", "q8_0"):
        files[fmt] = Path(hf).with_name(Path(hf).name + f"-{fmt}.gguf")
        if not files[fmt].exists():  # written once beside the bench model
            write_gguf(hf, files[fmt].with_suffix(".tmp"), uniform(fmt)).rename(files[fmt])
    variants = {
        "bf16": dict(model=hf, dtype="bfloat16"),
        "q4_0": dict(model=str(files["q4_0"]), dtype="bfloat16", tokenizer=hf),
        "q8_0": dict(model=str(files["q8_0"]), dtype="bfloat16", tokenizer=hf),
    }
    references = {
        "bf16": "bf16",
        "q4_0": "q4_0 dequantized",
        "q8_0": "q8_0 dequantized",
        "fp8": "fp8 dequantized",
    }
    if device == "cuda":
        # the tiled product at every row count (w4a16.DEQUANT_ROWS off): the other side of it
        variants["q4_0 tiles"] = variants["q4_0"]
        references["q4_0 tiles"] = "q4_0 dequantized"
        variants["fp8"] = dict(model=hf, dtype="bfloat16", quantization="fp8")
    runs = [tuple(map(int, bt.split(":"))) for bt in args.batch_tokens.split(",")]
    dequant_rows = w4a16.DEQUANT_ROWS
    common = dict(device=device, max_num_seqs=64, enable_prefix_caching=False)
    results: dict[str, dict] = {name: {f"b{b}": [] for b, _ in runs} for name in variants}
    prompt_len = 32
    prompts = [[(11 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(8)]
    sequences = {
        "bf16": continuations(LLM(**variants["bf16"], **common), prompts),
    }
    for fmt in files:
        with dequantized():
            llm = LLM(**variants[fmt], **common)
            sequences[f"{fmt} dequantized"] = continuations(llm, prompts)
    if "fp8" in variants:
        with dequantized(fp8=True):
            sequences["fp8 dequantized"] = continuations(LLM(**variants["bf16"], **common), prompts)
    gc.collect()
    for r in range(args.rounds):
        for name, kw in variants.items():
            w4a16.DEQUANT_ROWS = None if name == "q4_0 tiles" else dequant_rows
            llm = LLM(**kw, **common)
            if r == 0:
                for ref in {references.get(name, "bf16"), "bf16"}:
                    share, gap = agreement(llm, sequences[ref], prompt_len)
                    results[name][f"vs {ref}"] = {"top1": share, "mean_gap": gap}
            for batch, tokens in runs:
                results[name][f"b{batch}"].append(tok_s(llm, batch, tokens))
            del llm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"{machine().get('gpu') or machine()['cpu']}, {args.model}, rounds {args.rounds}")
    base = {f"b{b}": statistics.median(results["bf16"][f"b{b}"]) for b, _ in runs}
    for name, res in results.items():
        cells = []
        for batch, _ in runs:
            med = statistics.median(res[f"b{batch}"])
            res[f"b{batch}_median"] = med
            cells.append(f"batch {batch}: {med:.0f} tok/s ({med / base[f'b{batch}']:.2f}x)")
        agree = "; ".join(
            f"top-1 agreement {v['top1']:.1%} (mean gap {v['mean_gap']:.3f} nats) {k}"
            for k, v in res.items()
            if k.startswith("vs ")
        )
        print(f"  {name}: {'; '.join(cells)}; {agree}")
    save("quant_gpu", {"meta": {**machine(), "model": args.model}, "results": results})


if __name__ == "__main__":
    main()
