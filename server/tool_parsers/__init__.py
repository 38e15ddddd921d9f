"""Tool-call parsers: a model's own call markup into OpenAI `tool_calls`. One parser per file,
one registry; `--tool-call-parser NAME`, or `auto` (the default) to pick from the chat
template's markup. Streaming is the difference between successive whole-text parses
(server/tool_parsers/stream.py), so it cannot disagree with the non-streamed answer."""

from __future__ import annotations

from server.tool_parsers.base import Call, Parsed, ToolParser
from server.tool_parsers.command import CommandParser
from server.tool_parsers.granite import GraniteParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.hunyuan import HunyuanParser
from server.tool_parsers.internlm import InternLMParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.openai import OpenAIParser
from server.tool_parsers.phi4_mini import Phi4MiniJsonParser
from server.tool_parsers.pythonic import PythonicParser
from server.tool_parsers.qwen3_coder import Qwen3CoderParser
from server.tool_parsers.stream import ToolStream, tool_calls

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        Qwen3CoderParser,
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        OpenAIParser,
        Phi4MiniJsonParser,
        GraniteParser,
        CommandParser,
        InternLMParser,
        HunyuanParser,
    )
}
CHOICES = (*PARSERS, "auto")


# Most specific markup first: harmony's (gpt-oss) special tokens, Command R7B's
# <|START_ACTION|>, InternLM's <|plugin|>, Granite's <|tool_call|>, Hunyuan's <tool_calls> (before
# hermes' <tool_call>, which it contains), Qwen3-Coder's templates also write <tool_call>, and
# pythonic templates may mention "parameters".
DETECT_ORDER = (
    *("openai", "command", "internlm", "granite", "hunyuan_a13b", "qwen3_coder", "hermes"),
    "mistral",
    *("phi4_mini_json", "pythonic", "llama3_json"),
)


def detect(template: str | None) -> str | None:
    """The parser whose markup the chat template writes (None: no tool-call markup found)."""
    if not template:
        return None
    for name in DETECT_ORDER:
        if any(marker in template for marker in PARSERS[name].markers):
            return name
    return None


def resolve(name: str | None, template: str | None) -> str | None:
    if name is None or name == "auto":
        return detect(template)
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is unknown; weir has {', '.join(CHOICES)}")
    return name


__all__ = ["PARSERS", "CHOICES", "Call", "Parsed", "ToolParser", "ToolStream", "detect",
           "resolve", "tool_calls"]  # fmt: skip
