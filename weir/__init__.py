"""weir's offline Python API: `from weir import LLM, SamplingParams` (and `Constraint` for
structured outputs: `SamplingParams(structured=Constraint("regex", "[a-z]+"))`; `BeamSearchParams`
for `LLM.beam_search`)."""

from core.lora import LoRARequest
from core.structured import Constraint
from weir.llm import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "LLM",
    "SamplingParams",
    "Constraint",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
