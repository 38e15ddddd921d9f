"""--hf-overrides (vLLM's): JSON set over the checkpoint's config before anything reads it, as
vLLM applies it (a nested object updates the sub-config of that name). Its use a reranker's
model card gives: a causal LM served as a sequence classifier whose head is rows of its own LM
head, picked by `classifier_from_token` (the tokens' rows, one label each; with
`is_original_qwen3_reranker`, Qwen3-Reranker's two tokens ["no", "yes"] become one label, the
"yes" row less the "no" row, so that its sigmoid is the softmax's P("yes"))."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.config import CheckpointError


def apply(config: Any, overrides: dict[str, Any] | None, tokenizer_dir: Path) -> Any:
    for key, value in (overrides or {}).items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and current is not None and not isinstance(current, dict):
            for k, v in value.items():  # a sub-config (text_config, ...): its fields
                setattr(current, k, v)
        else:
            setattr(config, key, value)
    tokens = getattr(config, "classifier_from_token", None)
    if tokens is not None:
        _score_from_tokens(config, tokens, tokenizer_dir)
    return config


def _score_from_tokens(config: Any, tokens: Any, tokenizer_dir: Path) -> None:
    """The token ids of classifier_from_token, and the labels they make (num_labels, id2label)."""
    from transformers import AutoTokenizer

    archs = getattr(config, "architectures", None) or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise CheckpointError(
            "--hf-overrides: classifier_from_token needs a *ForSequenceClassification "
            f"architecture (this config has {archs})"
        )
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError("--hf-overrides: classifier_from_token must be a list of tokens")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    ids = []
    for token in tokens:
        encoded = tokenizer.convert_tokens_to_ids(token)
        if encoded is None or encoded == tokenizer.unk_token_id:
            raise CheckpointError(f"--hf-overrides: classifier_from_token {token!r} is no token")
        ids.append(int(encoded))
    difference = bool(getattr(config, "is_original_qwen3_reranker", False))
    if difference and len(ids) != 2:
        raise CheckpointError(
            "--hf-overrides: is_original_qwen3_reranker needs two classifier_from_token "
            '(["no", "yes"])'
        )
    names = [tokens[1]] if difference else tokens
    config.weir_score_token_ids = ids
    config.weir_score_difference = difference
    config.num_labels = len(names)  # (transformers' setter makes LABEL_i names: ours follow)
    config.id2label = dict(enumerate(names))


class ScoreRows:
    """A classifier head made of LM-head rows (classifier_from_token), picked as the loader
    reads the checkpoint: the LM head's rows, or the embeddings' where the head is tied."""

    NAMES = ("lm_head.weight", "model.embed_tokens.weight")

    def __init__(self, token_ids: tuple[int, ...], difference: bool) -> None:
        self.ids, self.difference = list(token_ids), difference
        self.rows: dict[str, Any] = {}

    def take(self, name: str, tensor: Any) -> None:
        """Keep the rows of the LM head or the embeddings (NAMES)."""
        self.rows[name] = tensor[self.ids].float()

    def head(self) -> Any:
        rows = self.rows.get("lm_head.weight", self.rows.get("model.embed_tokens.weight"))
        if rows is None:
            raise CheckpointError("classifier_from_token: the checkpoint has no LM head")
        return (rows[1] - rows[0])[None] if self.difference else rows
