"""Tool-call markup that the tokenizer holds as special tokens (Mistral's [TOOL_CALLS] and [ARGS],
some Hermes models' <tool_call>): the enforced grammars write it as those tokens, never spelled
out in text tokens, and Mistral's v11 tokenizers get their own call form."""

from __future__ import annotations

import json

import pytest

from core.structured import Constraint
from server.tool_parsers.command import CommandParser
from server.tool_parsers.granite import GraniteParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.internlm import InternLMParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.qwen3_coder import Qwen3CoderParser
from tests.test_tool_schemas import INVALID, MARKUP, SCHEMAS, TOOLS, VALID


SPECIAL_MARKUP = (
    *("[TOOL_CALLS]", "<tool_call>", "</tool_call>", "<|tool_call|>"),
    *("<|START_ACTION|>", "<|END_ACTION|>", "<|action_start|>", "<|plugin|>", "<|action_end|>"),
)


class SpecialProbe:
    """A tokenizer holding `markup` as special tokens, and whether a grammar takes a text."""

    def __init__(self, model_dir, markup: tuple[str, ...]) -> None:
        from transformers import AutoTokenizer

        from core.structured import Grammars

        self.tok = tok = AutoTokenizer.from_pretrained(model_dir("qwen3", special_tokens=markup))
        self.markup = markup
        self.special = {t: tok.convert_tokens_to_ids(t) for t in markup}
        self.grammars = Grammars(tok.backend_tokenizer.to_str(), len(tok), [tok.eos_token_id])

    def takes(self, lark: str | Constraint, text: str, spelled: bool = False) -> bool:
        """`spelled`: the markup in ordinary text tokens, not as its special tokens."""
        ids = self.tok.encode(text, add_special_tokens=False, split_special_tokens=spelled)
        if not spelled:  # the tokenizer reads the markup as its special tokens
            assert all(self.special[m] in ids for m in self.markup if m in text), ids
        c = lark if isinstance(lark, Constraint) else Constraint("grammar", lark)
        matcher = self.grammars.start(c).result()
        ok = matcher.consume_tokens(ids)
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize(
    "parser",
    [MistralParser, HermesParser, Qwen3CoderParser, GraniteParser, CommandParser, InternLMParser],
)
def test_markup_that_is_a_special_token_is_written_as_that_token(model_dir, parser):
    """Where the tokenizer holds the markup as a special token (Mistral's [TOOL_CALLS]; some
    Hermes models' <tool_call>; Granite's <|tool_call|>; Command R7B's <|START_ACTION|>;
    InternLM's two, <|action_start|><|plugin|>), the grammars take that token and refuse the
    markup spelled out in text tokens (what llguidance does with quoted text: it never matches
    a special token), in an enforced call and in a strict tool's auto reply; text stays free."""
    from server.tool_parsers.grammar import strict_only

    probe = SpecialProbe(model_dir, SPECIAL_MARKUP)
    takes = probe.takes
    p = parser(TOOLS, probe.special)
    call = MARKUP[parser]("place", VALID["place"])
    one = p.call_grammar(TOOLS, parallel=False)
    assert takes(one, call) and not takes(one, call, spelled=True)
    auto = p.auto_grammar(strict_only(TOOLS), parallel=True, answer=False)
    for text, spelled, ok in (
        ("Just text, no call.", False, True),
        ("Let me look. " + call, False, True),
        (call, False, True),
        ("Let me look. " + call, True, False),
    ):
        assert takes(auto, text, spelled) is ok, (text, spelled)
    # without the tokenizer's special tokens the grammar is text, as before
    plain = parser(TOOLS).call_grammar(TOOLS, parallel=False)
    assert not takes(plain, call) and takes(plain, call, spelled=True)


def test_mistral_v11_calls_are_written_name_args_json(model_dir):
    """A tokenizer with [ARGS] as a special token is Mistral's v11 or later (Mistral Small 3.2,
    Magistral, Devstral), whose models write `[TOOL_CALLS]name[ARGS]{...}` per call: the
    enforced grammar writes that form, the arguments typed by the named function's schema
    (its references resolved), several calls only when parallel; the v3 JSON list is refused."""
    from server.tool_parsers.grammar import strict_only

    probe = SpecialProbe(model_dir, ("[TOOL_CALLS]", "[ARGS]"))
    takes = probe.takes
    p = MistralParser(TOOLS, probe.special)

    def call(name: str, args: dict) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]" + json.dumps(args)

    one = p.call_grammar(TOOLS, parallel=False)
    for name in SCHEMAS:
        assert takes(one, call(name, VALID[name])), name
        assert not takes(one, call(name, INVALID[name])), name
        assert not takes(one, call(name, {**VALID[name], "extra": 1})), name  # closed
    assert not takes(one, MARKUP[MistralParser]("place", VALID["place"]))  # the v3 list
    two = call("place", VALID["place"]) + call("grow_tree", VALID["grow_tree"])
    assert not takes(one, two) and takes(p.call_grammar(TOOLS, parallel=True), two)
    auto = p.auto_grammar(strict_only(TOOLS), parallel=True, answer=False)
    assert takes(auto, "No call needed.") and takes(auto, "Looking. " + two)
    assert not takes(auto, "Looking. " + call("place", VALID["place"]), spelled=True)
    parsed = p.parse("Looking. " + two, final=True)
    assert parsed.content == "Looking. "
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("place", VALID["place"]),
        ("grow_tree", VALID["grow_tree"]),
    ]


@pytest.mark.parametrize("think", ["optional", "open"])
def test_a_think_block_of_special_tokens_before_a_constraint(model_dir, think):
    """A reasoning parser whose markers are special tokens (Command R7B's, Magistral's): the
    constraint holds after the block those tokens open and close (core/structured.py
    think_marks), not after Qwen's `<think>` text; the markers spelled in text tokens close
    nothing."""
    start, end = "<|START_THINKING|>", "<|END_THINKING|>"
    probe = SpecialProbe(model_dir, (start, end))
    marks = tuple(f"<[{probe.special[m]}]>" for m in (start, end))
    lark = Constraint("choice", json.dumps(["ok"]), think=think, think_marks=marks)
    opened = start if think == "optional" else ""
    assert probe.takes(lark, f"{opened}a plan, with <think> in it{end} ok")
    assert not probe.takes(lark, f"{opened}a plan{end} no")
    assert not probe.takes(lark, f"{opened}a plan{end} ok", spelled=True)
    if think == "optional":
        assert probe.takes(lark, "ok") and not probe.takes(lark, "<think>a plan</think>ok")
