"""What every tool-call parser shares: the parse result, partial JSON, and the rule that makes
streaming safe.

A parser's `parse(text, final)` must be prefix-stable: for any longer text, the content it
returns extends this content, the calls extend these calls (a call, once found, keeps its index
and name) and each call's arguments only gain keys and items. Streaming is then the difference
between successive parses (`ToolStream`), so streamed and whole results cannot disagree however
the tokens are chunked: the bug class where calls are lost or arguments garbled when a delta
carries several tokens cannot occur.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from partial_json_parser import Allow, MalformedJSON
from partial_json_parser import loads as _partial_loads

from server.tool_parsers.grammar import literal


@dataclass
class Call:
    name: str
    arguments: Any = field(default_factory=dict)  # parsed JSON; may still grow
    complete: bool = False  # its markup is closed: the arguments are final


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


_decoder = json.JSONDecoder()
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = set('"\\/bfnrtu')


def json_prefix(text: str) -> int:
    """The length of the longest prefix of `text` that some JSON value begins with (the
    partial parser is lenient with what is not, so it only sees this prefix): a strict scan
    of strings, numbers, literals and the nesting of objects and arrays."""
    stack: list[str] = []  # "{" or "["
    expect = "value"  # value | key | key_or_end | value_or_end | colon | comma_or_end | done
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in " \t\r\n":
            i += 1
            continue
        if expect == "done":
            return i
        if ch == '"' and expect in ("value", "value_or_end", "key", "key_or_end"):
            j, hexes = i + 1, 0
            while j < n:
                c = text[j]
                if hexes:
                    if c not in "0123456789abcdefABCDEF":
                        return j
                    hexes -= 1
                elif c == "\\":
                    if j + 1 < n and text[j + 1] not in _ESCAPES:
                        return j
                    hexes = 4 if j + 1 < n and text[j + 1] == "u" else 0
                    j += 1
                elif c == '"':
                    break
                elif ord(c) < 0x20:
                    return j
                j += 1
            if j >= n:
                return n  # an unfinished string
            expect = "colon" if expect in ("key", "key_or_end") else "comma_or_end"
            i = j + 1
        elif expect in ("value", "value_or_end") and (ch == "-" or ch.isdigit()):
            m = _NUMBER.match(text, i)
            i = m.end()
            if i < n and text[i] not in " \t\r\n,]}":
                return i
            expect = "comma_or_end"
        elif expect in ("value", "value_or_end") and ch in "tfn":
            for lit in _LITERALS:
                if text.startswith(lit[: n - i], i) and lit[0] == ch:
                    if n - i < len(lit):
                        return n  # an unfinished literal
                    i += len(lit)
                    break
            else:
                return i
            expect = "comma_or_end"
        elif expect in ("value", "value_or_end") and ch in "{[":
            stack.append(ch)
            expect = "key_or_end" if ch == "{" else "value_or_end"
            i += 1
            continue
        elif ch in "}]" and (
            expect in ("comma_or_end", "key_or_end", "value_or_end")
            and stack
            and stack[-1] == ("{" if ch == "}" else "[")
            and not (expect == "key_or_end" and ch == "]")
            and not (expect == "value_or_end" and ch == "}")
        ):
            stack.pop()
            i += 1
            expect = "comma_or_end"
        elif ch == ":" and expect == "colon":
            expect = "value"
            i += 1
            continue
        elif ch == "," and expect == "comma_or_end" and stack:
            expect = "key" if stack[-1] == "{" else "value"
            i += 1
            continue
        else:
            return i
        if not stack and expect == "comma_or_end":
            expect = "done"
    return n


def partial_json(text: str) -> Any:
    """The JSON value `text` begins, with unfinished objects and arrays closed and unfinished
    strings, numbers and literals left out (so nothing in it changes later); None if `text`
    does not begin JSON. Where the text turns invalid part-way, the value is that of its
    longest valid beginning, which only ever grows: a value found once is never lost."""
    text = text[: json_prefix(text)].strip()
    if not text:
        return None
    try:
        return _decoder.raw_decode(text)[0]
    except (ValueError, RecursionError):
        pass
    try:
        return _partial_loads(text, Allow.OBJ | Allow.ARR)
    except (MalformedJSON, ValueError, IndexError, RecursionError, TypeError, AssertionError):
        return None  # the library asserts on some input rather than raising its own error


def whole_json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nesting past the parser's depth: no call either
        return None


def call_from(obj: Any, complete: bool) -> Call | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a Call (None without a whole name).
    While the call is being written its arguments are None until they begin (nothing of them
    is sent: they may turn out a number or a list, not an object); arguments written as a
    JSON string are read once whole, and a string that is not JSON makes no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    args = obj[key] if key is not None else None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        if not complete:
            args = None
        else:
            args = whole_json(args)
            if args is None:
                return None
    if complete and args is None:
        args = {}
    return Call(obj["name"], args, complete)


def whole_call(text: str) -> Call | None:
    """A call's finished JSON text -> its Call; None where it does not parse whole (a raw
    newline in a string, a dropped quote, a cut) or holds no call: its text is then content,
    as vLLM's parsers (which json.loads it) give it, never a call with arguments the model
    did not write."""
    return call_from(whole_json(text.strip()), True)


def closed_json(text: str) -> bool:
    """Whether `text` begins with a whole JSON value: a list closed by its own bracket, not by
    a `]` inside one of its strings or nested lists (a stream's chunk may end on either)."""
    try:
        _decoder.raw_decode(text.lstrip())
    except (ValueError, RecursionError):
        return False
    return True


def listed_calls(rest: str, final: bool) -> list[Call]:
    """The calls of a JSON list of call objects being written (`rest` begins with it): each
    item once it has a whole name; the last is complete only once the list is closed."""
    value = partial_json(rest)
    calls = []
    closed = final or closed_json(rest)
    for j, item in enumerate(value if isinstance(value, list) else []):
        done = closed or j < len(value) - 1
        call = call_from(item, done)
        if call is not None:
            calls.append(call)
    return calls


def whole_listed_calls(rest: str) -> list[Call | None]:
    """A finished JSON list of call objects: one Call an item (None for an item that is not a
    call, and [None] where the text is not a whole list)."""
    value = whole_json(rest)
    return [call_from(item, True) for item in value] if isinstance(value, list) else [None]


def dumps(arguments: Any) -> str:
    """The arguments' JSON text, non-ASCII as itself; escaped where it holds a lone surrogate
    (a `\\ud800` the model wrote), which no UTF-8 reply can carry."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


def stable_prefix(arguments: Any) -> str:
    """The part of the arguments' JSON text that no later, fuller parse can change: without
    the closing brackets that only the partial parse added."""
    return dumps(arguments).rstrip("]}")


class ToolParser:
    """Subclasses implement parse(), and call_grammar() for tool_choice required or a named
    function: a Lark grammar (llguidance's, with embedded JSON schemas) of the model's own call
    markup; `markers` is what `auto` looks for in a chat template."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(
        self, tools: list[dict[str, Any]] | None = None, special: Mapping[str, int] | None = None
    ) -> None:
        """`tools`: the request's tools, for parsers that type values by their schemas;
        `special`: the tokenizer's special tokens (text -> id), which a grammar writes as
        tokens (`literal`)."""
        self.special: Mapping[str, int] = special or {}

    def lit(self, text: str) -> str:
        """`text` as a Lark sequence, its special tokens as tokens (`literal`)."""
        return literal(text, self.special)

    def parse(self, text: str, final: bool = False) -> Parsed:
        raise NotImplementedError

    def call_grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str | None:
        """None: no grammar for this markup (enforced calls then use hermes's)."""
        return None

    def auto_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: bool) -> str | None:
        """tool_choice auto with strict tools: a Lark grammar of a reply that is text (with
        `answer`: the nested grammar @answer) or calls in this markup to `tools` (strict_only's).
        None: no grammar for this markup; the calls are then parsed, not enforced."""
        return None
