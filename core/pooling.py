"""PoolingParams: what an embedding or classification request asks of the engine instead of
sampling. The prompt is run through the model (chunked and scheduled like any prompt) and its
final hidden states are pooled into one vector (or, for a sequence-classification model, its last
token's row is put through the classifier's head: one raw logit a label); nothing is
generated. The token-level kinds (vLLM's token_embed and token_classify tasks) give a row for
every token of the prompt instead: its hidden state, or a token classifier's logits."""

from __future__ import annotations

import math

import msgspec

KINDS = ("last", "mean", "cls")  # embeddings
CLASSIFY = "classify"  # a sequence classifier's logits, from its last token
TOKEN_EMBED = "token_embed"  # every token's final hidden state (each normalized)
TOKEN_CLASSIFY = "token_classify"  # a token classifier's logits for every token
PER_TOKEN = (TOKEN_EMBED, TOKEN_CLASSIFY)


class PoolingParams(msgspec.Struct, frozen=True, gc=False):
    kind: str = "last"  # last token (decoder models), mean of all tokens, the first (CLS),
    # CLASSIFY, or a PER_TOKEN kind
    normalize: bool = True  # to unit length (after `dimensions`)
    dimensions: int | None = None  # Matryoshka: keep the first N, then normalize
    # BERT's token types: from this position on, the input is its pair's second text (type 1);
    # None: one text. Read by encoders with token types only (a pair encoding's own fact).
    type_start: int | None = None

    @property
    def needs_every_position(self) -> bool:
        """Mean, CLS and token-level pooling read hidden states the prefix cache cannot give
        back."""
        return self.kind in ("mean", "cls") or self.kind in PER_TOKEN


class ModelPooling(msgspec.Struct, frozen=True, gc=False):
    """What the engine's model says of its own vectors, for the embedding default where its
    folder has no sentence-transformers files (a GGUF file): the kind its `pooling_type` names
    (None: none named; an encoder's: CLS) and the vector's size. `encoder`: the model embeds
    (or, a classifier, classifies) and never generates (BERT, XLM-RoBERTa)."""

    kind: str | None
    hidden_size: int
    encoder: bool = False
    # A classifier's activations (ACTIVATIONS), as vLLM reads its config: /classify's by
    # problem_type, /score's by sentence-transformers' CrossEncoder activation_fn
    classify_activation: str = "default"
    score_activation: str = "default"
    per_token: bool = False  # the classifier labels each token (a *ForTokenClassification)
    # BGE-M3's (BgeM3EmbeddingModel): its BOS and EOS ids, whose rows its token tasks leave
    # out as vLLM's do (token_classify, its sparse weights: both, one float a token;
    # token_embed, its ColBERT vectors: the BOS row only)
    m3_specials: tuple[int, int] | None = None


# "default": the softmax over the labels, a lone label's sigmoid; torch.nn's classes by name
ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax", "Tanh": "tanh"}
# (and "relu": BGE-M3's sparse weights)


def model_activations(config: dict) -> tuple[str, str]:
    """A classifier's (classify, score) activations from its config.json as vLLM reads them:
    problem_type regression gives the logits, multi_label_classification each one's sigmoid;
    a sentence-transformers CrossEncoder's `sentence_transformers.activation_fn` (or the older
    `sbert_ce_default_activation_function`: ms-marco-MiniLM's Identity) is its scores'. Raises
    ValueError for an activation that is not torch.nn's Identity, Sigmoid, Softmax or Tanh."""
    problem = config.get("problem_type")
    classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(
        problem, "default"
    )
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if not name:
        return classify, "default"
    short = str(name).rsplit(".", 1)[-1]
    if not str(name).startswith("torch.nn.") or short not in ACTIVATIONS:
        raise ValueError(
            f"the cross-encoder's activation_fn {name!r} is not served "
            f"(torch.nn's {', '.join(ACTIVATIONS)})"
        )
    return classify, ACTIVATIONS[short]


def activated(logits: list[float], on: bool, fn: str = "default") -> list[float]:
    """A classifier's probabilities as transformers' pipelines give them: the sigmoid of a lone
    logit, else the softmax over the labels; or the model's own activation `fn` (ACTIVATIONS'
    names: model_activations); `on` false: the logits as they are."""
    if not on or fn == "identity":
        return logits
    if fn == "tanh":
        return [math.tanh(x) for x in logits]
    if fn == "relu":
        return [max(x, 0.0) for x in logits]
    if fn == "sigmoid" or (fn == "default" and len(logits) == 1):
        return [_sigmoid(x) for x in logits]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    total = sum(e)
    return [x / total for x in e]


def _sigmoid(x: float) -> float:
    """Computed without overflow either way."""
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def token_rows(values: list[float], ids: list[int], task: str, facts: ModelPooling | None):
    """A token task's answer for the prompt `ids` from its values (the rows one after another,
    one a token): a list of rows; BGE-M3's with its BOS (and, token_classify, EOS) rows left
    out, its sparse weights one float a token, as vLLM gives them."""
    width = len(values) // max(len(ids), 1)
    rows = [values[i * width : (i + 1) * width] for i in range(len(ids))]
    specials = facts.m3_specials if facts is not None else None
    if specials is None:
        return rows
    bos, eos = specials
    if ids and ids[0] == bos:
        rows, ids = rows[1:], ids[1:]
    if task == TOKEN_CLASSIFY:
        if ids and ids[-1] == eos:
            rows = rows[:-1]
        return [r[0] for r in rows]
    return rows
