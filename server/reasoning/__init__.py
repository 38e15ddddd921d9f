"""Reasoning parsers: a thinking model's output split into its reasoning and its answer, for
`message.reasoning` / `reasoning_content` and `message.content`. One parser per file, one
registry; `--reasoning-parser NAME`, or `auto` to pick from the chat template's own markup.

Every parser's `split(text, final)` is prefix-stable: for any later, longer text, the reasoning
and content it returns extend the ones returned now. Streaming is then just the difference
between successive splits (`ReasoningStream`), so a streamed answer and a whole one cannot
disagree, wherever the chunks happen to cut a marker."""

from __future__ import annotations

from server.reasoning.command import CommandReasoningParser
from server.reasoning.deepseek_r1 import DeepSeekR1Parser
from server.reasoning.granite import ENDS, STARTS, GraniteParser
from server.reasoning.harmony import HarmonyParser
from server.reasoning.hunyuan import HunyuanParser
from server.reasoning.mistral import MistralParser
from server.reasoning.qwen3 import Qwen3Parser
from server.reasoning.think import ReasoningStream, ThinkParser

PARSERS: dict[str, type[ThinkParser]] = {
    "qwen3": Qwen3Parser,
    "deepseek_r1": DeepSeekR1Parser,
    "openai_gptoss": HarmonyParser,  # vLLM's name for gpt-oss's harmony format
    "mistral": MistralParser,  # Magistral's [THINK] ... [/THINK]
    "command": CommandReasoningParser,  # Cohere's <|START_THINKING|> ... <|END_THINKING|>
    "granite": GraniteParser,  # Granite 3.2's "Here is my thought process:" ... its response
    "hunyuan_a13b": HunyuanParser,  # Hunyuan's <think> ... </think><answer> ... </answer>
}
CHOICES = (*PARSERS, "auto")


def detect(template: str | None) -> str | None:
    """The parser a chat template's markup calls for (None: the template shows no reasoning)."""
    if template and "<|channel|>" in template:  # harmony (gpt-oss)
        return "openai_gptoss"
    if template and "<|START_THINKING|>" in template and "<|END_THINKING|>" in template:
        return "command"
    if template and STARTS[0] in template and ENDS[0] in template:
        return "granite"
    if template and "<think>" in template and "<answer>" in template:
        return "hunyuan_a13b"
    if template and "<think>" in template and "</think>" in template:
        return "qwen3"
    if template and "[THINK]" in template and "[/THINK]" in template:
        return "mistral"
    return None


def resolve(name: str | None, template: str | None) -> str | None:
    """--reasoning-parser's value for this model: a registered name, `auto` resolved against
    the template, or None. ValueError for an unknown name."""
    if name is None:
        return None
    if name == "auto":
        return detect(template)
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is unknown; weir has {', '.join(CHOICES)}")
    return name


__all__ = ["PARSERS", "CHOICES", "ReasoningStream", "ThinkParser", "detect", "resolve"]
