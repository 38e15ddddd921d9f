"""Cohere's Command R7B through the server: its markup (special tokens of its tokenizer) picked
from the chat template for both parsers (`auto`); under tool_choice required its plan is free
(its own markers, as tokens, open and close it: core/structured.py think_marks) and then the
grammar writes <|START_ACTION|> as that token; the plan is reasoning, the action list tool_calls,
whole and streamed; an answer's <|START_RESPONSE|> never reaches the content."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_tools import TOOLS, USER

MARKUP = (
    *("<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>"),
    *("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
)
# A shortened Command R7B template: the tools in the system turn, past calls as actions, answers
# wrapped in their markers.
TEMPLATE = (
    "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{% if tools %}Tools: {% for t in tools %}"
    "{{ t | tojson }}{% endfor %}. Plan in <|START_THINKING|><|END_THINKING|>, then call as "
    '<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": ...}]<|END_ACTION|>'
    "{% endif %}<|END_OF_TURN_TOKEN|>{% for m in messages %}<|START_OF_TURN_TOKEN|>"
    "{% if m.role == 'assistant' %}<|CHATBOT_TOKEN|>{% if m.tool_calls %}<|START_ACTION|>["
    '{% for tc in m.tool_calls %}{"tool_call_id": "{{ loop.index0 }}", "tool_name": '
    '"{{ tc.function.name }}", "parameters": {{ tc.function.arguments }}}'
    "{% endfor %}]<|END_ACTION|>{% else %}<|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|>"
    "{% endif %}{% else %}<|USER_TOKEN|>{{ m.content or '' }}{% endif %}<|END_OF_TURN_TOKEN|>"
    "{% endfor %}{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)
@pytest.fixture(scope="module")
def server(model_dir):
    from core.config import EngineConfig

    path = model_dir("cohere2", num_layers=2, special_tokens=MARKUP)
    config = EngineConfig(
        model=str(path), served_model_name=["tiny"], num_kv_blocks=128, max_model_len=1024,
        chat_template=TEMPLATE, enable_prefix_caching=False,
    )  # fmt: skip (no prefix cache: the streamed request computes as the whole one did)
    s = LiveServer(config, reasoning_parser="auto").start()
    yield s
    s.stop()


def test_the_template_picks_both_parsers(server):
    assert server.state.tool_parser == "command"
    assert server.state.reasoning_parser == "command"


def ids(server, *tokens: str) -> list[int]:
    return [server.state.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def required(server, **kw) -> dict:
    """tool_choice required with the plan's markers pushed up (the random model opens its
    plan and closes it at once; the grammar holds once it is closed) and the action's pushed
    down (the grammar still writes it, as its special token): sampled reproducibly, the
    random model's JSON ended by the biases."""
    from tests.test_structured import close_bias, no_whitespace_bias

    tok = server.state.tokenizer
    start, end, action = ids(server, "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>")
    bias = close_bias(tok) | no_whitespace_bias(tok)
    bias |= {str(start): 100, str(end): 100, str(action): -100}
    return {
        "model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required",
        "max_tokens": 200, "temperature": 1.0, "seed": 1, "return_token_ids": True,
        "logit_bias": bias, **kw,
    }  # fmt: skip


def test_the_plan_then_calls_whole_and_streamed(server):
    """The plan is reasoning (empty here), the calls are tool_calls, its markers none of the
    content; the stream gives the same calls."""
    start, end, action, close = ids(
        server, "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>"
    )
    r = httpx.post(server.url + "/v1/chat/completions", json=required(server), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    written = choice["token_ids"]
    assert written[:2] == [start, end] and action in written[2:4] and close in written, written
    msg = choice["message"]
    # (the grammar lets whitespace follow the plan: the random model wrote some, as content)
    assert msg["reasoning_content"] == "" and not msg["content"].strip(), msg
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert calls and choice["finish_reason"] == "tool_calls"
    streamed: dict[int, list[str]] = {}
    text = ""
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=required(server, stream=True),
        timeout=120,
    ) as s:  # fmt: skip
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                text += ch["delta"].get("content") or ""
                for t in ch["delta"].get("tool_calls") or []:
                    if t.get("id"):
                        streamed[t["index"]] = [t["function"]["name"], ""]
                    streamed[t["index"]][1] += t["function"].get("arguments") or ""
    assert [tuple(c) for c in streamed.values()] == calls and text == msg["content"]


def test_an_answer_loses_its_markers(server):
    """Decoded with special tokens kept (its parsers' markup is special tokens), the answer's
    own markers still never reach the content."""
    (response,) = ids(server, "<|START_RESPONSE|>")
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 3,
            "logit_bias": {str(response): 100}, "return_token_ids": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [response] * 3
    assert not choice["message"]["content"] and not choice["message"]["tool_calls"], choice
