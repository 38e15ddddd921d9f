"""Render benchmarks/results/*.json into docs/benchmarks.md (between BEGIN/END markers, so the
hand-written readings around them stay) and draw the plots next to it (docs/img/*.png)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def fmt(v, digits=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def meta_line(m: dict) -> str:
    where = m.get("gpu") or f"{m.get('cpu')} ({m.get('cores')} cores, CPU only)"
    return f"Run {m.get('date')} on {where}, commit {m.get('commit')}, torch {m.get('torch')}."


def offline_section(d: dict) -> str:
    w, h, eager = d["weir"], d["transformers"], d.get("weir_eager")
    mode = " with CUDA graphs" if w.get("cuda_graphs") else ""
    extra = []
    if eager:
        extra.append(f"| weir, `--enforce-eager` (no CUDA graphs) | {fmt(eager['tok_s'])} |")
    bound = []
    for label, run in (("", w), (" (eager)", eager)):
        if run and "bound_per_step_ms" in run:
            bound.append(
                f"Decode step{label} at batch {run['largest_batch']}: "
                f"{fmt(run['forward_per_step_ms'], 2)} ms, memory-bandwidth bound "
                f"{fmt(run['bound_per_step_ms'], 2)} ms ({fmt(run['weight_bytes'] / 1e9, 2)} GB "
                f"of weights + K/V of {fmt(run['median_context_tokens'], 0)} context tokens at "
                f"{fmt(run['bandwidth_gb_s'], 0)} GB/s, a device-to-device copy measured in the "
                "same run)."
            )
    rows = [
        f"| transformers `generate`, batch {b} | {fmt(r['tok_s'])} |"
        for b, r in sorted(h["runs"].items(), key=lambda kv: int(kv[0]))
    ]
    return "\n".join(
        [
            meta_line(d["meta"]),
            f"Model `{d['meta']['model']}`, {d['meta']['requests']} requests, input lengths "
            f"{d['meta']['input_len']}, output lengths {d['meta']['output_len']} (uniform), "
            f"`ignore_eos`, greedy, {d['meta'].get('dtype', 'float32')}.",
            "",
            "| engine | output tok/s |",
            "| --- | --- |",
            f"| **weir** (continuous batching, up to {w['largest_batch']} at once{mode}) | "
            f"**{fmt(w['tok_s'])}** |",
            *extra,
            *rows,
            "",
            *(
                [
                    f"Repeated {d['meta']['repeats']} times, interleaved: weir "
                    + ", ".join(fmt(x) for x in w["tok_s_runs"])
                    + f" tok/s; transformers batch {h['best_batch']} "
                    + ", ".join(fmt(x) for x in h["tok_s_runs"])
                    + " tok/s. The ratio is of the medians.",
                ]
                if w.get("tok_s_runs")
                else []
            ),
            "",
            f"weir / best transformers batch ({h['best_batch']}): **{d['ratio']:.2f}x**. "
            f"Engine overhead per step at batch {w['largest_batch']}: "
            f"{fmt(w['overhead_per_step_ms'], 2)} ms beside {fmt(w['forward_per_step_ms'])} ms of "
            f"model forward ({100 * w['overhead_per_step_ms'] / w['forward_per_step_ms']:.1f}%).",
            *(["", *bound] if bound else []),
        ]
    )


def serving_section(d: dict) -> str:
    lines = [
        meta_line(d["meta"]),
        f"Model `{d['meta']['model']}`, greedy, max_tokens "
        f"{d['meta']['max_tokens']}, prompts of 8-40 words, tokens from the usage chunk.",
        "",
        "| server | concurrency | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for server, levels in d["results"].items():
        for c, s in levels.items():
            lines.append(
                f"| {server} | {c} | {fmt(s['output_tok_s'])} | {fmt(s['ttft_p50_ms'])} / "
                f"{fmt(s['ttft_p99_ms'])} | {fmt(s['tpot_p50_ms'])} / {fmt(s['tpot_p99_ms'])} | "
                f"{fmt(s['itl_p50_ms'])} / {fmt(s['itl_p99_ms'])} | {s['errors']} |"
            )
    repeats = d["meta"].get("repeats", 1)
    if repeats > 1:
        lines += [
            "",
            f"Each level ran {repeats} times per server; the table shows the run with the median "
            "output tok/s (errors: all runs). Every run's output tok/s:",
            "",
        ]
        for server, levels in d["results"].items():
            runs = "; ".join(
                f"{c}: " + ", ".join(f"{x:,.0f}" for x in s.get("tok_s_runs", []))
                for c, s in levels.items()
            )
            lines.append(f"- {server}: {runs}")
    ratios = d.get("ratio") or {}
    if ratios and not isinstance(next(iter(ratios.values())), dict):
        ratios = {"weir": ratios}  # results saved before weir ran in two modes
    if ratios:
        lines.append("")
    for label, by_level in ratios.items():
        lines.append(
            f"{label} / transformers output tok/s: "
            + ", ".join(f"{r:.2f}x at {c}" for c, r in by_level.items() if r)
            + "."
        )
    return "\n".join(lines)


def overhead_section(d: dict) -> str:
    lines = [
        meta_line(d["meta"]),
        "",
        "(a) Detokenization, µs per token (256 sequences):",
        "",
        "| length | DecodeStream | re-decode everything | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for length, r in d["detokenize"].items():
        lines.append(
            f"| {length} | {r['decodestream_us_per_token']:.2f} | "
            f"{r['redecode_us_per_token']:.1f} | {r['ratio']:.0f}x |"
        )
    s = d["sse"]
    lines += [
        "",
        f"(b) SSE chunk encoding: msgspec {s['msgspec_us']:.2f} µs, `json` "
        f"{s['json_us']:.2f} µs per chunk ({s['ratio']:.1f}x).",
        "",
    ]
    if "streams" in d:
        lines += [
            "(c) 256 concurrent streams, one-layer model, 128 tokens each:",
            "",
            "| SSE events | delivered tok/s | server CPU µs/token | of which HTTP / engine process "
            "| content events | errors |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for label, r in d["streams"].items():
            if "http_cpu_us_per_token" in r:
                split = f"{r['http_cpu_us_per_token']:.1f} / {r['engine_cpu_us_per_token']:.1f}"
            elif label == "http_stack_alone":
                split = "(no engine)"
            else:
                split = "(one process)"
            lines.append(
                f"| {label.replace('_', ' ')} | {fmt(r['output_tok_s'])} | "
                f"{r['server_cpu_us_per_token']:.1f} | {split} | {r['events']:,} | {r['errors']} |"
            )
    return "\n".join(lines)


def plots() -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    d = load("serving")
    if d:
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for server, levels in d["results"].items():
            cs = [int(c) for c in levels]
            ax[0].plot(cs, [levels[c]["output_tok_s"] for c in levels], marker="o", label=server)
            ax[1].plot(
                cs, [levels[c]["ttft_p50_ms"] or 0 for c in levels], marker="o", label=server
            )
        for a, title in zip(ax, ("output tokens/s", "TTFT p50 (ms)")):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrency")
            a.set_title(title)
            a.legend()
        fig.tight_layout()
        fig.savefig(IMG / "serving.png", dpi=100)
        made.append("serving.png")
    d = load("offline")
    if d:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = ["weir"] + [f"HF b={b}" for b in d["transformers"]["runs"]]
        values = [d["weir"]["tok_s"]] + [r["tok_s"] for r in d["transformers"]["runs"].values()]
        ax.bar(labels, values, color=["tab:blue"] + ["tab:gray"] * (len(values) - 1))
        ax.set_ylabel("output tokens/s")
        ax.set_title("Offline throughput")
        fig.tight_layout()
        fig.savefig(IMG / "offline.png", dpi=100)
        made.append("offline.png")
    return made


def replace_block(text: str, name: str, body: str) -> str:
    block = f"<!-- BEGIN {name} -->\n{body}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {name} -->.*?<!-- END {name} -->", re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    return text.rstrip() + f"\n\n{block}\n"


def main() -> None:
    text = DOC.read_text()
    for name, render in (
        ("offline", offline_section),
        ("serving", serving_section),
        ("overhead", overhead_section),
    ):
        d = load(name)
        if d:
            text = replace_block(text, name, render(d))
    made = plots()
    DOC.write_text(text)
    print(f"updated {DOC}" + (f"; plots: {', '.join(made)}" if made else ""))


if __name__ == "__main__":
    main()
