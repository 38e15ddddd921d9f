"""Tool-call parsers on text: single, parallel, nested, unicode and broken inputs, whole and in any
chunking (streamed deltas reassemble to the whole-text result: a Hypothesis property)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_parsers import PARSERS, ToolStream, detect, resolve
from server.tool_parsers.base import dumps


def whole(name: str, text: str):
    parsed = PARSERS[name]().parse(text, final=True)
    return parsed.content, [(c.name, dumps(c.arguments)) for c in parsed.calls]


def streamed(name: str, chunks: list[str]):
    s = ToolStream(PARSERS[name]())
    content, calls = "", {}
    for j, piece in enumerate(chunks):
        text, deltas = s.feed(piece, final=j == len(chunks) - 1)
        content += text
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


WEATHER = '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}'
NESTED = '{"name": "plan", "arguments": {"steps": [{"do": "a", "then": {"x": null}}], "ok": true}}'


def test_hermes():
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{NESTED}</tool_call>"
    content, calls = whole("hermes", text + "\n")
    assert content == "Let me look.\n"  # whitespace after a call separates, is no content
    assert calls == [
        ("get_weather", '{"city": "Zürich", "days": [1, 2]}'),
        ("plan", '{"steps": [{"do": "a", "then": {"x": null}}], "ok": true}'),
    ]
    # Broken markup comes back as the text it was, never a half-parsed call or an error.
    broken = "Hi <tool_call>not json at all</tool_call> bye"
    assert whole("hermes", broken) == (broken, [])
    assert whole("hermes", 'cut off <tool_call>{"na') == ('cut off <tool_call>{"na', [])
    # a call cut short in its arguments (max_tokens, a stop string) is its text, not a call with
    # arguments it never wrote; one whose JSON is whole but lacks the closing tag is a call
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "St'
    assert whole("hermes", cut) == (cut, [])
    assert whole("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}\n') == (
        "",
        [("f", '{"a": 1}')],
    )
    not_a_call = "<tool_call>{}</tool_call> after"
    assert whole("hermes", not_a_call) == (not_a_call, [])
    assert whole("hermes", "no calls, 5 < 6") == ("no calls, 5 < 6", [])
    # Arguments written as a JSON string are read as JSON.
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert whole("hermes", as_string) == ("", [("f", '{"a": 1}')])


def test_llama3_json():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert whole("llama3_json", one) == ("", [("get_weather", '{"city": "Oslo"}')])
    two = f'<|python_tag|>{one}; {{"name": "now", "parameters": {{}}}}'
    assert whole("llama3_json", two)[1] == [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]
    assert whole("llama3_json", "Oslo is sunny.") == ("Oslo is sunny.", [])
    assert whole("llama3_json", "{not a call}") == ("{not a call}", [])


def test_mistral():
    listed = (
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    assert whole("mistral", listed) == ("Sure. ", [("a", '{"x": 1}'), ("b", "{}")])
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]now[ARGS]{}'
    assert whole("mistral", v11) == ("", [("get_weather", '{"city": "Lyon"}'), ("now", "{}")])
    assert whole("mistral", "plain [TOOL") == ("plain [TOOL", [])


def test_pythonic():
    text = '[get_weather(city="Oslo", days=3), get_time()]'
    assert whole("pythonic", text) == ("", [("get_weather", '{"city": "Oslo", "days": 3}'),
                                            ("get_time", "{}")])  # fmt: skip
    assert whole("pythonic", "Oslo is sunny.") == ("Oslo is sunny.", [])
    assert whole("pythonic", "[1, 2, 3]") == ("[1, 2, 3]", [])
    nested = "[plan(steps=[{'do': 'a'}], note='é, ok')]"
    assert whole("pythonic", nested)[1] == [("plan", '{"steps": [{"do": "a"}], "note": "é, ok"}')]


def test_qwen3_coder():
    text = (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert whole("qwen3_coder", text) == (
        "Sure.\n",
        [("get_weather", '{"city": "Zürich", "days": 3}')],
    )
    typed = PARSERS["qwen3_coder"](
        [{"function": {"name": "f", "parameters": {"properties": {"code": {"type": "string"}}}}}]
    ).parse("<tool_call><function=f><parameter=code>123</parameter></function></tool_call>", True)
    assert typed.calls[0].arguments == {"code": "123"}  # the schema says string
    broken = "<tool_call>no function here</tool_call>"
    assert whole("qwen3_coder", broken) == (broken, [])


def test_phi4_mini_json():
    listed = f'Sure. functools[{WEATHER}, {{"name": "now", "arguments": {{}}}}]'
    assert whole("phi4_mini_json", listed) == (
        "Sure. ",
        [("get_weather", '{"city": "Zürich", "days": [1, 2]}'), ("now", "{}")],
    )
    nested = f"functools[{NESTED}]"  # a list inside the arguments ends no call (vLLM's regex did)
    assert whole("phi4_mini_json", nested)[1][0][1].startswith('{"steps": [{"do": "a"')
    for plain in ("use functools.partial here", "functools", "functools[not json]"):
        assert whole("phi4_mini_json", plain) == (plain, [])
    # streamed: "functools" is held back until its "[" (or anything else) says what it was
    assert streamed("phi4_mini_json", ["a functools", ".partial"]) == ("a functools.partial", [])
    assert streamed("phi4_mini_json", ["a func", "tools[", WEATHER[:30], WEATHER[30:] + "]"]) == (
        "a ",
        [("get_weather", '{"city": "Zürich", "days": [1, 2]}')],
    )
    phi4_template = "{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] }}"
    assert detect(phi4_template) == "phi4_mini_json"


def test_granite():
    """After <|tool_call|> (3.0 and later), <tool_call> (as vLLM reads 3.1's) or none: a JSON
    list of calls; text before the marker is content, text alone is content."""
    calls = [("get_weather", '{"city": "Zürich", "days": [1, 2]}'), ("now", "{}")]
    listed = f'[{WEATHER}, {{"name": "now", "arguments": {{}}}}]'
    assert whole("granite", f"<|tool_call|>{listed}") == ("", calls)
    assert whole("granite", f" <|tool_call|> <tool_call>{listed}") == (" ", calls)
    assert whole("granite", f"<tool_call>{listed}") == ("", calls)
    assert whole("granite", f"\n{listed}") == ("", calls)  # the list alone, as vLLM reads it
    assert whole("granite", f"Checking. <|tool_call|>{listed}") == ("Checking. ", calls)
    for plain in ("It is sunny.", "[1] a footnote", "<|tool_call|>not json", "<b>bold</b>"):
        assert whole("granite", plain) == (plain, [])
    # streamed: the token, or the beginning of either marker, is held back until the list
    assert streamed("granite", ["Hi <|tool", "_call|>", " <tool", "_call>", listed]) == (
        "Hi ",
        calls,
    )
    assert streamed("granite", ["<to", "day>"]) == ("<today>", [])
    granite_template = "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}"
    assert detect(granite_template) == "granite"


def test_auto_detects_from_the_template():
    assert detect("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}") == (
        "hermes"
    )
    assert detect("[TOOL_CALLS]") == "mistral" and detect("<|python_tag|>") == "llama3_json"
    assert detect("{{ messages }}") is None and resolve("auto", None) is None
    with pytest.raises(ValueError, match="unknown"):
        resolve("bogus", None)


def test_command():
    """Cohere's list of {tool_call_id, tool_name, parameters} between <|START_ACTION|> and
    <|END_ACTION|>; the answer's and the plan's markers are no content."""
    listed = (
        '[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Zürich"}},'
        ' {"tool_call_id": "1", "tool_name": "plan", "parameters": {}}]'
    )
    calls = [("get_weather", '{"city": "Zürich"}'), ("plan", "{}")]
    action = f"<|START_ACTION|>{listed}<|END_ACTION|>"
    assert whole("command", action) == ("", calls)
    plan = "<|START_THINKING|>I will look.<|END_THINKING|>"
    assert whole("command", plan + action) == ("I will look.", calls)
    answer = "<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>"
    assert whole("command", answer) == ("It is sunny.", [])
    chunks = ["<|START_RES", "PONSE|>Hi", "<|START_ACT", "ION|>", listed, "<|END_ACTION|>"]
    assert streamed("command", chunks) == ("Hi", calls)
    assert detect("{{ '<|START_ACTION|>' + calls + '<|END_ACTION|>' }}") == "command"


def test_internlm():
    """InternLM's <|action_start|><|plugin|> {name, parameters} <|action_end|>, one or more,
    text before them."""
    call = '<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
    call += '{"city": "Zürich"}}'
    text = f"Let me check.{call}<|action_end|>"
    want = ("Let me check.", [("get_weather", '{"city": "Zürich"}')])
    assert whole("internlm", text) == want
    assert whole("internlm", text + call.replace("Zürich", "Oslo") + "<|action_end|>")[1] == [
        ("get_weather", '{"city": "Zürich"}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    for cut in (20, 40, 60):  # within the markers, the name, the arguments
        assert streamed("internlm", [text[:cut], text[cut:]]) == want, cut
    template = "{% if m.name == 'plugin' %}<|im_start|>system name=<|plugin|>{% endif %}"
    assert detect(template) == "internlm"


def test_hunyuan():
    """Hunyuan's JSON list of {name, arguments} between <tool_calls> and </tool_calls>."""
    listed = '[{"name": "get_weather", "arguments": {"city": "Zürich"}},'
    listed += ' {"name": "t", "arguments": {}}]'
    want = [("get_weather", '{"city": "Zürich"}'), ("t", "{}")]
    text = f"Checking.<tool_calls>{listed}</tool_calls>"
    assert whole("hunyuan_a13b", text) == ("Checking.", want)
    assert streamed("hunyuan_a13b", [text[:14], text[14:40], text[40:]]) == ("Checking.", want)
    assert detect("{{ '<tool_calls>' + calls + '</tool_calls>' }}") == "hunyuan_a13b"
    assert detect("{{ '<tool_call>' + call + '</tool_call>' }}") == "hermes"


def test_a_chunk_ending_in_a_bracket_inside_the_list_does_not_close_it():
    """A stream's chunk that ends on a `]` inside a string or a nested list is not the list's
    end: the last call was marked complete there, and its arguments went out cut ({} or a
    prefix), never corrected (found with Command R7B's random-model test)."""
    cases = {
        "granite": ("<|tool_call|>[", "]"),
        "mistral": ("[TOOL_CALLS][", "]"),
        "phi4_mini_json": ("functools[", "]"),
    }
    for name, (open_, close) in cases.items():
        for head, tail in (('"x": "b]', '"}'), ('"k": [1]', ', "m": 2}')):
            chunks = [f'{open_}{{"name": "a", "arguments": {{{head}', f"{tail}}}{close}"]
            assert streamed(name, chunks) == whole(name, "".join(chunks)), (name, chunks)
    chunks = ['<|START_ACTION|>[{"tool_name": "a", "parameters": {"x": "b]', '"}}]<|END_ACTION|>']
    assert streamed("command", chunks) == ("", [("a", '{"x": "b]"}')])


FRAGMENTS = {
    "hermes": [
        "<tool_call>", "</tool_call>", WEATHER, NESTED, '{"name": "f"', ', "arguments": {"a": ',
        '"ü", "b": [1, {"c": 2}]}}', "text ", "<tool", "_call>", "\n", "{", "}", "junk",
    ],
    "llama3_json": [
        "<|python_tag|>", '{"name": "f", "parameters": ', '{"a": [1, 2]', "}}", "; ",
        '{"name": "g", "parameters": {}}', "text", " ", "<|py", "{", '"x"',
    ],
    "pythonic": [
        "[", "]", "get_weather(", 'city="Oslo"', ", ", "days=3", ")", "f()", "text", "'a, b'",
        "[x", "(", "{'k': [1]}",
    ],
    "qwen3_coder": [
        "<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "1",
        "</parameter>", "<parameter=b>", "é x", "text ", "<tool", "\n", "<function=",
    ],
    "phi4_mini_json": [
        '{"name": "b", "arguments": {"s": "x]', '"}}', "functools", "[",
        '{"name": "a", "arguments": {"x": "é"}}', ", ", "]", "text ", "func",
        "tools", '{"k": [1, {"z": null}]}', ".partial", "{",
    ],
    "granite": [
        '{"name": "b", "arguments": {"s": "x]', '"}}', "<|tool_call|>", "<tool_call>", "[",
        '{"name": "a", "arguments": {"x": "é"}}', ", ", "]",
        "text ", "<|tool", "_call|>", "<tool", '{"k": [1, {"z": null}]}', " ", "{",
    ],
    "internlm": [
        "<|action_start|><|plugin|>", "<|action_end|>", '{"name": "f", "parameters": {"a": 1}}',
        '{"name": "g"', ', "parameters": {"x": "é]', '"}}', "text ", "<|action_", "\n", "{",
    ],
    "hunyuan_a13b": [
        "<tool_calls>", "</tool_calls>", "[", "]", ", ", '{"name": "a", "arguments": {"x": "é"}}',
        '{"name": "b", "arguments": {"s": "x]', '"}}', "text ", "<tool_", "calls>", "{",
    ],
    "command": [
        '{"tool_name": "c", "parameters": {"s": "x]', '"}}', "<|START_ACTION|>", "<|END_ACTION|>",
        "[", "]", ", ", "<|START_RESPONSE|>", "text ",
        '{"tool_call_id": "0", "tool_name": "a", "parameters": {"x": "é"}}', "<|END_RESPONSE|>",
        '{"tool_name": "b", "parameters": {"k": [1, {"z": null}]}}', "<|START_", "<|", "{",
    ],
    "mistral": [
        '{"name": "b", "arguments": {"s": "x]', '"}}', "[TOOL_CALLS]", "[",
        '{"name": "a", "arguments": {"x": "é"}}', ", ", "]", "a[ARGS]",
        '{"k": [1, {"z": null}]}', "text ", "[TOOL", "_CALLS]", "{",
    ],
}  # fmt: skip


def reassembles(name: str, text: str, got, expect) -> bool:
    """The stream's content and calls are the whole parse's; but where the end of the text
    shows calls broken (cut short, or JSON that does not parse whole), the stream has already
    announced them as they came, and the whole parse gives their text back as content (the
    stream's last delta carries it): its calls then begin with the whole parse's."""
    if got == expect:
        return True
    return got[0] == expect[0] and got[1][: len(expect[1])] == expect[1]


@settings(max_examples=250, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FRAGMENTS)))
def test_streamed_deltas_reassemble_to_the_whole_parse(data, name):
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=10))
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    bounds = sorted(set(cuts) | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    expect = whole(name, text)
    assert reassembles(name, text, streamed(name, chunks), expect), (text, chunks)
    assert reassembles(name, text, streamed(name, list(text) + [""]), expect)
    for _, args in expect[1]:
        json.loads(args)  # whatever was parsed is JSON


# A call whose JSON does not parse whole (a raw newline in a string, a cut) is its text: never
# a call with arguments the model did not write, as vLLM's parsers give it (found by an audit).
BROKEN = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "line1\nline2", "n": 2}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"n": 2, "a": "C:\\dir"}}</tool_call>'),
    ("hermes", "<tool_call>" + "[" * 5000),  # nesting past the JSON parser's depth
    ("llama3_json", '{"name": "f", "parameters": {"a": "ab'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {'),
    ("mistral", "[TOOL_CALLS]f[ARGS]"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "x'),
    ("mistral", "[TOOL_CALLS] not a call"),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}] trailing text'),
    ("phi4_mini_json", 'functools[{"name": "a", "arguments": {}}] trailing text'),
    ("phi4_mini_json", 'functools[{"name": "a", "arguments": {"b": "c'),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {}}] trailing text'),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {"b": "c'),
    ("granite", '[{"name": "a"}, 5]'),
    ("internlm", '<|action_start|><|plugin|>{"name": "f", "parameters": {"a": "b'),
    ("internlm", "<|action_start|><|plugin|>not json<|action_end|>"),
    ("hunyuan_a13b", '<tool_calls>[{"name": "a", "arguments": {}}]</tool_calls> more'),
    ("hunyuan_a13b", '<tool_calls>[{"name": "a", "arguments": {"b": "c'),
    ("command", '<|START_ACTION|>[{"tool_name": "a", "parameters": {}}]<|END_ACTION|> more'),
    ("command", '<|START_ACTION|>[{"tool_name": "a", "parameters": {"b": "c'),
    ("command", '<|START_ACTION|>[{"name": "a", "arguments": {}}]<|END_ACTION|>'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nhel"),
    ("pythonic", '[f(a="x")] Let me know if you need more.'),
    ("pythonic", '[f(a="x"), 5, g(x=1)]'),
    ("pythonic", "[f(a=1+2j)]"),
    ("pythonic", '[f(a=b"x")]'),
    ("pythonic", "[f(a=1)(b=2)]"),
    ("pythonic", '[f(**{"a": 1})]'),
]


@pytest.mark.parametrize("name,text", BROKEN)
def test_broken_or_cut_calls_are_content(name, text):
    assert whole(name, text) == (text, [])


def test_values_as_vllm_reads_them():
    # pythonic: sets and tuples as JSON lists
    assert whole("pythonic", "[f(a={1, 2}, b=(3, 4))]")[1] == [("f", '{"a": [1, 2], "b": [3, 4]}')]
    # qwen3_coder: one newline either side is markup; text where the schema allows a string;
    # no bare NaN/Infinity; the boolean schema `true` (it had been a 500)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "code": {"type": "string"}, "when": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "pick": {"enum": ["1", "yes"]}, "n": {"type": "number"}, "any": True}}}}]  # fmt: skip
    xml = (
        "<tool_call>\n<function=f>\n<parameter=code>\nprint(1)\n\n</parameter>\n"
        "<parameter=when>\n2024\n</parameter>\n<parameter=pick>\n1\n</parameter>\n"
        "<parameter=n>\nNaN\n</parameter>\n<parameter=any>\n7\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    parsed = PARSERS["qwen3_coder"](tools).parse(xml, final=True)
    assert parsed.calls[0].arguments == {
        "code": "print(1)\n", "when": "2024", "pick": "1", "n": "NaN", "any": "7",
    }  # fmt: skip
    # a lone surrogate the model wrote: escaped, so the reply can carry it (it had been a 500)
    assert dumps({"a": "\ud800"}) == '{"a": "\\ud800"}' and dumps({"a": "é"}) == '{"a": "é"}'
