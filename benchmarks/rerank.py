"""Reranking: documents scored per second by weir's /rerank beside transformers' cross-encoder
(what sentence-transformers' CrossEncoder runs), on the same one-label classifier.

The classifier is a benchmark shape's random decoder under a random one-row head
(`*ForSequenceClassification`, built once into the cache). Q queries of ~12 words, each with D
documents of 40..160 words (random words of the tokenizer's vocabulary, seeded); each pair is
the tokenizer's pair encoding on both sides. weir: `weir serve` on the classifier, one /rerank
request a query (every query in flight at once, as many users' searches), float32, the same
torch threads. transformers: every pair sorted by length and padded per batch, at the best of
several batch sizes (picked on the first 100 pairs). Scores are compared pair by pair.

    python -m benchmarks.rerank [--model qwen3-6layer] [--queries 16] [--docs 25]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import httpx
import torch
import trio

from benchmarks.common import bench_model, machine, save
from benchmarks.loadgen import ServerProcess, free_port


def classifier(name: str):
    """The shape's model as a one-label classifier, in the cache beside it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = Path(bench_model(name))
    path = base.parent / (base.name + "-rerank")
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.05)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        tmp.rename(path)
    return path


def texts(tokenizer, n: int, words: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(*words))) for _ in range(n)]


def run_weir(path, queries, docs, threads: int) -> tuple[float, list[list[float]]]:
    port = free_port()
    argv = [sys.executable, "-m", "server", "serve", str(path), "--port", str(port)]
    argv += ["--cpu-threads", str(threads), "--disable-log-requests", "--disable-log-stats"]
    srv = ServerProcess(argv, port, "/tmp/weir-rerank.log")
    url = srv.url + "/rerank"
    try:
        srv.wait_ready()
        httpx.post(url, json={"query": queries[0], "documents": docs[0][:4]}, timeout=600)
        scores: list[list[float]] = [[] for _ in queries]

        async def one(client, i: int) -> None:
            r = await client.post(url, json={"query": queries[i], "documents": docs[i]})
            r.raise_for_status()
            by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            scores[i] = [by_index[j] for j in range(len(docs[i]))]

        async def all_queries() -> None:
            async with httpx.AsyncClient(timeout=3600) as client, trio.open_nursery() as n:
                for i in range(len(queries)):
                    n.start_soon(one, client, i)

        t = time.perf_counter()
        trio.run(all_queries)
        return time.perf_counter() - t, scores
    finally:
        srv.stop()


def run_transformers(model, pairs: list[list[int]], batch: int) -> tuple[float, list[float]]:
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i]))
    out = [0.0] * len(pairs)
    pad = model.config.pad_token_id or 0
    t = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            width = max(len(pairs[i]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : len(pairs[i])] = torch.tensor(pairs[i])
                mask[row, : len(pairs[i])] = 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(idx)), mask.sum(1) - 1]  # right-padded: last real
            for row, i in enumerate(idx):
                out[i] = torch.sigmoid(model.score(last[row])).item()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-6layer")
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--docs", type=int, default=25)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = classifier(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    queries = texts(tok, args.queries, (8, 16), seed=1)
    docs = [texts(tok, args.docs, (40, 160), seed=100 + i) for i in range(args.queries)]
    pairs = [tok(text=q, text_pair=d)["input_ids"] for q, ds in zip(queries, docs) for d in ds]
    n, tokens = len(pairs), sum(len(p) for p in pairs)
    print(f"{args.queries} queries x {args.docs} documents: {n} pairs, {tokens} tokens")

    weir_s, weir_scores = run_weir(path, queries, docs, args.threads)
    print(f"weir /rerank: {weir_s:.2f} s, {n / weir_s:.1f} pairs/s")
    torch.set_num_threads(args.threads)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    trial = {
        int(b): run_transformers(model, pairs[:100], int(b))[0] for b in args.batch_sizes.split(",")
    }
    best = min(trial, key=trial.get)
    hf_s, hf_scores = run_transformers(model, pairs, best)
    print(f"transformers (batch {best}): {hf_s:.2f} s, {n / hf_s:.1f} pairs/s")
    flat = [s for row in weir_scores for s in row]
    diff = max(abs(a - b) for a, b in zip(flat, hf_scores))
    print(f"weir / transformers: {hf_s / weir_s:.2f}x; largest score difference {diff:.2e}")
    save(
        "rerank",
        {
            "machine": machine(),
            "model": args.model,
            "pairs": n,
            "tokens": tokens,
            "threads": args.threads,
            "weir_s": weir_s,
            "transformers_s": hf_s,
            "transformers_batch": best,
            "transformers_trials": trial,
            "max_score_difference": diff,
        },
    )


if __name__ == "__main__":
    main()
