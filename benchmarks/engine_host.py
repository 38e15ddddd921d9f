"""The engine's own host time per decode step, with a model runner that returns tokens at once:
scheduling, token bookkeeping, detokenization, stop checks and outputs, per sequence. On a GPU
this runs while the device waits (the H100 offline protocol spent 5.6-7 ms of host time per
step at batch 256 beside an 11 ms forward).

    python -m benchmarks.engine_host [--shapes 64x200,256x600] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from core.engine_core import EngineCore
from core.request import EngineRequest, StepResult
from core.sampling import SamplingParams


class InstantRunner:
    """Sampled ids from a fixed random sequence, no model."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_labels = 0  # a causal LM
        rng = random.Random(0)
        self._ids = [rng.randrange(10, vocab_size) for _ in range(4096)]
        self._at = 0

    def execute(self, out, grammar=None) -> StepResult:
        n = sum(1 for s in out.scheduled if s.sample)
        at = self._at
        self._at = (at + n) % 3072
        return StepResult(self._ids[at : at + n], [None] * n)


def run(tokenizer, num_seqs: int, prompt_len: int, steps: int, profile: bool) -> float:
    vocab = tokenizer.get_vocab_size()
    core = EngineCore(
        InstantRunner(vocab),
        tokenizer,
        num_blocks=num_seqs * ((prompt_len + steps) // 16 + 2),
        block_size=16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs * prompt_len,
        max_model_len=prompt_len + steps + 16,
    )
    rng = random.Random(1)
    for i in range(num_seqs):
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        core.add(EngineRequest(str(i), prompt, params))
    core.step()  # every prompt in one step
    profiler = cProfile.Profile() if profile else None
    times = []
    while core.has_work:
        if profiler is not None:
            profiler.enable()
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x200,256x600")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from gpu.tiny_model import ensure_tiny_model

    tokenizer = Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))
    for shape in args.shapes.split(","):
        n, p = map(int, shape.split("x"))
        best = min(run(tokenizer, n, p, args.steps, args.profile) for _ in range(args.rounds))
        print(
            f"{n} sequences x {p} prompt tokens: decode step {best * 1e3:.3f} ms "
            f"({best / n * 1e6:.2f} µs a sequence; best of {args.rounds})"
        )


if __name__ == "__main__":
    main()
