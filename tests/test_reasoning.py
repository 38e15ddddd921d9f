"""Reasoning parsers: think text split from the answer, whole and streamed in any chunking, through
the server (non-streaming, streaming, n=2) with a random model forced to write the markup by a
choice constraint; earlier answers' reasoning and tool-call arguments reach the template."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.cli import main
from server.reasoning import PARSERS, ReasoningStream, detect, resolve
from tests.conftest import LiveServer, tiny_config

THINK = "<think>\nLet me think: 2 × 21 🤔\n</think>\n\nThe answer is 42."
# ChatML that, like Qwen3's template, closes an empty think block when enable_thinking is false
# (then a constraint holds from the first token), or opens one when `think_first` is true (the
# thinking-only models: the output starts inside the reasoning).
THINKING_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_first is defined and think_first %}<think>\n{% endif %}{% endif %}"
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def split(name: str, text: str, prompt: str = "") -> tuple[str | None, str]:
    return PARSERS[name](prompt).split(text, final=True)


def test_qwen3_splits_think_blocks():
    assert split("qwen3", THINK) == ("\nLet me think: 2 × 21 🤔\n", "\n\nThe answer is 42.")
    assert split("qwen3", "Just an answer.") == (None, "Just an answer.")
    # The thinking-only models' template opens the block in the prompt.
    opened = "<|im_start|>assistant\n<think>\n"
    assert split("qwen3", "hmm\n</think>\n\nYes.", opened) == ("hmm\n", "\n\nYes.")
    # enable_thinking false: the template closes an empty block; the output is all answer.
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert split("qwen3", "Yes </think> no", closed) == (None, "Yes </think> no")
    # Cut off while thinking: everything so far is reasoning.
    assert split("qwen3", "<think>still going") == ("still going", "")


def test_deepseek_r1_starts_in_reasoning():
    assert split("deepseek_r1", "ponder</think>Done") == ("ponder", "Done")
    assert split("deepseek_r1", "<think>ponder</think>Done") == ("ponder", "Done")
    assert split("deepseek_r1", "no end marker at all") == ("no end marker at all", "")


def test_mistral_splits_magistral_think_blocks():
    text = "[THINK]2 × 21, so 42 🤔[/THINK]The answer is 42."
    assert split("mistral", text) == ("2 × 21, so 42 🤔", "The answer is 42.")
    assert split("mistral", "No thinking.") == (None, "No thinking.")
    assert split("mistral", "[THINK]cut off") == ("cut off", "")
    assert stream("mistral", ["[TH", "INK]a", "[/", "THINK]b"]) == ("a", "b")
    assert PARSERS["mistral"].special_tokens  # its markers are special tokens: kept in the text
    assert detect("{{ '[THINK]' + m.thinking + '[/THINK]' }}") == "mistral"


def test_command_splits_its_plan_and_unwraps_its_answer():
    """Cohere's Command R7B: the plan between its thinking markers, the answer's own
    <|START_RESPONSE|> / <|END_RESPONSE|> out of the content (special tokens, kept in the text);
    its action markup left in the content for the tool parser."""
    plan, answer = "<|START_THINKING|>I will look it up.<|END_THINKING|>", "It is 42."
    wrapped = f"<|START_RESPONSE|>{answer}<|END_RESPONSE|>"
    assert split("command", plan + wrapped) == ("I will look it up.", answer)
    assert split("command", wrapped) == (None, answer)
    action = "<|START_ACTION|>[]<|END_ACTION|>"
    assert split("command", plan + action) == ("I will look it up.", action)
    chunks = ["<|START_", "THINKING|>a<|END_", "THINKING|><|START_RES", "PONSE|>b<|END_"]
    chunks.append("RESPONSE|>")
    assert stream("command", chunks) == ("a", "b")
    assert PARSERS["command"].special_tokens
    assert detect("{{ '<|START_THINKING|>' + plan + '<|END_THINKING|>' }}") == "command"


def test_granite_splits_its_thought_process_from_its_response():
    """Granite 3.2's plain-text markers, "Here is" or "Here's" either side, held back while a
    chunk may still be one; text that opens otherwise is all content."""
    text = "Here is my thought process:\n2 × 21 🤔\nHere's my response:\nIt is 42."
    assert split("granite", text) == ("\n2 × 21 🤔\n", "\nIt is 42.")
    assert split("granite", "Here's my thought process: a Here is my response: b") == (" a ", " b")
    assert split("granite", "Here is the answer: 42") == (None, "Here is the answer: 42")
    assert split("granite", "Here is my thought process: cut") == (" cut", "")
    chunks = ["Here", " is my thought", " process: a Here", "'s my", " response: b"]
    assert stream("granite", chunks) == (" a ", " b")
    assert stream("granite", ["Here", " is", " fine."]) == ("", "Here is fine.")
    template = "Write your thoughts after 'Here is my thought process:' and write your " + (
        "response after 'Here is my response:' for each user query."
    )
    assert detect(template) == "granite"


def test_hunyuan_unwraps_its_answer():
    """Hunyuan's <think> block, then its answer wrapped in <answer>...</answer> (the line
    breaks inside the wrapper are the wrapper's); its fast mode's empty block; an answer
    without the wrapper is content as it is."""
    text = "<think>\n2 × 21\n</think>\n<answer>\nIt is 42.\n</answer>"
    assert split("hunyuan_a13b", text) == ("\n2 × 21\n", "It is 42.")
    assert split("hunyuan_a13b", "<think>\n\n</think>\n<answer>\nHi\n</answer>") == ("\n\n", "Hi")
    assert split("hunyuan_a13b", "Just text.") == (None, "Just text.")
    assert split("hunyuan_a13b", "<think>a</think><answer>cut") == ("a", "cut")
    chunks = ["<think>a</th", "ink>\n<ans", "wer>\nIt is", " 42.\n</ans", "wer>"]
    assert stream("hunyuan_a13b", chunks) == ("a", "It is 42.")
    # a close without the line break before it is held back too (found by the property test)
    assert stream("hunyuan_a13b", ["<answer><", "/answer>"]) == ("", "")
    assert detect("{{ '<think>' + r + '</think><answer>' + c + '</answer>' }}") == "hunyuan_a13b"


def test_auto_picks_from_the_template():
    assert detect("{% if x %}<think>\n{{ r }}\n</think>{% endif %}") == "qwen3"
    assert detect("<|im_start|>{{ m.role }}") is None and resolve(None, "<think></think>") is None
    assert resolve("auto", "<think></think>") == "qwen3"
    with pytest.raises(ValueError, match="unknown"):
        resolve("nonsense", None)


def stream(name: str, chunks: list[str], prompt: str = "") -> tuple[str, str]:
    s = ReasoningStream(PARSERS[name](prompt))
    think, text = "", ""
    for j, piece in enumerate(chunks):
        dr, dc = s.feed(piece, final=j == len(chunks) - 1)
        think, text = think + dr, text + dc
    return think, text


PIECES = st.sampled_from(
    ["<think>", "</think>", "<", "</", "think", ">", "\n", "a", "é", "🤔", " answer ", "<th"]
    + ["[THINK]", "[/THINK]", "[", "[/", "THINK]"]
    + ["<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|"]
    + ["Here is my thought process:", "Here's my response:", "Here", " is my ", "response:"]
    + ["<answer>", "</answer>", "<ans", "wer>"]
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(PIECES, max_size=12),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    name=st.sampled_from(sorted(PARSERS)),
    opened=st.booleans(),
)
def test_streamed_deltas_reassemble_to_the_whole_split(pieces, cuts, name, opened):
    """For any text and any chunking, the streamed reasoning and content are exactly the
    whole-text split: markers split across chunks are never leaked or lost."""
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    prompt = getattr(PARSERS[name], "start", "<think>") + "\n" if opened else ""
    whole_think, whole_text = split(name, text, prompt)
    assert stream(name, chunks, prompt) == (whole_think or "", whole_text)
    assert stream(name, list(text) + [""], prompt) == (whole_think or "", whole_text)


# ---------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def server(model_dir):
    # <think> and </think> are whole tokens, as in Qwen3's vocabulary.
    config = tiny_config(model_dir, num_kv_blocks=64, chat_template=THINKING_CHATML)
    config.model = str(model_dir("qwen3", added_tokens=("<think>", "</think>")))
    s = LiveServer(config, reasoning_parser="qwen3").start()
    yield s
    s.stop()


def forced(**kw) -> dict:
    """The random model writes exactly THINK: a choice constraint with one member (thinking
    off in the template, so the constraint holds from the first token)."""
    extra = {"guided_choice": [THINK], **NO_THINKING} | kw.pop("extra_body", {})
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is 2 x 21?"}],
        "max_tokens": 100,
        "extra_body": extra,
        **kw,
    }


def tokens_to_end_of_reasoning(entries) -> int:
    """The generated tokens (log-prob entries) up to the one that completes </think>: what
    reasoning_tokens counts (the grammar lets the model spell the text in any tokens)."""
    written = b""
    for count, entry in enumerate(entries, 1):
        written += bytes(entry.bytes)
        if b"</think>" in written:
            return count
    raise AssertionError("no </think> written")


def test_reasoning_through_the_sdk(server, client):
    r = client.chat.completions.create(**forced(n=2, temperature=1.0, logprobs=True))
    counts = [tokens_to_end_of_reasoning(c.logprobs.content) for c in r.choices]
    assert r.usage.completion_tokens_details.reasoning_tokens == sum(counts)
    assert sum(counts) < r.usage.completion_tokens
    for choice in r.choices:
        msg = choice.message
        assert msg.content == "\n\nThe answer is 42." and choice.finish_reason == "stop"
        assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]
        assert msg.model_extra["reasoning_content"] == "\nLet me think: 2 × 21 🤔\n"
    chunks = list(
        client.chat.completions.create(
            **forced(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
        )
    )
    counts = [
        tokens_to_end_of_reasoning(
            [e for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].logprobs
             for e in c.choices[0].logprobs.content]
        )
        for i in range(2)
    ]  # fmt: skip
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == sum(counts)
    # cut inside the reasoning: every generated token was reasoning, and no more than those
    # (it had re-encoded the text, which a cut multi-byte character made longer)
    for stream in (False, True):
        kw = forced(max_tokens=12, stream=stream)
        if stream:
            kw["stream_options"] = {"include_usage": True}
            cut = list(client.chat.completions.create(**kw))[-1].usage
        else:
            cut = client.chat.completions.create(**kw).usage
        assert cut.completion_tokens == 12
        assert cut.completion_tokens_details.reasoning_tokens == 12
    for i in range(2):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i]
        think = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        also = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
        text = "".join(d.content or "" for d in deltas)
        assert (think, also, text) == (
            "\nLet me think: 2 × 21 🤔\n",
            "\nLet me think: 2 × 21 🤔\n",
            "\n\nThe answer is 42.",
        )
        assert not any("<think>" in (d.content or "") for d in deltas)


def test_plain_answers_have_no_reasoning(server, client):
    r = client.chat.completions.create(**forced(extra_body={"guided_choice": ["Plain answer."]}))
    assert r.choices[0].message.content == "Plain answer."
    assert r.choices[0].message.model_extra["reasoning_content"] is None


def end_bias(tok) -> dict[str, float]:
    """Inside a free think block a random model would write forever: favour the `</think>`
    token so it ends (the grammar decides what follows)."""
    ids = tok.encode("</think>", add_special_tokens=False)
    assert len(ids) == 1
    return {str(ids[0]): 6.0}


@pytest.mark.parametrize("think_first", [False, True])
def test_constraints_hold_once_the_reasoning_ends(server, think_first):
    """A thinking model reasons freely, then answers inside the constraint: the template may
    leave the think block to the model (optional) or open it in the prompt."""
    kwargs = {"think_first": True} if think_first else {}
    body = {
        "messages": [{"role": "user", "content": "Yes or no?"}],
        "max_tokens": 120,
        "temperature": 1.0,
        "n": 4,
        "guided_choice": ["yes", "no"],
        "logit_bias": end_bias(server.state.tokenizer),
        "chat_template_kwargs": kwargs,
    }
    for seed in range(3):
        r = httpx.post(server.url + "/v1/chat/completions", json=body | {"seed": seed}).json()
        for c in r["choices"]:
            msg = c["message"]
            assert c["finish_reason"] == "stop" and msg["content"].strip() in ("yes", "no"), msg
            if think_first:
                assert msg["reasoning_content"] is not None


@pytest.mark.parametrize("think_first", [False, True])
def test_a_constraint_that_matches_nothing_after_the_reasoning_is_a_400(server, think_first):
    """The think block matches any text: what follows it is checked alone (a regex that
    matches nothing had let the request run, then fail as "The engine failed")."""
    body = {
        "messages": [{"role": "user", "content": "Yes or no?"}],
        "max_tokens": 8,
        "guided_regex": r"[^\s\S]",
        "chat_template_kwargs": {"think_first": True} if think_first else {},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and "matches no text" in err["message"], err


def test_earlier_reasoning_and_tool_arguments_reach_the_template(model_dir):
    template = (
        "{% for m in messages %}[{{ m.role }}]"
        "{% if m.reasoning_content %}(thought: {{ m.reasoning_content }}){% endif %}"
        "{% for tc in m.tool_calls or [] %}(call {{ tc.function.name }} "
        "city={{ tc.function.arguments.city }}){% endfor %}"
        "{{ m.content }}{% endfor %}"
    )
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=32, chat_template=template)).start()
    try:
        messages = [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning": "check Paris",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        ids = httpx.post(s.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        text = s.state.tokenizer.decode(ids)
        assert "(thought: check Paris)" in text and "(call weather city=Paris)" in text
        messages[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls"
    finally:
        s.stop()


def test_reasoning_parser_flag(capsys):
    assert main(["serve", "--reasoning-parser", "bogus"]) == 2
    assert "--reasoning-parser 'bogus' is unknown" in capsys.readouterr().err


def test_a_marker_inside_a_message_opens_no_reasoning(server):
    """Where the template opened or closed a think block is read in its generation prompt, not
    anywhere in the prompt: a user asking about the <think> tag had put the whole answer into
    reasoning (and kept a structured output from being enforced)."""
    import msgspec

    from server import chat
    from server.requests import ChatCompletionRequest
    from server.reasoning import PARSERS

    st = server.state

    def tail(content: str, **kw) -> str:
        req = msgspec.convert(
            {"messages": [{"role": "user", "content": content}], **kw}, ChatCompletionRequest
        )
        prompt = chat.request_text(st.tokenizer, st.chat_template, req)
        return chat.generation_tail(st.tokenizer, st.chat_template, prompt, req)

    asked = tail("What does the <think> tag do?", chat_template_kwargs={"think_first": False})
    assert "<think>" not in asked
    assert PARSERS["qwen3"](asked).split("It marks reasoning.", True) == (
        None, "It marks reasoning.",
    )  # fmt: skip
    # the template's own generation prompt still opens or closes it
    assert PARSERS["qwen3"](tail("hi", chat_template_kwargs={"think_first": True})).in_reasoning
    off = tail("Why write </think>?", chat_template_kwargs={"enable_thinking": False})
    assert PARSERS["qwen3"](off).thinking_off
    # a continued message: its own text says
    req = msgspec.convert(
        {
            "messages": [{"role": "assistant", "content": "<think>so far"}],
            "continue_final_message": True,
        },
        ChatCompletionRequest,
    )
    assert chat.generation_tail(st.tokenizer, st.chat_template, "", req) == "<think>so far"
