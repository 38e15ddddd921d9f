"""Stops as vLLM applies them: a stop token's text (EOS, stop_token_ids) is not part of the
reply unless include_stop_str_in_output, and a stop string counts only once min_tokens tokens
are out (it must end in a later token's text). On the engine, with the tiny model."""

from __future__ import annotations

import pytest

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import SamplingParams
from core.stop import StopStrings
from gpu.launch import load

PROMPT = [5, 17, 300, 42, 9, 77, 120, 8]


@pytest.fixture(scope="module")
def core(model_dir):
    config = EngineConfig(model=str(model_dir("qwen3")), device="cpu", num_kv_blocks=64)
    return load(config).core


def run(core, params: SamplingParams, prompt=PROMPT) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one request run to its end."""
    ids, text, last = run_out(core, params, prompt)
    return ids, text, last.finish_reason


def run_out(core, params: SamplingParams, prompt=PROMPT):
    """(token ids, text, the last output) of one request run to its end."""
    core.add(EngineRequest("r", list(prompt), params))
    ids, text, last = [], "", None
    while core.has_work:
        for out in core.step():
            ids += out.new_token_ids
            text += out.new_text
            last = out
    return ids, text, last


def greedy(**kw) -> SamplingParams:
    """Seeded (the tiny model's greedy text repeats one token): the same tokens every run."""
    kw.setdefault("max_tokens", 12)
    return SamplingParams(temperature=1.0, seed=11, ignore_eos=True, **kw)


def test_stop_strings_wait_for_min_tokens():
    s = StopStrings(["ab", "xyz"], include_in_output=False)
    # before min_tokens: nothing matches, the tail is held all the same
    assert s.feed("ab q", armed=False) == ("ab", None)
    assert s.feed("ab", armed=False) == (" q", None)
    # the held "ab" ended before min_tokens: not a match, even now
    assert s.feed("x", armed=True) == ("a", None)
    assert s.feed("yz!", armed=True) == ("b", "xyz")  # the stop string that matched
    late = StopStrings(["ab"], include_in_output=True)
    assert late.feed("a", armed=False) == ("", None)
    assert late.feed("b", armed=True) == ("ab", "ab")  # starts early, ends late: a match


def test_a_stop_tokens_text_is_not_the_replys(core):
    ids, text, _ = run(core, greedy())
    stop = ids[4]
    assert stop not in ids[:4]
    tokenizer = core.tokenizer
    upto = tokenizer.decode(ids[:4])
    got_ids, got_text, reason = run(core, greedy(stop_token_ids=[stop]))
    assert got_ids == ids[:5] and reason == "stop"
    assert got_text == upto
    got_ids, got_text, _ = run(core, greedy(stop_token_ids=[stop], include_stop_str_in_output=True))
    assert got_ids == ids[:5] and got_text == tokenizer.decode(ids[:5])
    # EOS, with special tokens shown: still not in the reply
    eos = min(core.eos_token_ids)
    params = SamplingParams(
        temperature=0, max_tokens=12, logit_bias={eos: 100.0}, skip_special_tokens=False
    )
    got_ids, got_text, reason = run(core, params)
    assert got_ids == [eos] and got_text == "" and reason == "stop"


def test_stop_strings_before_min_tokens_do_not_stop(core):
    ids, text, _ = run(core, greedy(max_tokens=16))
    decode = core.tokenizer.decode
    # a stop string made of an early token's text (whole characters): it first ends there
    pieces = [(k, decode(ids[: k + 1])[len(decode(ids[:k])) :]) for k in range(6)]
    k, stop = next((k, p) for k, p in pieces if p.strip() and "\ufffd" not in p)
    assert decode(ids[: k + 1]) == text[: len(decode(ids[: k + 1]))]
    _, early, reason = run(core, greedy(max_tokens=16, stop=[stop]))
    assert reason == "stop" and early == text[: text.index(stop)]
    min_tokens = k + 3
    got_ids, got_text, reason = run(core, greedy(max_tokens=16, stop=[stop], min_tokens=min_tokens))
    assert len(got_ids) > min_tokens
    # the first occurrence that ends past the first min_tokens tokens' text
    later = text.find(stop, len(decode(ids[:min_tokens])) - len(stop) + 1)
    if later < 0:
        assert reason == "length" and got_ids == ids and got_text == text
    else:
        assert reason == "stop" and got_text == text[:later]


def test_stop_reason_names_what_ended_the_request(core):
    """vLLM's stop_reason: the stop string that matched, or the stop_token_ids entry; None for
    the model's EOS and for a length cut."""
    ids, text, _ = run(core, greedy())
    assert run_out(core, greedy())[2].stop_reason is None  # length
    token = ids[4]
    _, _, last = run_out(core, greedy(stop_token_ids=[token]))
    assert (last.finish_reason, last.stop_reason) == ("stop", token)
    word = text[len(text) // 2 :][:3]
    _, _, last = run_out(core, greedy(stop=["zzzq", word]))
    assert (last.finish_reason, last.stop_reason) == ("stop", word)
    eos = next(iter(core.eos_token_ids))
    params = SamplingParams(
        temperature=1.0, seed=11, max_tokens=12, stop_token_ids=[eos], logit_bias={eos: 100}
    )
    _, _, last = run_out(core, params)  # the model's own EOS (listed too): not a stop_reason
    assert (last.finish_reason, last.stop_reason) == ("stop", None)


def test_deltas_merged_for_a_slow_reader_keep_what_ended_the_request():
    """A reader behind the engine gets deltas merged (core/outputs.py): the last one's
    stop_reason, error and its status survive (a loaded machine had lost the stop_reason)."""
    from core.outputs import merge
    from core.request import RequestOutput

    first = RequestOutput(request_id="r", new_token_ids=[1], new_text="a")
    last = RequestOutput(
        request_id="r",
        new_token_ids=[2],
        new_text="b",
        finished=True,
        finish_reason="stop",
        stop_reason="END",
        error="why",
        error_status=503,
    )
    merged = merge(first, last)
    assert (merged.new_token_ids, merged.new_text) == ([1, 2], "ab")
    assert (merged.stop_reason, merged.error, merged.error_status) == ("END", "why", 503)
