"""What LLM's pooling calls (weir/pooling.py) take and give, as vLLM names them: the offline
PoolingParams, and each request's outputs (an embedding, a classifier's probabilities, a score,
or encode's data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from core.pooling import PoolingParams as EnginePoolingParams


class PoolingParams(EnginePoolingParams, frozen=True):
    """The engine's PoolingParams (core/pooling.py: kind, normalize, dimensions) with vLLM's
    offline fields: `use_activation` (a classifier's: False gives the raw logits, not
    probabilities), `truncate_prompt_tokens` (cut a prompt to that many tokens; -1: the model's
    length) and `truncation_side` (which it keeps: "right", vLLM's pooling default, its first
    tokens; "left" its last; a text's special tokens kept either way). `kind` None (the default)
    is the model's own, as the server's: its sentence-transformers files, a GGUF file's
    pooling_type, else the last token."""

    kind: str | None = None
    use_activation: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "right"


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # by label index (the raw logits under use_activation=False)
    label: str = ""  # the most likely label's name (the checkpoint's id2label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    """LLM.encode's (vLLM's): the pooled data, an embedding or a classifier's outputs; for
    the token-level tasks a list of them, one a token."""

    data: list[float] | list[list[float]]


Out = TypeVar("Out")
TASKS = ("embed", "classify", "token_embed", "token_classify")  # encode's, vLLM's names


@dataclass
class PoolingRequestOutput(Generic[Out]):
    """vLLM's: a request's `outputs` (one EmbeddingOutput, ClassificationOutput or
    ScoringOutput) and its prompt's tokens (a score's: the pair encoding, or the first text's)."""

    request_id: str
    outputs: Out
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
