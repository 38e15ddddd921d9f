"""How a served model embeds: the pooling kind (--pooling, else the checkpoint's
sentence-transformers files, else a GGUF file's pooling_type, else the last token, as decoder
embedding models such as Qwen3-Embedding are trained), normalisation, and the Matryoshka
dimensions the model allows. LLM.embed's default is the same."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.pooling import KINDS, ModelPooling

# sentence-transformers' Pooling config keys, in the order they are checked.
_ST_MODES = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)


@dataclass
class EmbeddingConfig:
    kind: str  # core/pooling.py KINDS
    normalize: bool
    hidden_size: int
    # Matryoshka: the dimensions a request may ask for (None: any from 1 to hidden_size; an
    # empty list: the model allows no `dimensions` other than its own size).
    matryoshka: list[int] | None

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served, or None."""
        if dimensions == self.hidden_size:
            return None
        if self.matryoshka == []:
            return (
                "this model was not trained for Matryoshka truncation (its config.json has no "
                f"matryoshka_dimensions); it gives {self.hidden_size} dimensions"
            )
        if not 1 <= dimensions <= self.hidden_size:
            return f"must be between 1 and {self.hidden_size}"
        if self.matryoshka is not None and dimensions not in self.matryoshka:
            return f"this model allows {', '.join(map(str, self.matryoshka))}"
        return None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_path: Path) -> str | None:
    """The pooling kind named by modules.json and its Pooling module's config.json. A mode
    weir does not pool by (max, mean over the square root of the length, weighted mean) or
    several at once (sentence-transformers then concatenates them) raises ValueError naming
    them: never pooled some other way without a word."""
    modules = _json(model_path / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            config = _json(model_path / module.get("path", "1_Pooling") / "config.json") or {}
            asked = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
            served = [kind for key, kind in _ST_MODES if key in asked]
            if len(asked) > 1 or (asked and not served):
                raise ValueError(
                    f"the sentence-transformers Pooling module asks for {', '.join(asked)}; "
                    "weir pools by one of last token, mean or CLS: give --pooling to choose"
                )
            return served[0] if served else None
    return None


def resolve(
    model_path: Path | None,
    pooling: str | None,
    normalize: bool,
    facts: ModelPooling | None = None,
) -> EmbeddingConfig:
    """`pooling`: --pooling; `facts`: the engine's (a GGUF file's pooling_type, the model's
    hidden size), used where the folder says nothing."""
    config = (_json(model_path / "config.json") if model_path else None) or {}
    kind = pooling or (sentence_transformers_pooling(model_path) if model_path else None)
    kind = kind or (facts.kind if facts is not None else None) or "last"
    if kind not in KINDS:
        raise ValueError(f"--pooling {kind!r} is unknown; weir has {', '.join(KINDS)}")
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
        matryoshka: list[int] | None = sorted(dims)
    elif config.get("is_matryoshka"):
        matryoshka = None
    else:
        matryoshka = []
    size = facts.hidden_size if facts is not None else int(config.get("hidden_size", 0))
    return EmbeddingConfig(kind, normalize, size, matryoshka)


def add_arguments(s) -> None:
    """`weir serve` flags of embeddings."""
    e = s.add_argument_group("embeddings (/v1/embeddings)")
    e.add_argument(
        "--enable-embeddings",
        action="store_true",
        help="serve /v1/embeddings beside generation from the same model",
    )
    e.add_argument(
        "--runner",
        default="generate",
        choices=["auto", "generate", "pooling"],
        help="vLLM's name: pooling serves embeddings only",
    )
    e.add_argument(
        "--convert",
        default=None,
        choices=["auto", "none", "embed"],
        help="vLLM's name: embed is --runner pooling",
    )
    e.add_argument(
        "--pooling",
        choices=["last", "mean", "cls"],
        default=None,
        help="how token states become one vector (default: the checkpoint's "
        "sentence-transformers config, else the last token)",
    )
    e.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="unit-length vectors (default on)",
    )
