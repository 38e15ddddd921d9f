"""PoolingParams: what an embedding or classification request asks of the engine instead of
sampling. The prompt is run through the model (chunked and scheduled like any prompt) and its
final hidden states are pooled into one vector (or, for a sequence-classification model, its last
token's row is put through the classifier's head: one raw logit a label); nothing is
generated."""

from __future__ import annotations

import math

import msgspec

KINDS = ("last", "mean", "cls")  # embeddings
CLASSIFY = "classify"  # a sequence classifier's logits, from its last token


class PoolingParams(msgspec.Struct, frozen=True, gc=False):
    kind: str = "last"  # last token (decoder models), mean of all tokens, the first (CLS), or
    # CLASSIFY
    normalize: bool = True  # to unit length (after `dimensions`)
    dimensions: int | None = None  # Matryoshka: keep the first N, then normalize
    # BERT's token types: from this position on, the input is its pair's second text (type 1);
    # None: one text. Read by encoders with token types only (a pair encoding's own fact).
    type_start: int | None = None

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read hidden states the prefix cache cannot give back."""
        return self.kind in ("mean", "cls")


class ModelPooling(msgspec.Struct, frozen=True, gc=False):
    """What the engine's model says of its own vectors, for the embedding default where its
    folder has no sentence-transformers files (a GGUF file): the kind its `pooling_type` names
    (None: none named; an encoder's: CLS) and the vector's size. `encoder`: the model embeds
    (or, a classifier, classifies) and never generates (BERT, XLM-RoBERTa)."""

    kind: str | None
    hidden_size: int
    encoder: bool = False


def activated(logits: list[float], on: bool) -> list[float]:
    """A classifier's probabilities as transformers' pipelines give them: the sigmoid of a lone
    logit, else the softmax over the labels (`on` false: the logits as they are)."""
    if not on:
        return logits
    if len(logits) == 1:
        x = logits[0]  # the sigmoid, computed without overflow either way
        return [1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    total = sum(e)
    return [x / total for x in e]
