"""LLM: batch generation in-process on the same engine as the server (no HTTP, no threads).

from weir import LLM, SamplingParams
llm = LLM("Qwen/Qwen3-0.6B", max_num_seqs=128)
for out in llm.generate(["Hello", "The river"], SamplingParams(max_tokens=32)):
    print(out.outputs[0].text)
for out in llm.beam_search(["Hello"], BeamSearchParams(beam_width=4, max_tokens=32)):
    print([seq.text for seq in out.sequences])  # best first
replies = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))
vectors = [o.outputs.embedding for o in llm.embed(["a river", "a canyon"])]
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

from core.config import EngineConfig
from core.engine_loop import EngineLoop
from core.engine_messages import AddRequest
from core.lora import CONFIG_FILE, WEIGHTS_FILE, LoraRef, LoRARequest, read_adapter
from core.request import EngineRequest, Logprob
from core.sampling import InvalidParam
from core.sampling import SamplingParams as EngineSamplingParams
from weir import chat
from weir.pooling import PoolingCalls


class SamplingParams(EngineSamplingParams):
    """vLLM's SamplingParams: the engine's (core/sampling.py) with what the offline API does
    around it, as the server does for a request: `n` samples of each prompt (sharing its
    prefill; seeds seed, seed + 1, ... when a seed is given), and `truncate_prompt_tokens` (keep
    that many prompt tokens, -1: the context less one, the last ones, or the first with
    `truncation_side` "right")."""

    n: int = 1
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # one per token when SamplingParams.logprobs asks (core/request.py Logprob: token_id,
    # logprob, top_ids, top_logprobs)
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: entry p scores prompt token p (None for the first)
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (`beam_width` beams, as many sequences returned), with weir's
    further fields: transformers' `early_stopping` (True, False or "never"), stop strings and
    token ids, `min_tokens`, and `logprobs` (top alternatives per returned token)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM gives it: `tokens` and `text` include the prompt."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None
    score: float = 0.0  # what it was ranked by: cum_logprob / output length ** length_penalty
    logprobs: list[Logprob] = field(default_factory=list)  # per output token, if asked
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


class LLM(PoolingCalls):
    """`model` is a local directory or hub id (None: the built-in tiny model); keyword
    arguments are EngineConfig fields (max_num_seqs, num_kv_blocks, dtype, ...). `embed`,
    `classify` and `score` are weir/pooling.py's."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        from gpu import openmp

        self.config = EngineConfig(model=model, **engine_args)
        openmp.prepare(self.config)  # before torch is imported (gpu/openmp.py)
        from gpu.launch import load

        loaded = load(self.config)
        self.engine = loaded.core
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.labels = loaded.labels  # a sequence classifier's, by index
        self.score_template = loaded.score_template
        self.pooling = loaded.pooling
        self.model_path = Path(loaded.model_path)
        self._generation_defaults = loaded.generation_defaults
        self._ids = itertools.count()
        self._lora_base = loaded.lora_base
        self._loras: dict[tuple, LoraRef] = {}  # checked adapters, by folder and file times

    def _lora(self, request: LoRARequest | None) -> LoraRef | None:
        """vLLM's LoRARequest as the engine takes it: checked against the base model (once per
        version of its files), named by its content."""
        if request is None:
            return None
        if self._lora_base is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        folder = Path(request.lora_path).expanduser()
        stats = [(folder / f).stat() for f in (CONFIG_FILE, WEIGHTS_FILE) if (folder / f).exists()]
        key = (request.lora_name, str(folder), *((s.st_mtime_ns, s.st_size) for s in stats))
        if key not in self._loras:
            info = read_adapter(
                request.lora_name, folder, self._lora_base, self.config.max_lora_rank
            )
            self._loras[key] = info.ref
        return self._loras[key]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling fields of the model's generation_config.json (temperature,
        top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens) over
        SamplingParams' own defaults; `generation_config="vllm"` leaves them out, a folder reads
        that folder's. What generate and chat use when given no SamplingParams."""
        return SamplingParams(**self._generation_defaults)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in prompt order.
        `lora_request`: the adapter (vLLM's LoRARequest) for every prompt, or one per prompt
        (None: the base model); needs `enable_lora=True`. No `sampling_params`: the model's
        (get_default_sampling_params), its max_new_tokens cut to each prompt's room."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("one lora_request per prompt, or one for all")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        adds: deque[AddRequest] = deque()
        sample: dict[str, tuple[str, int]] = {}  # engine request -> (its result, which sample)
        for prompt, p, lora in zip(prompts, params_list, loras):
            p.validate()
            n = getattr(p, "n", 1)
            if not isinstance(n, int) or n < 1:
                raise InvalidParam("n", f"n must be at least 1, got {n}")
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            ids = self._truncated(ids, p)
            if sampling_params is None and "max_tokens" in self._generation_defaults:
                room = self.max_model_len - len(ids)  # as the server caps the default
                p = msgspec.structs.replace(
                    p, max_tokens=min(p.max_tokens, room) if room >= 1 else None
                )
            rid = str(next(self._ids))
            results[rid] = RequestOutput(
                rid,
                prompt if isinstance(prompt, str) else None,
                ids,
                [CompletionOutput(j, "", [], None) for j in range(n)],
            )
            order.append(rid)
            for j in range(n):  # the first sample leads: the others share its prefill
                sid = rid if j == 0 else f"{rid}-{j}"
                q = p if p.seed is None or j == 0 else msgspec.structs.replace(p, seed=p.seed + j)
                req = EngineRequest(
                    sid, ids, q, lora=self._lora(lora), leader_id=None if j == 0 else rid
                )
                self.engine.check(req)  # a bad request raises here, before any runs
                adds.append(AddRequest(req))
                sample[sid] = (rid, j)
        with tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm) as bar:

            def publish(outputs, stats) -> bool:
                for out in outputs:
                    rid, j = sample[out.request_id]
                    res = results[rid]
                    o = res.outputs[j]
                    o.text += out.new_text
                    o.token_ids += out.new_token_ids
                    o.logprobs += out.logprobs
                    if out.prompt_logprobs is not None:
                        res.prompt_logprobs = out.prompt_logprobs
                    res.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        o.finish_reason = out.finish_reason
                        if res.finished:  # every sample of the prompt
                            bar.update(1)
                return True

            self._run(adds, publish)
        return [results[rid] for rid in order]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (OpenAI-format messages) or a list of them, each
        rendered by the chat template (`chat_template`: a template's text or file instead of
        the model's) as the server renders a chat request, then generated as `generate` does;
        one RequestOutput a conversation, its `prompt` the rendered text. Every conversation is
        rendered before any runs: what cannot be raises InvalidParam naming the field."""
        template = chat.template_of(chat_template)
        texts, ids = [], []
        for i, conversation in enumerate(chat.conversations(messages)):
            text, tokens = chat.prompt_ids(
                self.tokenizer,
                template,
                conversation,
                i,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
            )
            texts.append(text)
            ids.append(tokens)
        outputs = self.generate(ids, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _truncated(self, ids: list[int], p) -> list[int]:
        """The prompt as `truncate_prompt_tokens` leaves it (the server's: server/params.py)."""
        keep = getattr(p, "truncate_prompt_tokens", None)
        if keep is None:
            return ids
        side = getattr(p, "truncation_side", "left")
        if side not in ("left", "right"):
            raise InvalidParam("truncation_side", f"truncation_side must be left or right: {side}")
        keep = self.max_model_len - 1 if keep == -1 else keep
        if not 0 < keep <= self.max_model_len:
            raise InvalidParam(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or 1..{self.max_model_len} (the context)",
            )
        if len(ids) <= keep:
            return ids
        return ids[:keep] if side == "right" else ids[-keep:]

    def beam_search(
        self,
        prompts: list,
        params: BeamSearchParams,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt (text, token ids, or vLLM's TextPrompt /
        TokensPrompt dicts) searched with `params.beam_width` beams inside the engine, the
        beams of every prompt batched together; at most `concurrency_limit` prompts at once."""
        sampling = params.sampling_params()
        sampling.validate()
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("one lora_request per prompt, or one for all")
        order, adds = [], deque()
        prompt_ids: dict[str, list[int]] = {}
        for prompt, lora in zip(prompts, loras):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            req = EngineRequest(rid, ids, sampling, lora=self._lora(lora))
            self.engine.check(req)
            adds.append(AddRequest(req))
            prompt_ids[rid] = ids
            order.append(rid)
        results: dict[str, BeamSearchOutput] = {}
        limit = concurrency_limit or len(order)
        with tqdm(total=len(order), desc="Beam search", unit="req", disable=not use_tqdm) as bar:

            def publish(outputs, stats) -> bool:
                for out in outputs:
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
                    ids = prompt_ids[out.request_id]
                    head = self.tokenizer.decode(ids)
                    results[out.request_id] = BeamSearchOutput(
                        [
                            BeamSearchSequence(
                                ids + b.token_ids,
                                head + b.text,
                                b.cumulative_logprob,
                                b.finish_reason,
                                b.score,
                                b.logprobs,
                            )
                            for b in out.beams
                        ]
                    )
                    bar.update(1)
                return True

            def take(block: bool):
                if adds and len(order) - len(adds) - len(results) < limit:
                    return adds.popleft()
                return None

            self._run_with(take, publish)
        return [results[rid] for rid in order]

    def _run(self, adds: deque, publish) -> None:
        """The engine loop (core/engine_loop.py) over `adds`, until every request has ended."""
        self._run_with(lambda block: adds.popleft() if adds else None, publish)

    def _run_with(self, take, publish) -> None:
        """The engine loop over the commands `take` gives, until every request has ended."""

        def refuse(out) -> None:
            raise RuntimeError(f"request {out.request_id}: {out.error}")

        loop = EngineLoop(self.engine, publish, refuse)
        loop.run(take, until_idle=True)
