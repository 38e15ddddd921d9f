"""The flags of how chats are rendered and their replies read: the chat template (the server's,
and vLLM's --trust-request-chat-template for a request's own), the reasoning and tool-call
parsers."""

from __future__ import annotations

import argparse


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--chat-template", default=None, help="a Jinja template file or text")
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request with its own chat_template field (vLLM's flag; without it "
        "such a request is refused, as vLLM refuses it)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        help="split a thinking model's output into `reasoning` (also sent as "
        "`reasoning_content`) and `content`: qwen3, deepseek_r1, mistral, openai_gptoss, or "
        "auto (from the chat template's markup)",
    )
    s.add_argument(
        "--tool-call-parser",
        default="auto",
        help="how a model's tool calls are read from its output: hermes, llama3_json, mistral, "
        "pythonic, qwen3_coder, phi4_mini_json, openai, or auto (default: the parser whose "
        "markup the chat template writes)",
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted as vLLM spells it: tool_choice auto works whenever a parser is known",
    )
