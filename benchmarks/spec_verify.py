"""What verifying k proposals costs against a plain decode step, for one stream: the step's time
with k + 1 rows (speculative decoding's verification) against 1 row, on the same model and
context, alternated over rounds. A decode step at one stream reads every weight for one token,
so on a model whose weights do not fit in cache the k extra rows are nearly free: that is what
makes speculation pay when proposals are accepted.

    python -m benchmarks.spec_verify [--model 1b] [--k 1,2,4,8] [--rounds 3] [--context 512]

--model 1b: the 1B-class Llama of benchmarks/real_checkpoints.py (bf16, ~2 GB: weir's bf16
kernels); any bench shape or model directory otherwise. Proposals are fixed tokens (every one
rejected, so each step verifies k + 1 rows again at the same context). Writes
benchmarks/results/spec_verify.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import bench_model, machine, save


def step_times(core, k: int, context: int, steps: int) -> list[float]:
    """Seconds per decode step of one request at `context` tokens, proposing k tokens each step
    (k = 0: a plain decode)."""
    from core.request import EngineRequest
    from core.sampling import SamplingParams
    from core.speculative import Speculator

    def propose(self, requests):
        for r in requests:
            decoding = r.num_computed_tokens == r.num_tokens - 1
            r.spec_token_ids = [7] * k if k and decoding else []

    real = Speculator.propose
    Speculator.propose = propose
    try:
        prompt = [(13 * j) % 1000 + 10 for j in range(context)]
        params = SamplingParams(temperature=0, max_tokens=steps * (k + 1) + 8, ignore_eos=True)
        core.add(EngineRequest(f"k{k}-{time.monotonic_ns()}", prompt, params))
        while core.scheduler.running and core.scheduler.running[0].num_output_tokens == 0:
            core.step()  # the prompt
        core.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        for rid in list(core.requests):
            core.abort(rid)
        return times
    finally:
        Speculator.propose = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--k", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from weir import LLM

    if args.model == "1b":
        from benchmarks.real_checkpoints import model_of

        model = str(model_of("llama-1b"))
    else:
        model = bench_model(args.model)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 16})
    llm = LLM(model, speculative_config=spec, max_num_seqs=4, enable_prefix_caching=False)
    core = llm.engine
    ks = [0, *map(int, args.k.split(","))]
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(args.rounds):
        for k in ks if r % 2 == 0 else reversed(ks):
            times[k].append(statistics.median(step_times(core, k, args.context, args.steps)))
    base = statistics.median(times[0])
    print(f"{machine()['cpu']}, {args.model}, one stream at {args.context} tokens of context")
    rows = {}
    for k in ks:
        med = statistics.median(times[k])
        rows[k] = {"step_ms": med * 1e3, "vs_one_row": med / base, "rounds_ms": times[k]}
        print(
            f"  {k + 1} rows (k = {k}): {med * 1e3:.1f} ms a step, {med / base:.2f}x one row; "
            f"with every proposal accepted {(k + 1) / (med / base):.2f} tokens per one-row step"
        )
    save("spec_verify", {"meta": {**machine(), **vars(args)}, "rows": rows})


if __name__ == "__main__":
    main()
