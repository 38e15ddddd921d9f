"""Embeddings: inputs per second, weir's engine beside transformers with the same pooling.

1,000 inputs of random token ids, 64 to 512 tokens long (seeded), last-token pooling,
normalised, float32 on CPU, the same torch threads on both sides:

- weir: `LLM.embed` (the engine: inputs scheduled as prompt-only requests under the token
  budget, pooled in the runner), and through the server (`--runner pooling`, one
  /v1/embeddings request carrying every input, base64).
- transformers: `AutoModel` with inputs sorted by length (as sentence-transformers' `encode`
  does) and padded per batch, at the best of several batch sizes (picked on the first 200
  inputs, then run on all).
- the roofline: the model's matrix products for these tokens, timed at this machine's measured
  speed for a product of the model's shapes.

    python -m benchmarks.embeddings [--model qwen3-6layer] [--inputs 1000]
"""

from __future__ import annotations

import argparse
import base64
import functools
import os
import random
import subprocess
import sys
import time

import httpx
import torch
import torch.nn.functional as F

from benchmarks.common import bench_model, machine, save
from core.pooling import PoolingParams


def inputs(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def flops_per_token(config: dict, context: float) -> float:
    """Matrix-product FLOPs of one token: the projections and MLP, plus attention over
    `context` positions on average."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    weights = h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"]
    attention = 2 * q * context  # scores and the weighted sum
    return layers * 2 * (weights + attention)


def matmul_speed(config: dict, threads: int, tokens: int = 2048) -> float:
    """FLOP/s of one layer's products at the model's shapes (fused QKV, O, fused gate-up,
    down) on `tokens` rows: the best of ten timings, by MKL (torch's linear) or oneDNN with
    prepacked weights (gpu/cpu/onednn.py, what weir runs), whichever is faster here."""
    from gpu.cpu import onednn as cpu_linear

    torch.set_num_threads(threads)
    h, m = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * m), (m, h)]
    linears = [torch.nn.Linear(k, n, bias=False) for k, n in shapes]
    ways = [linears]
    if cpu_linear.usable(torch.float32):
        packed = [cpu_linear.prepare(lin.weight, None) for lin in linears]
        ways.append([functools.partial(cpu_linear.linear, w=w) for w in packed])
    xs = [torch.randn(tokens, k) for k, _ in shapes]
    flops = sum(2 * tokens * k * n for k, n in shapes)
    best = float("inf")
    with torch.inference_mode():
        for way in ways:
            for i in range(13):
                t = time.perf_counter()
                for x, lin in zip(xs, way):
                    lin(x)
                if i >= 3:
                    best = min(best, time.perf_counter() - t)
    return flops / best


def run_weir(path: str, data: list[list[int]], threads: int) -> tuple[float, list[list[float]]]:
    from weir.llm import LLM

    llm = LLM(path, cpu_threads=threads, max_num_seqs=256, max_num_batched_tokens=2048)
    llm.embed(data[:20], use_tqdm=False)  # warm up
    t = time.perf_counter()
    outs = llm.embed(data, PoolingParams("last"), use_tqdm=False)
    return time.perf_counter() - t, [o.outputs.embedding for o in outs]


def run_server(path: str, data: list[list[int]], threads: int, port: int = 8712) -> float:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            path,
            "--port",
            str(port),
            "--runner",
            "pooling",
            "--cpu-threads",
            str(threads),
            "--disable-log-requests",
            "--disable-log-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return time_server(proc, f"http://127.0.0.1:{port}", data)
    finally:
        proc.terminate()
        proc.wait(60)


def time_server(proc, url: str, data: list[list[int]], model: str | None = None) -> float:
    """Seconds for one /v1/embeddings request of every input (base64) at `url`, once the
    server `proc` answers /health (6 minutes at most) and has embedded a warm-up request."""
    for _ in range(1800):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered")
        time.sleep(0.2)
    body = {"input": data[:20], "encoding_format": "base64", **({"model": model} if model else {})}
    httpx.post(url + "/v1/embeddings", json=body, timeout=600).raise_for_status()
    t = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json={**body, "input": data}, timeout=3600)
    elapsed = time.perf_counter() - t
    r.raise_for_status()
    assert len(r.json()["data"]) == len(data)
    base64.b64decode(r.json()["data"][0]["embedding"])
    return elapsed


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each padded row's last real token's state."""
    return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]


def run_transformers(
    model, data: list[list[int]], batch: int, pool=last_token
) -> tuple[float, list]:
    """`data` through `model` in padded batches sorted by length, as sentence-transformers
    encodes; `pool(hidden, mask)` gives each row's vector (normalised after)."""
    order = sorted(range(len(data)), key=lambda i: -len(data[i]))  # as sentence-transformers
    out: list = [None] * len(data)
    t = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            width = max(len(data[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : len(data[i])] = torch.tensor(data[i])
                mask[row, : len(data[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            vectors = F.normalize(pool(hidden, mask).float(), dim=-1)
            for row, i in enumerate(idx):
                out[i] = vectors[row]
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-6layer")
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--batch-sizes", default="4,16,64")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()
    path = bench_model(args.model)
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path).to_dict()
    data = inputs(args.inputs, min(config["vocab_size"], 2048))
    tokens = sum(len(x) for x in data)
    context = sum(len(x) * (len(x) + 1) / 2 for x in data) / tokens
    speed = matmul_speed(config, args.threads)
    roofline = tokens * flops_per_token(config, context) / speed
    print(
        f"{args.inputs} inputs, {tokens} tokens; {speed / 1e9:.0f} GFLOP/s; "
        f"roofline {roofline:.1f} s"
    )

    weir_s, weir_vecs = run_weir(path, data, args.threads)
    print(f"weir engine: {weir_s:.1f} s, {args.inputs / weir_s:.1f} inputs/s")
    server_s = None if args.no_server else run_server(path, data, args.threads)
    if server_s:
        print(f"weir server: {server_s:.1f} s, {args.inputs / server_s:.1f} inputs/s")

    torch.set_num_threads(args.threads)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    trial = {}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        trial[b] = run_transformers(model, data[:200], b)[0]
        print(f"transformers batch {b}: {200 / trial[b]:.1f} inputs/s on the first 200")
    best = min(trial, key=trial.get)
    hf_s, hf_vecs = run_transformers(model, data, best)
    print(f"transformers (batch {best}): {hf_s:.1f} s, {args.inputs / hf_s:.1f} inputs/s")
    cos = min(
        F.cosine_similarity(torch.tensor(w), h, dim=0).item()
        for w, h in zip(weir_vecs[:50], hf_vecs[:50])
    )
    result = {
        "machine": machine(),
        "model": args.model,
        "inputs": args.inputs,
        "tokens": tokens,
        "threads": args.threads,
        "gflops": speed / 1e9,
        "roofline_s": roofline,
        "weir_engine_s": weir_s,
        "weir_server_s": server_s,
        "transformers_s": hf_s,
        "transformers_batch": best,
        "transformers_trials": trial,
        "min_cosine": cos,
    }
    print(
        f"weir/transformers: {hf_s / weir_s:.2f}x (engine)"
        + (f", {hf_s / server_s:.2f}x (server)" if server_s else "")
        + f"; weir at {roofline / weir_s:.0%} of the roofline; min cosine {cos:.6f}"
    )
    save("embeddings", result)


if __name__ == "__main__":
    main()
