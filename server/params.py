"""Request fields into SamplingParams, and the checks every generation route shares: defaults
from the model's generation config, logit_bias keys, --max-logprobs, stream options."""

from __future__ import annotations

from core.sampling import InvalidParam, SamplingParams
from core.structured import Constraint
from server.errors import APIError
from server.requests import ChatCompletionRequest, SamplingFields
from server.state import ServerState

# The fields that carry a structured-output constraint, in the order they are named.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

# Request fields that fall back to the model's generation config, then to these defaults.
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


# vLLM's request fields for what weir does not serve: a request that sets one is refused
UNSERVED = ("logits_processors", "vllm_xargs", "kv_transfer_params", "mm_processor_kwargs")


def sampling_params(
    st: ServerState,
    req: SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    logprobs: int | None,
    structured: Constraint | None = None,
) -> SamplingParams:
    for name in UNSERVED:
        if getattr(req, name, None):
            raise APIError(400, f"{name} (vLLM's) is not served by weir", name, "invalid_value")
    beams = req.use_beam_search
    # A beam search ranks the model's own log-probabilities: the generation config's sampling
    # defaults do not apply, and a field set to change the distribution is refused.
    defaults = {} if beams else st.generation_defaults
    values = {
        name: getattr(req, name) if getattr(req, name) is not None else defaults.get(name, default)
        for name, default in SAMPLING_DEFAULTS.items()
    }
    if beams:
        if req.temperature is None:
            values["temperature"] = 0.0
        if structured is not None:
            field = next(
                (f for f in CONSTRAINT_FIELDS if getattr(req, f, None) is not None), "tool_choice"
            )
            raise APIError(
                400,
                f"{field} cannot be used with beam search (use_beam_search): a constraint on "
                "each beam's tokens is not honoured",
                field,
                "invalid_value",
            )
    defaults = st.generation_defaults
    if max_tokens is None and "max_tokens" in defaults:
        room = st.max_model_len - prompt_len
        max_tokens = min(defaults["max_tokens"], room) if room >= 1 else None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias: dict[int, float] = {}
    bad_keys = []
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            bad_keys.append(key)
    if bad_keys:
        raise APIError(
            400,
            "logit_bias keys must be token ids (integers as strings); not token ids: "
            + ", ".join(repr(k) for k in bad_keys),
            "logit_bias",
            "invalid_value",
        )
    logprobs = resolve_logprobs(st, logprobs)
    prompt_logprobs = resolve_logprobs(st, req.prompt_logprobs)
    check_logprobs(st, logprobs_field(req), logprobs)
    check_logprobs(st, "prompt_logprobs", prompt_logprobs)
    params = SamplingParams(
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"] or 0,
        min_p=values["min_p"],
        presence_penalty=values["presence_penalty"],
        frequency_penalty=values["frequency_penalty"],
        repetition_penalty=values["repetition_penalty"],
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=None if beams else req.seed,
        logit_bias=bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=list(req.bad_words or []),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured=structured,
        beam_width=req.n if beams else 0,
        length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
    )
    try:
        params.validate()
    except InvalidParam as e:
        raise APIError(400, e.message, e.param, "invalid_value") from None
    return params


def truncate_prompt(st: ServerState, req: SamplingFields, ids: list[int]) -> list[int]:
    """truncate_prompt_tokens as vLLM reads it: keep that many prompt tokens (-1: the context
    less one token for the output), the last ones, or the first with truncation_side "right"."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = st.max_model_len - 1
    if keep == 0:
        raise APIError(
            400,
            "truncate_prompt_tokens=0 leaves no prompt; use a positive count, or -1 for as many "
            "as the context holds",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if keep > st.max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens={keep} is more than the model's context "
            f"({st.max_model_len} tokens)",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    if len(ids) <= keep:
        return ids
    return ids[:keep] if req.truncation_side == "right" else ids[-keep:]


def logprobs_field(req: SamplingFields) -> str:
    return "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"


def resolve_logprobs(st: ServerState, asked: int | None) -> int | None:
    """-1 (vLLM's "as many as allowed"): the whole vocabulary under --max-logprobs -1, else the
    server's limit."""
    if asked != -1:
        return asked
    limit = st.config.max_logprobs
    return st.vocab_size if limit == -1 else min(limit, st.vocab_size)


def check_logprobs(st: ServerState, field: str, asked: int | None) -> None:
    """--max-logprobs, checked here to name the request's own field (chat's top_logprobs);
    the engine checks it again for offline use."""
    limit = st.config.max_logprobs
    if asked is not None and limit != -1 and asked > limit:
        raise APIError(
            400,
            f"{field}={asked} is more than this server allows ({limit}; the limit is set "
            "with --max-logprobs)",
            field,
            "invalid_value",
        )


def tokens_as_ids(st: ServerState, req: SamplingFields) -> bool:
    given = req.return_tokens_as_token_ids
    return st.options.return_tokens_as_token_ids if given is None else given


def check_common(st: ServerState, req: SamplingFields) -> None:
    if req.priority != 0 and st.config.scheduling_policy != "priority":
        raise APIError(
            400,
            f"priority {req.priority} needs the server to run with --scheduling-policy priority",
            "priority",
            "invalid_value",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400,
            "stream_options is only allowed when stream is true",
            "stream_options",
            "invalid_value",
        )


def include_usage(req: SamplingFields) -> tuple[bool, bool]:
    """(a final usage chunk, usage on every chunk): continuous_usage_stats counts only together
    with include_usage, as in vLLM."""
    opts = req.stream_options
    final = bool(opts and opts.include_usage)
    return final, final and bool(opts and opts.continuous_usage_stats)
