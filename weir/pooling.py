"""LLM's pooling calls, as vLLM's: `embed` (one vector a prompt), `classify` (a sequence
classifier's label probabilities) and `score` (how well texts answer each other: a one-label
classifier, a cross-encoder, reads each pair as the tokenizer's pair encoding and scores it by its
logit's sigmoid; any other model embeds each text once and scores a pair by the cosine of its two
vectors). Each prompt is one engine request run for its pooled vector, nothing generated; results
come in the prompts' order. The server's /v1/embeddings, /classify and /score do the same."""

from __future__ import annotations

import array
import math
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import msgspec
from tqdm import tqdm

from core.engine_messages import AddRequest
from core.pooling import (
    CLASSIFY,
    KINDS,
    TOKEN_CLASSIFY,
    TOKEN_EMBED,
    ModelPooling,
    activated,
    token_rows,
)
from core.pooling import PoolingParams as EnginePoolingParams
from core.request import EngineRequest
from core.score_pairs import PairTooLong, pair_ids
from core.truncation import SIDES, cut_ids, cut_text
from core.sampling import InvalidParam, SamplingParams
from server import embedding_config
from weir.pooling_outputs import (
    TASKS,
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


class PoolingCalls:
    """Mixed into weir.llm.LLM, whose engine, tokenizer and request ids these use."""

    engine: Any
    tokenizer: Any
    max_model_len: int
    labels: list[str] | None
    score_template: str | None  # a reranker's prompt for its pairs (core/score_pairs.py)
    pooling: ModelPooling | None  # the model's own pooling facts (a GGUF file's kind)
    model_path: Path  # the model's folder or GGUF file
    _ids: Any
    _run: Callable[[deque, Callable], None]  # the engine loop over these requests

    def embed(
        self,
        prompts: str | list[str] | list[list[int]],
        pooling_params: EnginePoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text or token ids), pooled from the model's final hidden
        states (`pooling_params.kind`: last, mean or cls; normalized unless it says not)."""
        params = pooling_params or PoolingParams()
        if getattr(params, "use_activation", True) is not True:
            raise InvalidParam("use_activation", "use_activation is a classifier's; use classify")
        keep, side = self._keep(truncate_prompt_tokens, params)
        inputs = [self._ids_of(p, keep, side) for p in _listed(prompts)]
        ran = self._pool(inputs, self._engine_params(params), use_tqdm, "Embedding")
        return [
            PoolingRequestOutput(rid, EmbeddingOutput(array.array("f", v).tolist()), ids, cached)
            for (rid, v, cached), ids in zip(ran, inputs)
        ]

    def encode(
        self,
        prompts: str | list[str] | list[list[int]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """vLLM's general pooling call: each prompt's output for `pooling_task` ("embed": its
        vector, "classify": a classifier's probabilities, or logits under use_activation
        False; "token_embed" and "token_classify": the same for each of its tokens, a list a
        token), the model's own task where not named (a classifier classifies, a token
        classifier labels each token)."""
        per_token = getattr(self.engine, "per_token", False)
        own = "token_classify" if per_token else "classify"
        task = pooling_task or (own if self.engine.runner.num_labels else "embed")
        if task not in TASKS:
            raise InvalidParam("pooling_task", f"pooling_task {task!r}: {', '.join(TASKS)}")
        if task.startswith("token_"):
            return self._token_task(prompts, pooling_params, use_tqdm, task)
        if task == "embed":
            params = pooling_params or PoolingParams()
            if getattr(params, "use_activation", True) is False:  # (vLLM's name for normalize)
                params = msgspec.structs.replace(params, use_activation=True, normalize=False)
            done = self.embed(prompts, params, use_tqdm)
            data = [o.outputs.embedding for o in done]
        else:
            done = self.classify(prompts, pooling_params, use_tqdm)
            data = [o.outputs.probs for o in done]
        return [replace(o, outputs=PoolingOutput(d)) for o, d in zip(done, data)]

    def _token_task(
        self,
        prompts: str | list[str] | list[list[int]],
        pooling_params: PoolingParams | None,
        use_tqdm: bool,
        task: str,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """encode's token-level tasks: a row for every token of each prompt (its hidden state,
        normalized unless use_activation is False; or a token classifier's probabilities,
        logits under use_activation False)."""
        params = pooling_params or PoolingParams()
        on = getattr(params, "use_activation", True)
        keep, side = self._keep(None, params)
        inputs = [self._ids_of(p, keep, side) for p in _listed(prompts)]
        if task == "token_embed":
            self._check_dimensions(params)
            sent = EnginePoolingParams(TOKEN_EMBED, on and params.normalize, params.dimensions)
        else:
            sent = EnginePoolingParams(TOKEN_CLASSIFY, False)
        fn = self.pooling.classify_activation if self.pooling else "default"
        outputs = []
        for (rid, v, cached), ids in zip(self._pool(inputs, sent, use_tqdm, "Pooling"), inputs):
            rows = token_rows(array.array("f", v).tolist(), ids, task, self.pooling)
            flat = rows and not isinstance(rows[0], list)  # (one float a token: BGE-M3's)
            if task == "token_classify":
                rows = activated(rows, on, fn) if flat else [activated(r, on, fn) for r in rows]
            outputs.append(PoolingRequestOutput(rid, PoolingOutput(rows), ids, cached))
        return outputs

    def classify(
        self,
        prompts: str | list[str] | list[list[int]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's probabilities per prompt: the softmax over its labels (the
        sigmoid of a lone label's logit), as transformers' pipelines give them."""
        params = pooling_params or PoolingParams()
        on = getattr(params, "use_activation", True)
        keep, side = self._keep(None, params)
        inputs = [self._ids_of(p, keep, side) for p in _listed(prompts)]
        ran = self._pool(inputs, EnginePoolingParams(CLASSIFY, False), use_tqdm, "Classifying")
        outputs = []
        for (rid, v, cached), ids in zip(ran, inputs):
            logits = array.array("f", v).tolist()
            best = max(range(len(logits)), key=logits.__getitem__)
            label = self.labels[best] if self.labels else str(best)
            fn = self.pooling.classify_activation if self.pooling else "default"
            out = ClassificationOutput(activated(logits, on, fn), label)
            outputs.append(PoolingRequestOutput(rid, out, ids, cached))
        return outputs

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One data_1 text against each data_2 text, or data_1[i] against data_2[i]: a
        reranker's relevance (a one-label classifier over the pair) or, for any other model,
        the cosine of the two texts' embeddings."""
        params = pooling_params or PoolingParams()
        keep, side = self._keep(truncate_prompt_tokens, params)
        pairs = _pairs(data_1, data_2)
        if self.engine.runner.num_labels:
            if self.engine.runner.num_labels != 1:
                raise InvalidParam(
                    "model",
                    f"this classifier has {self.engine.runner.num_labels} labels; scoring needs "
                    "one (a reranker's): use LLM.classify",
                )
            encoded = [self._pair_ids(a, b, keep, side) for a, b in pairs]
            inputs = [ids for ids, _ in encoded]
            each = [EnginePoolingParams(CLASSIFY, False, type_start=t) for _, t in encoded]
            ran = self._pool(inputs, each, use_tqdm, "Scoring")
            on = getattr(params, "use_activation", True)
            fn = self.pooling.score_activation if self.pooling else "default"
            return [
                PoolingRequestOutput(
                    rid, ScoringOutput(activated(array.array("f", v).tolist(), on, fn)[0]), ids, n
                )
                for (rid, v, n), ids in zip(ran, inputs)
            ]
        if getattr(params, "use_activation", True) is not True:
            raise InvalidParam(
                "use_activation",
                "use_activation applies to a classifier's logits; an embedding model scores by "
                "cosine",
            )
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text once
        inputs = [self._ids_of(t, keep, side) for t in texts]
        unit = msgspec.structs.replace(self._engine_params(params), normalize=True)
        ran = self._pool(inputs, unit, use_tqdm, "Scoring")
        vectors = {t: array.array("f", v) for t, (_, v, _) in zip(texts, ran)}
        first = dict(zip(texts, zip(ran, inputs)))
        outputs = []
        for a, b in pairs:
            (rid, _, cached), ids = first[a]
            cosine = math.fsum(x * y for x, y in zip(vectors[a], vectors[b]))
            outputs.append(PoolingRequestOutput(rid, ScoringOutput(cosine), ids, cached))
        return outputs

    def _engine_params(self, params: EnginePoolingParams) -> EnginePoolingParams:
        """What the engine is sent: its own struct, without the offline fields, the kind the
        model's own where the params leave it unset (server/embedding_config.py)."""
        named = params.kind if params.kind in KINDS else None  # (another: the engine refuses)
        config = embedding_config.resolve(self.model_path, named, True, self.pooling)
        self._check_dimensions(params, config)
        kind = params.kind or config.kind
        return EnginePoolingParams(kind, params.normalize, params.dimensions)

    def _check_dimensions(self, params: EnginePoolingParams, config=None) -> None:
        """`dimensions` the model allows, as the server checks them (a 400 there; here an
        InvalidParam naming the field) instead of a silently shorter or unchanged vector."""
        if params.dimensions is None:
            return
        kind = getattr(params, "kind", None)
        kind = kind if kind in KINDS else "last"  # (the size, not the kind, is read)
        config = config or embedding_config.resolve(self.model_path, kind, True, self.pooling)
        why = config.check_dimensions(params.dimensions)
        if why:
            raise InvalidParam("dimensions", f"dimensions={params.dimensions}: {why}")

    def _keep(self, keep: int | None, params: EnginePoolingParams) -> tuple[int | None, str]:
        """(the tokens truncate_prompt_tokens keeps: the argument's, else the params', or None;
        the side it cuts from, the params' truncation_side)."""
        side = getattr(params, "truncation_side", "right")
        if side not in SIDES:
            raise InvalidParam("truncation_side", f"truncation_side must be left or right: {side}")
        if keep is None:
            keep = getattr(params, "truncate_prompt_tokens", None)
        if keep is None:
            return None, side
        if keep == -1:
            return self.max_model_len, side
        if not 0 < keep <= self.max_model_len:
            raise InvalidParam(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or 1..{self.max_model_len} (the context), "
                f"got {keep}",
            )
        return keep, side

    def _ids_of(self, prompt: str | list[int], keep: int | None, side: str) -> list[int]:
        """A text's or token list's ids, cut to `keep` from `side` (a text's special tokens
        kept: core/truncation.py)."""
        if isinstance(prompt, str):
            if keep is not None:
                return cut_text(self.tokenizer, prompt, keep, side)
            return self.tokenizer.encode(prompt)
        return cut_ids(prompt, keep, side) if keep is not None else list(prompt)

    def _pair_ids(
        self, a: str, b: str, keep: int | None, side: str
    ) -> tuple[list[int], int | None]:
        """The pair as one input (core/score_pairs.py: the model's rerank prompt, or the
        tokenizer's pair encoding) and where its second text starts, cut to `keep` tokens."""
        try:
            return pair_ids(self.tokenizer, a, b, keep, self.score_template, side)
        except PairTooLong as e:
            raise InvalidParam("truncate_prompt_tokens", str(e)) from None

    def _pool(
        self,
        inputs: list[list[int]],
        pooling: EnginePoolingParams | list[EnginePoolingParams],
        use_tqdm: bool,
        desc: str,
    ) -> list[tuple[str, bytes, int]]:
        """(request id, pooled vector, cached prompt tokens) per input, in order (`pooling`:
        every input's, or each input's own). Every request is checked before any runs: a bad
        one raises InvalidParam naming its field."""
        adds: deque[AddRequest] = deque()
        results: dict[str, tuple[bytes, int] | None] = {}
        for i, ids in enumerate(inputs):
            rid = str(next(self._ids))
            each = pooling[i] if isinstance(pooling, list) else pooling
            req = EngineRequest(rid, ids, SamplingParams(max_tokens=1), pooling=each)
            self.engine.check(req)
            adds.append(AddRequest(req))
            results[rid] = None
        with tqdm(total=len(results), desc=desc, unit="req", disable=not use_tqdm) as bar:

            def publish(outputs, stats) -> bool:
                for out in outputs:
                    if out.error is not None or out.embedding is None:
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
                    results[out.request_id] = (out.embedding, out.num_cached_tokens)
                    bar.update(1)
                return True

            self._run(adds, publish)
        missing = [rid for rid, got in results.items() if got is None]
        if missing:  # (the loop runs until every request has ended: never expected)
            raise RuntimeError(f"requests {missing} ended without their vectors")
        return [(rid, *got) for rid, got in results.items()]  # type: ignore[misc]


def _listed(prompts: str | list[str] | list[list[int]]) -> list:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """One data_1 against each data_2, or data_1[i] against data_2[i]."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("data_1", first), ("data_2", second)):
        if not texts:
            raise InvalidParam(name, f"{name} must not be empty")
        if not all(isinstance(t, str) for t in texts):
            raise InvalidParam(name, f"{name} must be a text or a list of texts")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise InvalidParam(
            "data_1",
            f"data_1 has {len(first)} texts and data_2 {len(second)}: give one data_1, or as "
            "many as data_2",
        )
    return list(zip(first, second))


__all__ = [
    "PoolingParams",
    "EmbeddingOutput",
    "ClassificationOutput",
    "ScoringOutput",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "PoolingCalls",
]
