"""weir's offline Python API: `from weir import LLM, SamplingParams` (and `Constraint` for
structured outputs: `SamplingParams(structured=Constraint("regex", "[a-z]+"))`; `BeamSearchParams`
for `LLM.beam_search`; `PoolingParams` and the pooled outputs for `LLM.embed`, `LLM.classify` and
`LLM.score`, and `LLM.encode`, vLLM's general pooling call)."""

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
from weir.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
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
    "PoolingParams",
    "PoolingRequestOutput",
    "PoolingOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ClassificationRequestOutput",
    "ClassificationOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
]
