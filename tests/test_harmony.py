"""gpt-oss's harmony replies: the `openai_gptoss` reasoning parser and the `openai` tool-call
parser (server/reasoning/harmony.py, server/tool_parsers/openai.py) on whole texts and streamed
in every chunking, and through the server with a tiny model whose tokenizer has harmony's
special tokens, its output held to a harmony reply by a grammar."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from server.reasoning import HarmonyParser, ReasoningStream, detect
from server.reply import Reply
from server.tool_parsers import PARSERS, ToolStream
from server.tool_parsers import detect as detect_tools

ANSWER = (
    "<|channel|>analysis<|message|>The user asks 2 x 21. That is 42.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 42."
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo", "days": 3}'
)
OPENS_WITH_RECIPIENT = (  # the reply's first message names its recipient before its channel
    ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'
)
RECIPIENT_FIRST = (  # the recipient before the channel, as the model also writes it
    "<|channel|>analysis<|message|>Look it up.<|end|>"
    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'
)


def test_a_whole_reply_splits_into_reasoning_and_content():
    parser = HarmonyParser("")
    assert parser.split(ANSWER, final=True) == (
        "The user asks 2 x 21. That is 42.",
        "The answer is 42.",
    )
    assert parser.split(ANSWER + "<|return|>", final=True)[1] == "The answer is 42."
    assert parser.split("Just text, no markup.", final=True) == (None, "Just text, no markup.")
    # a preamble on the commentary channel is content; the length that wrote the reasoning
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + ANSWER
    assert parser.split(preamble, final=True)[1] == "Checking.The answer is 42."
    assert ANSWER[: parser.reasoning_length(ANSWER)].endswith("That is 42.<|end|>")


@pytest.mark.parametrize(
    "text,name,args",
    [
        (CALL, "get_weather", {"city": "Oslo", "days": 3}),
        (RECIPIENT_FIRST, "get_time", {"zone": "UTC"}),
    ],
)
def test_calls_on_the_commentary_channel(text, name, args):
    reply = Reply(HarmonyParser, "", PARSERS["openai"]())
    message, reason = reply.whole(text, "stop")
    assert reason == "tool_calls" and message.content is None
    assert message.reasoning_content in ("Need the weather.", "Look it up.")
    call = message.tool_calls[0]
    assert call.function.name == name and json.loads(call.function.arguments) == args


@pytest.mark.parametrize("text", [ANSWER, CALL, RECIPIENT_FIRST, OPENS_WITH_RECIPIENT])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 11])
def test_streamed_in_any_chunking_equals_the_whole(text, step):
    """Chunks cut anywhere, markers included (a detokenizer gives them whole, but the parsers
    do not rely on it): the deltas add up to the whole reply's reasoning, content and calls."""
    reasoning = ReasoningStream(HarmonyParser(""))
    calls = ToolStream(PARSERS["openai"]())
    think, content, deltas = "", "", []
    for at in range(0, len(text), step):
        chunk = text[at : at + step]
        final = at + step >= len(text)
        r, c = reasoning.feed(chunk, final)
        c, d = calls.feed(c, final)
        think, content, deltas = think + r, content + c, deltas + (d or [])
    whole = Reply(HarmonyParser, "", PARSERS["openai"]()).whole(text, "stop")[0]
    assert think == (whole.reasoning_content or "") and content == (whole.content or "")
    if whole.tool_calls:
        args = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert json.loads(args) == json.loads(whole.tool_calls[0].function.arguments)
        assert [d.function.name for d in deltas if d.function and d.function.name] == [
            whole.tool_calls[0].function.name
        ]


def test_templates_with_harmony_markup_pick_both_parsers():
    template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{% endfor %}"
    assert detect(template) == "openai_gptoss" and detect_tools(template) == "openai"


SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
            "<|constrain|>"]  # fmt: skip
TEMPLATE = (
    "<|start|>system<|message|>Reasoning:{% set effort = reasoning_effort | default('medium') %}"
    "{% for _ in range({'low': 1, 'medium': 4, 'high': 9}[effort]) %} deep{% endfor %}<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer has harmony's special tokens (rows for them in the model),
    served with the harmony parsers."""
    from transformers import AutoTokenizer

    from gpu.tiny_model import build_tiny_model
    from tests.conftest import LiveServer, tiny_config

    path = build_tiny_model(tmp_path_factory.mktemp("harmony") / "m", model_vocab_size=1100)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    config = tiny_config(lambda _: path, num_kv_blocks=64)
    s = LiveServer(config, reasoning_parser="openai_gptoss", tool_call_parser="openai").start()
    yield s
    s.stop()


def forced(grammar: str, **body) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is 2 x 21?"}],
        "max_tokens": 60,
        "guided_grammar": grammar,
        **body,
    }


ANSWER_GRAMMAR = (
    'start: <|channel|> "analysis" <|message|> "Two times 21." <|end|> <|start|> "assistant" '
    '<|channel|> "final" <|message|> "It is 42." <|return|>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_splits_a_harmony_reply(server, stream):
    """The markers are special tokens: read with them, none reaches the content; streamed and
    whole agree; the reasoning's tokens are counted."""
    body = forced(ANSWER_GRAMMAR, stream=stream)
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        msg = r["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("Two times 21.", "It is 42.")
        assert 0 < r["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert (
            r["usage"]["completion_tokens_details"]["reasoning_tokens"]
            < (r["usage"]["completion_tokens"])
        )
        return
    think, text = "", ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    think += choice["delta"].get("reasoning_content") or ""
                    text += choice["delta"].get("content") or ""
    assert (think, text) == ("Two times 21.", "It is 42.")


def test_a_required_call_is_written_in_harmony_and_read_back(server):
    """tool_choice required: the call grammar writes the call in harmony's own markup (its
    markers special tokens), and the reply is that call (the structured tests' biases end the
    random model's strings and whitespace)."""
    from tests.test_structured import close_bias, no_whitespace_bias

    bias = close_bias(server.state.tokenizer) | no_whitespace_bias(server.state.tokenizer)
    from tests.test_tools import BOUNDED

    tool = copy.deepcopy(BOUNDED[1])  # get_time(zone: UTC | CET), its zone made required
    tool["function"]["parameters"]["required"] = ["zone"]
    tools = [tool]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Time?"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 100,
        "logit_bias": bias,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")
    assert not choice["message"]["content"]


def test_reasoning_effort_reaches_the_template(server):
    """OpenAI's reasoning_effort is the template's variable of that name (gpt-oss's template
    writes it into its system message); a value OpenAI does not take is a 400 naming it."""
    url = server.url + "/v1/chat/completions"
    body = forced(ANSWER_GRAMMAR, max_tokens=1)
    tokens = {}
    for effort in ("low", "medium", "high", None):
        extra = {} if effort is None else {"reasoning_effort": effort}
        r = httpx.post(url, json=body | extra, timeout=60).json()
        tokens[effort] = r["usage"]["prompt_tokens"]
    assert tokens[None] == tokens["medium"]  # the template's own default
    assert tokens["low"] < tokens["medium"] < tokens["high"]
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    r = httpx.post(url, json=body | kwargs, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == tokens["low"]
    r = httpx.post(url, json=body | {"reasoning_effort": "extreme"}, timeout=60)
    assert r.status_code == 400 and "reasoning_effort" in r.text


def test_strict_tools_under_auto_hold_a_harmony_call(server):
    """tool_choice auto with strict tools: analysis (and preamble) messages, then a final
    answer or one call, held to the tool's parameters; read token by token over the harmony
    tokenizer (its markers special tokens)."""
    from core.structured import Constraint, Grammars
    from server.tool_parsers.openai import OpenAIParser
    from tests.test_tools import BOUNDED

    tok = server.state.tokenizer
    grammars = Grammars(tok.backend_tokenizer.to_str(), len(tok), [tok.eos_token_id])
    lark = OpenAIParser().auto_grammar(BOUNDED[:1], parallel=False, answer=False)

    def accepts(text: str) -> bool:
        matcher = grammars.start(Constraint("grammar", lark)).result()
        ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()

    think = "<|channel|>analysis<|message|>Weather, so a call.<|end|><|start|>assistant"
    call = "<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>"
    assert accepts(think + "<|channel|>final<|message|>It is sunny.")
    assert accepts(think + call.format('{"city": "Oslo", "unit": "c"}'))
    assert accepts(call.format('{"city": "Oslo", "unit": "f", "days": 3}'))
    for bad in (
        call.format('{"city": "Oslo", "unit": "k"}'),  # not in the enum
        call.format('{"city": "Oslo"}'),  # a required parameter missing
        call.replace("get_weather", "get_time").format('{"zone": "UTC"}'),  # not offered
        "It is sunny.",  # no harmony markup
    ):
        assert not accepts(think + bad), bad
    # an object that lists its properties is closed, as response_format's and every other
    # parser's calls are (before, harmony's arguments took any extra key)
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    lark = OpenAIParser().call_grammar([{"function": {"name": "f", "parameters": listed}}], False)
    call = call.replace("get_weather", "f")
    assert accepts(call.format('{"a": 1}')) and not accepts(call.format('{"a": 1, "b": 2}'))
