"""Reranking with a GGUF reranker: weir beside llama-server on the same file (benchmarks/rerank.py
holds weir beside transformers' cross-encoder).

A Qwen3-Reranker-0.6B-shaped model (hidden 1024, 28 layers, GQA 16/8 of 128, MLP 3072, tied
embeddings; random bfloat16 weights, the tests' trained vocabulary with "yes" added) is
converted by llama.cpp's own convert_hf_to_gguf.py (which makes it a reranker: pooling_type rank,
the "yes"/"no" rows as cls.output, its rerank prompt) to the chosen format, and served by `weir
serve FILE` and by `llama-server --reranking` (benchmarks/peers/llama_cpp.sh), one at a time,
the order reversed each round. Each server answers `--requests` /v1/rerank calls of one query
against `--docs` documents (100 to 300 words, seeded, other documents each call: repeating them
would time the servers' prompt caches) after one warm-up call: documents a second, and how far
the two servers' scores are apart.

    python -m benchmarks.rerank_gguf [--quant q8_0] [--docs 32] [--requests 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import httpx

from benchmarks.common import machine, save
from benchmarks.loadgen import ServerProcess, free_port, weir_argv
from benchmarks.real_checkpoints import PEERS, gguf_of

NAME = "reranker"
SHAPE = dict(
    hidden_size=1024,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=2048,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    initializer_range=0.02,
    dtype="bfloat16",
    added_tokens=("yes",),
)
QUERY = "where does the river meet the sea and what stone does it cut on the way"


def model() -> Path:
    """The checkpoint, built once; its folder's name tells llama.cpp's converter it is a
    Qwen3 reranker."""
    from gpu.cache import cache_dir
    from gpu.tiny_model import build_tiny_model

    path = cache_dir() / "bench-qwen3-reranker-0.6b"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + "-tmp")
        build_tiny_model(tmp, "qwen3", **SHAPE)
        tmp.rename(path)
    return path


def documents(n: int, seed: int = 0) -> list[str]:
    from gpu.tiny_tokenizer import _WORDS

    words = list(_WORDS)
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(100, 300))) for _ in range(n)]


def run(label: str, argv, docs: list[list[str]], logs: Path) -> dict:
    """One server: a warm-up call, then one call per list of documents (each list its own, so
    no call finds another's documents in a prompt cache; within a call the shared prompt and
    query may be cached, on both servers)."""
    port = free_port()
    server = ServerProcess(argv(port), port, str(logs / f"{label.replace(' ', '_')}.log"))
    try:
        server.wait_ready(900)
        with httpx.Client(base_url=server.url, timeout=1800) as client:

            def rerank(batch: list[str]) -> dict:
                body = {"model": NAME, "query": QUERY, "documents": batch}
                r = client.post("/v1/rerank", json=body)
                r.raise_for_status()
                return r.json()

            rerank(documents(2, seed=999))  # warm-up
            start = time.perf_counter()
            answers = [rerank(batch) for batch in docs]
            wall = time.perf_counter() - start
        scores = [
            [s for _, s in sorted((x["index"], x["relevance_score"]) for x in a["results"])]
            for a in answers
        ]
        out = {"docs_s": sum(map(len, docs)) / wall, "wall_s": wall, "scores": scores}
        print(f"  {label}: {out['docs_s']:.2f} docs/s ({wall:.1f} s)", flush=True)
        return out
    finally:
        server.stop()
        time.sleep(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quant", default="q8_0", help="f32, f16, bf16, q8_0 or a llama-quantize type")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = gguf_of(model(), args.quant)
    docs = [documents(args.docs, seed=r) for r in range(args.requests)]
    logs = Path("benchmarks/results/rerank-gguf-logs")
    logs.mkdir(parents=True, exist_ok=True)
    servers = {
        "weir": lambda port: weir_argv(str(path), port, "--served-model-name", NAME),
        "llama.cpp": lambda port: [
            str(PEERS / "llama_cpp.sh"),
            "serve-file",
            str(path),
            str(port),
            NAME,
            "--reranking",
        ],  # fmt: skip
    }
    report: dict = {"machine": machine(), "file": str(path), "args": vars(args), "rounds": []}
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        print(f"round {r + 1}: {' then '.join(order)}", flush=True)
        report["rounds"].append({label: run(label, servers[label], docs, logs) for label in order})
    for i, rnd in enumerate(report["rounds"], 1):
        w, lc = rnd["weir"], rnd["llama.cpp"]
        pairs = [(a, b) for x, y in zip(w["scores"], lc["scores"]) for a, b in zip(x, y)]
        gap = max(abs(a - b) for a, b in pairs)
        same = all(
            sorted(range(len(x)), key=lambda j: -x[j]) == sorted(range(len(y)), key=lambda j: -y[j])
            for x, y in zip(w["scores"], lc["scores"])
        )
        print(
            f"round {i}: weir {w['docs_s']:.2f} docs/s, llama.cpp {lc['docs_s']:.2f} "
            f"({w['docs_s'] / lc['docs_s']:.2f}x); scores at most {gap:.4f} apart, "
            f"same order: {same}"
        )
    print("saved", save("rerank_gguf", report))


if __name__ == "__main__":
    main()
