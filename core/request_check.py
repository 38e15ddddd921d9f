"""A request checked against the model and the server's limits before it is scheduled.

Reads only what is fixed at start-up (vocabulary size, max_model_len, --max-logprobs), so the
server process checks requests before they cross to the engine, and the engine checks again.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.pooling import CLASSIFY, TOKEN_CLASSIFY
from core.request import EngineRequest
from core.sampling import InvalidParam


def _outside(ids: Iterable[int], vocab: int) -> str | None:
    """The ids a request names that the model has no row for, said with the vocabulary's size."""
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if not bad:
        return None
    shown = ", ".join(str(t) for t in bad[:8]) + (", ..." if len(bad) > 8 else "")
    what = "token id {} is" if len(bad) == 1 else "token ids {} are"
    return f"{what.format(shown)} outside the vocabulary (vocab_size={vocab}: ids 0..{vocab - 1})"


def check_classifier(req: EngineRequest, num_labels: int, per_token: bool) -> None:
    """A classifier takes its own kind of request only (a sequence classifier's CLASSIFY, a
    token classifier's TOKEN_CLASSIFY), and no other model takes either, but an embedding model
    with a head for every token (`per_token` without labels: BGE-M3's sparse weights) takes
    TOKEN_CLASSIFY beside its embeddings."""
    kind = req.pooling.kind if req.pooling is not None else None
    if num_labels and per_token and kind != TOKEN_CLASSIFY:
        raise InvalidParam(
            "model", "this model is a token classifier: it labels each token, nothing else"
        )
    if num_labels and not per_token and kind != CLASSIFY:
        raise InvalidParam(
            "model", "this model is a sequence classifier: it classifies and scores, nothing else"
        )
    if not num_labels and (kind == CLASSIFY or (kind == TOKEN_CLASSIFY and not per_token)):
        what = "token" if kind == TOKEN_CLASSIFY else "sequence"
        raise InvalidParam("model", f"this model is not a {what} classifier: it does not classify")


def check_encoder_request(req: EngineRequest, max_num_batched_tokens: int) -> None:
    """An encoder's request (the model embeds or classifies, each input whole in one step):
    a pooling request whose input fits in a step."""
    if req.pooling is None:
        raise InvalidParam(
            "model",
            "this model is an encoder: it embeds (a classifier classifies and scores); it does "
            "not generate",
        )
    n = len(req.prompt_token_ids)
    if n > max_num_batched_tokens:
        raise InvalidParam(
            "input",
            f"the input has {n} tokens; this encoder runs an input whole, in one step of at "
            f"most {max_num_batched_tokens} tokens (--max-num-batched-tokens)",
        )


def check_request(
    req: EngineRequest,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int = 20,
    max_beam_width: int = 16,
    max_num_seqs: int | None = None,
    kv_blocks: tuple[int, int] | None = None,
    eos_token_ids: Iterable[int] = (),
) -> int:
    """Validate a request against the model (vocabulary, context length, its EOS tokens) and the
    server's --max-logprobs (-1: up to the vocabulary), --max-beam-width and --max-num-seqs (a
    beam search holds its width in sequences), and a beam search against the KV cache
    (`kv_blocks`: its blocks and their size); return its resolved max_tokens. Raises
    InvalidParam naming the offending field."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidParam("prompt", "the prompt is empty")
    vocab = vocab_size
    if req.pooling is not None:  # an embedding: the prompt alone, nothing generated
        problem = _outside(req.prompt_token_ids, vocab)
        if problem is not None:
            raise InvalidParam("input", f"input: {problem}")
        if n > max_model_len:
            raise InvalidParam(
                "input",
                f"This model's maximum context length is {max_model_len} tokens, "
                f"but the input has {n} tokens.",
            )
        return 0
    params = req.sampling_params
    for field, ids in (
        ("prompt", req.prompt_token_ids),
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        problem = _outside(ids, vocab)
        if problem is not None:
            raise InvalidParam(field, f"{field}: {problem}")
    allowed = params.allowed_token_ids
    if allowed and params.min_tokens > 0:
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if set(allowed) <= ends:
            raise InvalidParam(
                "allowed_token_ids",
                "allowed_token_ids: every token allowed ends the output (EOS or stop_token_ids), "
                f"and min_tokens={params.min_tokens} bans them until then: nothing could be "
                "generated",
            )
    width = params.beam_width
    if width > max_beam_width:
        raise InvalidParam(
            "n",
            f"n={width} beams is more than this server allows ({max_beam_width}; the limit is "
            "set with --max-beam-width)",
        )
    if max_num_seqs is not None and width > max_num_seqs:
        raise InvalidParam(
            "n", f"n={width} beams is more than the server runs at once (--max-num-seqs)"
        )
    limit = vocab if max_logprobs == -1 else min(max_logprobs, vocab)
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, field)
        if asked is not None and asked > limit:
            raise InvalidParam(
                field,
                f"{field}={asked} is more than this server allows ({limit}; "
                "the limit is set with --max-logprobs)",
            )
    room = max_model_len - n
    if room < 1:
        raise InvalidParam(
            "messages",
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {n} tokens, leaving no room for output.",
        )
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is None:
        max_tokens = room
    if params.min_tokens > max_tokens:
        raise InvalidParam(
            "min_tokens",
            f"min_tokens ({params.min_tokens}) exceeds the "
            f"{max_tokens} tokens this request may generate",
        )
    if max_tokens > room:
        raise InvalidParam(
            "max_tokens",
            f"This model's maximum context length is {max_model_len} tokens. "
            f"However, you requested {n + max_tokens} tokens ({n} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
        )
    if width and kv_blocks is not None:
        blocks, size = kv_blocks
        # its beams share the prompt's whole blocks; each holds the rest of its own sequence
        shared = n // size
        need = shared + width * (-(-(n + max_tokens) // size) - shared)
        if need > blocks:
            raise InvalidParam(
                "n",
                f"a beam search of n={width} beams over {n} prompt tokens and max_tokens "
                f"{max_tokens} needs up to {need} KV cache blocks; the cache holds {blocks}. "
                "Lower n or max_tokens (or give the cache more memory).",
            )
    return max_tokens
