"""The step protocol: what the scheduler hands the model runner each step, and nothing else.

One msgspec Struct, the same object for the runner in the engine's process and for every
tensor-parallel rank (the executor sends it as it is). It carries no engine object: the runner
keeps its own copy of each request (gpu/runner_state.py), built from `new` and grown from each
step's `scheduled` entries, so a field the runner reads reaches every rank or none.

Per step, applied in this order:
- `forks`: beams of a beam search (core/beam.py) that continue another beam: each `dst` becomes
  a copy of `src` as it was before this step's forks (its first `num_tokens` token ids and
  `num_blocks` block ids); the entry scheduling it then brings the rest.
- `finished`: requests the runner has seen that have since finished or been aborted: forget.
- `new`: requests scheduled for the first time: their prompt, sampling and pooling parameters,
  and their LoRA adapter (fixed for a request's life, like its sampling parameters).
- `preempted`: requests whose blocks were freed this step (their tokens stay known).
- `resumed`: preempted requests scheduled again: their block table starts over (the entry's
  `new_block_ids` is the whole table).
- `copies`: (src, dst) block pairs whose K/V the runner copies, on every layer, before the
  forward: a beam writing into a partial block it shared writes into its own copy instead.
- `scheduled`: the batch, in row order: where each request's new tokens start, how many, whether
  its last row is sampled, the tokens the runner has not been given yet (those sampled since
  the request last ran) and its new block ids.

Under asynchronous scheduling the engine schedules step N+1 before it has seen what step N
sampled: an entry whose last token is that sample says `pending`, and the runner fills it in from
its own previous step (replaced by the real id in `new_token_ids` the next time the request runs).
With speculative decoding an entry carries `draft_token_ids`: proposals after its known tokens;
every row from its last known token on gives logits, and the result says which it kept.

Grammar state stays with the engine (llguidance's matchers): it hands the runner a GrammarBatch,
which fills the constrained rows' bitmask while the forward runs.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from core.lora import LoraRef
from core.pooling import PoolingParams
from core.sampling import SamplingParams


class NewRequest(msgspec.Struct, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    pooling: PoolingParams | None = None
    lora: LoraRef | None = None  # the adapter its rows run with (core/lora.py), or the base


class ScheduledRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    start: int  # position of the first token computed this step
    num_new_tokens: int
    sample: bool  # the chunk reaches the end of the known tokens: its last row gives logits
    new_token_ids: list[int]  # appended to the runner's tokens before this step runs
    new_block_ids: list[int]  # appended to its block table (the whole table when resumed)
    # Asynchronous scheduling: the last token of this chunk is the one the runner sampled for
    # the request in its previous step, which the engine has not seen yet; the runner takes it
    # from that step's sampled ids, where it still is (on the GPU).
    pending: bool = False
    # Speculative decoding: proposed tokens after the known ones, computed in this chunk (its
    # last len(draft_token_ids) inputs) and verified by the sampler; never kept by the runner.
    draft_token_ids: list[int] = []


class Fork(msgspec.Struct, array_like=True, gc=False):
    dst: str
    src: str
    num_tokens: int
    num_blocks: int


class SchedulerOutput(msgspec.Struct, gc=False):
    finished: list[str]
    new: list[NewRequest]
    preempted: list[str]
    resumed: list[str]
    scheduled: list[ScheduledRequest]
    forks: list[Fork] = []
    copies: list[tuple[int, int]] = []

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class GrammarBatch:
    """The sampled rows this step that have a grammar, and how to fill their bitmask: `fill`
    writes [len(rows), words] int32 at a pointer (llguidance, off the interpreter lock)."""

    __slots__ = ("rows", "words", "fill")

    def __init__(self, rows: list[int], words: int, fill: Callable[[int], None]) -> None:
        self.rows = rows
        self.words = words
        self.fill = fill
