"""Speculative decoding beside llama.cpp's llama-server, one stream over HTTP, on the copy
models of benchmarks/spec_copy.py (acceptance known: the model copies its prompt).

Six servers, one at a time (rounds alternate their order): weir and llama-server each without
speculation, with n-gram proposals (weir's `ngram`, llama.cpp's `--spec-type ngram-simple`, both
looking up the last 3 tokens and proposing 4) and with the 2-layer copy model as a draft (k = 4
on both). Each serves `--streams` streaming completions one after another (a prompt of token
ids: x then the separator; 32 tokens out, greedy, `ignore_eos`), measured by the client: output
tok/s over the request's whole time, and the decode rate (tokens after the first over the time
after it). Every server's text is checked against weir's without speculation (but for a
trailing incomplete UTF-8 sequence: llama-server drops it, weir sends U+FFFD).

    python -m benchmarks.spec_peer [--rounds 3] [--streams 5] [--pad-mlp 32768]

Needs `make peer-llama-cpp` (LLAMA_CPP_HOME as there). Writes benchmarks/results/spec_peer.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from benchmarks.common import machine, save
from benchmarks.loadgen import ServerProcess, free_port, weir_argv
from benchmarks.spec_copy import HIGH, LOW, SEP, models, options

PEER = Path(__file__).parent / "peers" / "llama_cpp.sh"
NAME = "copy"


def gguf(model: Path) -> Path:
    """The model as llama.cpp's converter writes it (float32, cached by llama_cpp.sh)."""
    out = subprocess.run(
        [str(PEER), "gguf", str(model)],
        env={**os.environ, "LLAMA_CPP_QUANT": "f32"},
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def servers(target: Path, draft: Path, k: int) -> dict[str, Callable[[int], list[str]]]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    limit = {"disable_by_batch_size": 1}

    def weir(config):
        extra = ["--served-model-name", NAME]
        if config:
            extra += ["--speculative-config", json.dumps({**config, **limit})]
        return lambda port: weir_argv(str(target), port, *extra)

    big, small = gguf(target), gguf(draft)

    def llama(*extra):
        return lambda port: [str(PEER), "serve-file", str(big), str(port), NAME, *extra]

    n = ["--spec-draft-n-max", str(k)]
    return {
        "weir off": weir(None),
        "weir ngram": weir(ngram),
        "weir draft": weir(drafted),
        "llama.cpp off": llama(),
        "llama.cpp ngram": llama(
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            "3",
            "--spec-ngram-simple-size-m",
            str(k),
            *n,
        ),  # fmt: skip
        "llama.cpp draft": llama(
            "-md", str(small), "--spec-type", "draft-simple", "--spec-draft-n-min", "0", *n
        ),  # fmt: skip
    }


def stream(client: httpx.Client, ids: list[int], length: int) -> tuple[float, float, str]:
    """(output tok/s over the request, decode tok/s after the first token, the text). One
    client a server: a new httpx client costs ~25 ms (its TLS context) before the request."""
    body = {
        "model": NAME,
        "prompt": ids,
        "max_tokens": length,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, first = [], None
    t = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            piece = "".join(c.get("text") or "" for c in choices)
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    return length / (end - t), (length - 1) / (end - first), "".join(text)


def main() -> None:
    args = options(__doc__)
    target, draft = models(args)
    table = servers(target, draft, args.k)
    prompts = []
    for i in range(args.streams):
        g = torch.Generator().manual_seed(1000 + i)
        prompts.append(torch.randint(LOW, HIGH, (args.length,), generator=g).tolist() + [SEP])
    rates = {name: [] for name in table}
    decode = {name: [] for name in table}
    texts: dict[str, list[str]] = {}
    names = list(table)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            port = free_port()
            log = f"/tmp/weir-spec-peer-{name.replace(' ', '-').replace('.', '')}.log"
            server = ServerProcess(table[name](port), port, log)
            try:
                server.wait_ready()
                with httpx.Client(base_url=server.url, timeout=300) as client:
                    stream(client, prompts[0][:8], 4)  # warm up
                    runs = [stream(client, p, args.length) for p in prompts]
            finally:
                server.stop()
            rates[name].append(len(runs) / sum(1 / a for a, _, _ in runs))
            decode[name].append(len(runs) / sum(1 / d for _, d, _ in runs))
            texts[name] = [t for _, _, t in runs]
            print(f"  round {r}: {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    want = texts["weir off"]
    print(f"{machine()['cpu']}, {machine()['cores']} cores: one stream, {args.length} tokens")
    summary = {}
    for name in names:
        own = name.split()[0]
        base, base_d = (statistics.median(x[f"{own} off"]) for x in (rates, decode))
        med, dec = statistics.median(rates[name]), statistics.median(decode[name])
        # llama-server drops a trailing incomplete UTF-8 sequence where weir sends U+FFFD
        agree = sum(
            a.rstrip("\ufffd") == b.rstrip("\ufffd") for a, b in zip(texts[name], want)
        ) / len(want)
        summary[name] = {"tok_s": med, "decode_tok_s": dec, "same_text": agree}
        print(
            f"  {name}: {med:.1f} tok/s ({med / base:.2f}x its own off), decode {dec:.1f} tok/s "
            f"({dec / base_d:.2f}x), text as weir off: {agree:.0%}"
        )
    save(
        "spec_peer",
        {"meta": {**machine(), **vars(args)}, "rates": rates, "decode": decode, "summary": summary},
    )


if __name__ == "__main__":
    main()
