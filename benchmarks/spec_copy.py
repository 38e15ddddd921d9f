"""Speculative decoding where its acceptance is known: a model trained here to copy its prompt.

No real checkpoint is reachable here, so the benchmark makes a model whose outputs repeat its
prompt: a small Llama (and a smaller one for a draft model) trained on CPU, in minutes, on
"x SEP x" (x a random sequence of token ids), until it copies. Then one stream asks it to
copy a new x: weir without speculation, with n-gram proposals and with the small model as its
draft, alternated over rounds; output tok/s and what each kept.

    python -m benchmarks.spec_copy [--rounds 3] [--length 32] [--steps 1500] [--pad-mlp N]

A model this small lives in cache, where verifying k+1 rows costs more than one (the products
are compute-bound); a real model streams its weights from memory for every step, one row or k+1
alike. `--pad-mlp N` widens the trained model's MLP to N with zero down-projection columns: the
same function (the padding's products add zeros), N/512 times the MLP's bytes, read every step
as a real model's are, so the step is memory-bound as it would be at 1B and up.

Rates: output tokens over the stream's whole time, and the decode rate (tokens after the first
over the time after it, as llama.cpp's `predicted_per_second`). The trained models are cached in
weir's cache folder (keyed by their settings). Writes benchmarks/results/spec_copy.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine, save

SEP, LOW, HIGH = 5, 10, 400  # the separator's id; x's ids are drawn from [LOW, HIGH)


def batch(rng: torch.Generator, size: int, length: int, eos: int) -> torch.Tensor:
    x = torch.randint(LOW, HIGH, (size, length), generator=rng)
    sep = torch.full((size, 1), SEP)
    end = torch.full((size, 1), eos)
    return torch.cat([x, sep, x, end], dim=1)


def copy_model(layers: int, hidden: int, steps: int, length: int) -> Path:
    """A Llama trained to copy x after SEP (cached by its settings)."""
    from transformers import AutoModelForCausalLM

    from gpu.cache import cache_dir
    from gpu.tiny_model import build_tiny_model

    path = cache_dir() / f"copy-llama-{layers}x{hidden}-{steps}-{length}"
    if (path / "done").exists():
        return path
    build_tiny_model(
        path,
        "llama",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(hidden // 64, 2),
        num_kv_heads=max(hidden // 64, 2),
        intermediate_size=2 * hidden,
        max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    torch.manual_seed(0)
    rng = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    model.train()
    t = time.perf_counter()
    for step in range(steps):
        ids = batch(rng, 16, length, eos)
        labels = ids.clone()
        labels[:, : length + 1] = -100  # only the copy is learned
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"  {path.name}: step {step}, loss {loss.item():.3f}", flush=True)
    model.eval()
    with torch.no_grad():
        ids = batch(torch.Generator().manual_seed(1), 64, length, eos)
        pred = model(input_ids=ids).logits[:, length:-1].argmax(-1)
        accuracy = (pred == ids[:, length + 1 :]).float().mean().item()
    model.save_pretrained(path)
    spent = time.perf_counter() - t
    (path / "done").write_text(json.dumps({"accuracy": accuracy, "train_s": spent}))
    print(f"  {path.name}: teacher-forced copy accuracy {accuracy:.1%}", flush=True)
    return path


def padded(path: Path, width: int) -> Path:
    """`path`'s model with its MLP widened to `width`: gate and up get random rows, down zero
    columns, so every output is the trained model's (cached beside it)."""
    from safetensors.torch import load_file, save_file

    out = path.with_name(f"{path.name}-mlp{width}")
    if (out / "done").exists():
        return out
    out.mkdir(exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    extra = width - config["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in list(tensors.items()):
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            rows = torch.randn(extra, t.shape[1], generator=g, dtype=t.dtype) * 0.02
            tensors[name] = torch.cat([t, rows])
        elif name.endswith("mlp.down_proj.weight"):
            tensors[name] = torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in path.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "done"):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "done").write_text((path / "done").read_text())
    return out


def one_stream(llm, length: int, seed: int) -> tuple[float, float, dict]:
    """(output tok/s over the whole stream, decode tok/s after the first token, counts)."""
    from core.request import EngineRequest
    from core.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(LOW, HIGH, (length,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0}
    core = llm.engine
    core.add(EngineRequest(f"copy-{seed}-{time.monotonic_ns()}", x + [SEP], params))
    out: list[int] = []
    t = time.perf_counter()
    first = None
    while core.has_work:
        for o in core.step():
            out += o.new_token_ids
        if out and first is None:
            first = time.perf_counter()
        s = core.take_stats()
        counts["drafts"] += s.spec_drafts
        counts["draft_tokens"] += s.spec_draft_tokens
        counts["accepted"] += s.spec_accepted_tokens
        counts["steps"] += 1
    end = time.perf_counter()
    counts["copied"] = sum(a == b for a, b in zip(out, x)) / length
    return length / (end - t), (len(out) - 1) / (end - first), counts


def options(doc: str) -> argparse.Namespace:
    """The options this benchmark and benchmarks/spec_peer.py share."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=5, help="streams a variant runs each round")
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--pad-mlp", type=int, default=0, help="the target's MLP widened to this")
    return ap.parse_args()


def models(args: argparse.Namespace) -> tuple[Path, Path]:
    """The copy model (padded with --pad-mlp) and its draft, trained on first use."""
    target = copy_model(4, 256, args.steps, args.length)
    draft = copy_model(2, 128, args.steps, args.length)
    return (padded(target, args.pad_mlp) if args.pad_mlp else target), draft


def main() -> None:
    args = options(__doc__)
    from weir import LLM

    target, draft = models(args)
    limit = {"disable_by_batch_size": 1}
    configs = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3},
        "draft_model": {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": args.k,
        },
    }
    llms = {
        name: LLM(str(target), speculative_config=json.dumps({**c, **limit}) if c else None)
        for name, c in configs.items()
    }
    for llm in llms.values():
        one_stream(llm, 8, seed=99)  # warm up
    rates: dict[str, list[float]] = {name: [] for name in llms}
    decode: dict[str, list[float]] = {name: [] for name in llms}
    last: dict[str, dict] = {}
    for r in range(args.rounds):
        for name in llms if r % 2 == 0 else reversed(list(llms)):
            runs = [
                one_stream(llms[name], args.length, seed=r * args.streams + i)
                for i in range(args.streams)
            ]
            # the round's rate: its streams' tokens over their time (harmonic means)
            rates[name].append(len(runs) / sum(1 / rate for rate, _, _ in runs))
            decode[name].append(len(runs) / sum(1 / d for _, d, _ in runs))
            last[name] = runs[-1][2]
    base = statistics.median(rates["off"])
    base_decode = statistics.median(decode["off"])
    accuracy = {p.name: json.loads((p / "done").read_text()) for p in (target, draft)}
    print(f"{machine()['cpu']}: copy models {accuracy}")
    for name in llms:
        med, dec, c = statistics.median(rates[name]), statistics.median(decode[name]), last[name]
        kept = c["accepted"] / max(c["draft_tokens"], 1)
        print(
            f"  {name}: {med:.1f} tok/s ({med / base:.2f}x), decode {dec:.1f} tok/s "
            f"({dec / base_decode:.2f}x), {c['steps']} steps for {args.length} tokens, "
            f"{kept:.0%} of {c['draft_tokens']} proposed tokens kept, copied {c['copied']:.0%}"
        )
    save(
        "spec_copy" + (f"_mlp{args.pad_mlp}" if args.pad_mlp else ""),
        {
            "meta": {**machine(), **vars(args), "models": accuracy},
            "rates": rates,
            "decode_rates": decode,
            "last": last,
        },
    )


if __name__ == "__main__":
    main()
