"""Structured outputs: what a constraint costs.

1. Output tokens/s of N concurrent requests (default 64) all constrained by one JSON schema vs
   the same requests unconstrained, in one engine, alternated, medians of repeats. The schema's
   one string property keeps a random model writing until max_tokens, so both sides generate
   the same number of tokens.
2. Compiling a 50-property schema: cold (cache empty), cached (a copy of the compiled matcher),
   and what a request waits for it in an idle engine (time to first token, cold vs cached vs
   unconstrained).
3. The mask per step at batch 1/64/256: llguidance's fill (all rows, its own threads) and the
   torch pass that applies it to the logits, with the model's vocabulary and with a synthetic
   151,936-token byte-level vocabulary (Qwen's size).

    python -m benchmarks.structured [--model qwen3-100m] [--requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.common import bench_model, machine, save
from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.structured import Constraint, Grammars
from core.runner_step import GrammarBatch
from gpu import grammar_mask

ONE_STRING = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


def fifty_properties() -> dict:
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": sorted(props)[:25]}


def run_batch(core, prompts, max_tokens: int, constraint: Constraint | None, seed: int) -> dict:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=1.0,
            seed=seed + i,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured=constraint,
        )
        core.add(EngineRequest(f"r{seed}-{i}", p, params))
    tokens = 0
    while core.has_work:
        for out in core.step():
            tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    return {"tok_s": tokens / elapsed, "tokens": tokens, "elapsed_s": elapsed}


def throughput(core, args) -> dict:
    rng = random.Random(0)
    vocab = core.runner.vocab_size
    prompts = [
        [rng.randrange(10, min(vocab, 1000)) for _ in range(32)] for _ in range(args.requests)
    ]
    schema = Constraint("json", json.dumps(ONE_STRING), any_whitespace=False)
    run_batch(core, prompts[:4], 8, schema, 99)  # warm: compile once, build the executor
    runs: dict[str, list[dict]] = {"none": [], "json": []}
    for rep in range(args.repeats):
        order = ("none", "json") if rep % 2 == 0 else ("json", "none")
        for name in order:
            c = schema if name == "json" else None
            runs[name].append(run_batch(core, prompts, args.max_tokens, c, 1000 * rep))
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    return {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "unconstrained_tok_s": med["none"],
        "constrained_tok_s": med["json"],
        "ratio": med["json"] / med["none"],
        "runs": runs,
    }


def compile_times(core, tokenizer_json: str, vocab: int, eos: list[int]) -> dict:
    schema = json.dumps(fifty_properties())
    cold, cached = [], []
    for _ in range(3):
        g = Grammars(tokenizer_json, vocab, eos)
        g.tokenizer  # built once per tokenizer at start-up; not part of a compile
        c = Constraint("json", schema)
        t = time.perf_counter()
        g.start(c).result()
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        g.start(c).result()
        cached.append(time.perf_counter() - t)
        g.close()

    def ttft(constraint: Constraint | None) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, structured=constraint)
        t = time.perf_counter()
        core.add(EngineRequest(f"ttft-{time.perf_counter_ns()}", [11, 12, 13], params))
        while core.has_work:
            if core.step():
                break
        while core.has_work:
            core.step()
        return time.perf_counter() - t

    ttft(None)
    plain, new, again = [], [], []
    for i in range(5):
        fresh = dict(fifty_properties(), title=f"fresh {i}")  # not compiled by the engine yet
        c = Constraint("json", json.dumps(fresh))
        plain.append(ttft(None))
        new.append(ttft(c))
        again.append(ttft(c))
    return {
        "cold_ms": 1000 * statistics.median(cold),
        "cached_ms": 1000 * statistics.median(cached),
        "ttft_unconstrained_ms": 1000 * statistics.median(plain),
        "ttft_cold_schema_ms": 1000 * statistics.median(new),
        "ttft_cached_schema_ms": 1000 * statistics.median(again),
    }


def synthetic_vocab(size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer with `size` tokens of 1-8 bytes (no merges are needed: the
    mask only reads each token's bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    letters = [c for c in alphabet if c.isalnum()] * 6 + sorted(alphabet)
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    while len(vocab) < size:
        token = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def mask_times(tokenizer_json: str, vocab: int, eos: list[int], batches, iters: int) -> dict:
    from gpu.attention.select import get_backend
    from gpu.cpu.backend import CpuBackend

    backend = CpuBackend(get_backend("auto", torch.device("cpu")))
    g = Grammars(tokenizer_json, vocab, eos)
    matcher = g.start(Constraint("json", json.dumps(ONE_STRING), any_whitespace=False)).result()
    for t in g.tokenizer.tokenize_str('{"text": "The river'):
        matcher.consume_token(t)  # mid-string: most of the vocabulary is allowed
    out = {}
    for b in batches:
        pairs = [(matcher.deep_copy(), j) for j in range(b)]
        batch = GrammarBatch(list(range(b)), g.words, lambda p, pairs=pairs: g.fill(pairs, p, b))
        logits = torch.randn(b, vocab)
        fill, apply = [], []
        for _ in range(iters):
            t = time.perf_counter()
            rows, mask = grammar_mask.build(batch, torch.device("cpu"))
            fill.append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.apply_token_bitmask(logits, rows, mask)
            apply.append(time.perf_counter() - t)
        out[b] = {
            "fill_ms": 1000 * statistics.median(fill),
            "apply_ms": 1000 * statistics.median(apply),
        }
    g.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a benchmark shape, directory or hub id")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mask-iters", type=int, default=20)
    ap.add_argument("--cpu-threads", default="auto", help="as weir serve's --cpu-threads")
    args = ap.parse_args()

    from gpu.launch import load

    from server.cli import cpu_threads

    loaded = load(
        EngineConfig(
            model=bench_model(args.model) if args.model else None,
            # As `weir serve` runs it: torch gets the cores but one (--cpu-threads auto).
            cpu_threads=cpu_threads(args.cpu_threads),
            max_num_seqs=max(256, args.requests),
            max_model_len=1024,
            num_kv_blocks=max(256, args.requests * 12),
        )
    )
    core = loaded.core
    vocab, eos = core.runner.vocab_size, sorted(core.eos_token_ids)
    tokenizer_json = core.tokenizer.to_str()
    result = {
        "meta": machine()
        | {
            "model": args.model or "weir-tiny",
            "vocab": vocab,
            "torch_threads": torch.get_num_threads(),
        }
    }
    result["throughput"] = throughput(core, args)
    t = result["throughput"]
    print(
        f"{args.requests} requests x {args.max_tokens} tokens: unconstrained "
        f"{t['unconstrained_tok_s']:,.0f} tok/s, one JSON schema {t['constrained_tok_s']:,.0f} "
        f"tok/s ({100 * t['ratio']:.1f}%)"
    )
    result["compile"] = c = compile_times(core, tokenizer_json, vocab, eos)
    print(
        f"50-property schema: compile {c['cold_ms']:.1f} ms cold, {c['cached_ms']:.2f} ms "
        f"cached; TTFT {c['ttft_unconstrained_ms']:.1f} ms unconstrained, "
        f"{c['ttft_cold_schema_ms']:.1f} ms with a new schema, "
        f"{c['ttft_cached_schema_ms']:.1f} ms with a compiled one"
    )
    batches = (1, 64, 256)
    result["mask"] = {
        f"model ({vocab})": mask_times(tokenizer_json, vocab, eos, batches, args.mask_iters),
        "synthetic (151936)": mask_times(
            synthetic_vocab(151936), 151936, [256], batches, args.mask_iters
        ),
    }
    print("| vocabulary | batch | fill (ms) | apply (ms) |")
    print("| --- | --- | --- | --- |")
    for name, rows in result["mask"].items():
        for b, r in rows.items():
            print(f"| {name} | {b} | {r['fill_ms']:.2f} | {r['apply_ms']:.2f} |")
    save("structured", result)


if __name__ == "__main__":
    main()
