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
from dataclasses import dataclass, field
from typing import Any

from partial_json_parser import Allow, MalformedJSON
from partial_json_parser import loads as _partial_loads


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


def _partial(text: str) -> Any:
    try:
        return _decoder.raw_decode(text)[0]  # a whole value (anything after it is not ours)
    except ValueError:
        pass
    try:
        return _partial_loads(text, Allow.OBJ | Allow.ARR)
    except (MalformedJSON, ValueError, IndexError, RecursionError, TypeError, AssertionError):
        return _BAD  # the library asserts on some malformed input rather than raising its own


_BAD = object()


def partial_json(text: str) -> Any:
    """The JSON value `text` begins, with unfinished objects and arrays closed and unfinished
    strings, numbers and literals left out (so nothing in it changes later); None if `text`
    does not begin JSON. Where the text turns invalid part-way, the value is that of its
    longest prefix that still begins JSON: being a valid start is kept by every shorter
    prefix, so that prefix only ever grows, and a value found once is never lost."""
    text = text.strip()
    if not text:
        return None
    value = _partial(text)
    if value is not _BAD:
        return value
    lo, hi = 0, len(text)  # text[:lo] begins JSON (or is empty); text[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _partial(text[:mid].rstrip()) is _BAD:
            hi = mid
        else:
            lo = mid
    return _partial(text[:lo].rstrip()) if lo else None


def whole_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def call_from(obj: Any, complete: bool) -> Call | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a Call (None without a whole name)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = whole_json(args) if complete else {}
    return Call(obj["name"], args if args is not None else {}, complete)


def dumps(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def stable_prefix(arguments: Any) -> str:
    """The part of the arguments' JSON text that no later, fuller parse can change: without
    the closing brackets that only the partial parse added."""
    return dumps(arguments).rstrip("]}")


class ToolParser:
    """Subclasses implement parse(); `markers` is what `auto` looks for in a chat template."""

    name = ""
    markers: tuple[str, ...] = ()

    def parse(self, text: str, final: bool = False) -> Parsed:
        raise NotImplementedError
