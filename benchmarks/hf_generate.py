"""transformers' own `generate` on the offline protocol's prompts: the baseline of
benchmarks/offline.py (static left-padded batches, each until its longest request)."""

from __future__ import annotations

import time

import torch


def run_transformers(
    model: str, prompts, outputs, batch_sizes: list[int], device: str, dtype: str
) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    runs = {}
    for bs in batch_sizes:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), bs):
            batch, outs = prompts[i : i + bs], outputs[i : i + bs]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device
            )
            n = max(outs)
            with torch.inference_mode():
                hf.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
        elapsed = time.perf_counter() - t0
        runs[bs] = {"elapsed_s": elapsed, "tok_s": sum(outputs) / elapsed}
        print(f"  transformers batch {bs}: {runs[bs]['tok_s']:.0f} tok/s")
    best = max(runs, key=lambda b: runs[b]["tok_s"])
    return {"runs": runs, "best_batch": best, "tok_s": runs[best]["tok_s"]}
