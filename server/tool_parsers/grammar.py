"""The pieces of the tool-call grammars (Lark, llguidance's, with embedded JSON schemas): a call's
schema built from the request's tools (their references re-rooted where it nests them), one
tool's arguments alone, markup as Lark text (its special tokens as tokens), and the grammars of a
marker followed by a JSON list of calls, alone or after free text."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from core.structured import Constraint, close_objects, json_options


# JSON-schema keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with its document-local references ("#", "#/...") re-rooted at `base`, a JSON
    pointer to where the schema now sits inside a larger document."""
    if isinstance(schema, list):
        return [rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, base)
    return out


def resolve_ref(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`schema`, or what its document-local `$ref` ("#", "#/$defs/...") points at in `root`,
    followed to a schema that is not a reference (None past 32 hops or a pointer that misses)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")) or depth > 32:
        return schema if ref is None else None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return resolve_ref(node, root, depth + 1)


def call_schema(
    tools: list[dict[str, Any]],
    key: str = "arguments",
    name_key: str = "name",
    id_key: str | None = None,
) -> dict[str, Any]:
    """The JSON schema of one call object to any of `tools`: its name (under `name_key`), and
    arguments (under `key`) that validate against that tool's parameters (objects closed and
    whitespace bounded as for response_format's schemas: core/structured.py); with `id_key`,
    a string id first (Command R7B's tool_call_id).

    Each tool's parameters sit whole under the call schema's `$defs` and are referenced from
    its `key` property, their own local references ("#/$defs/Item", "#/definitions/...",
    "#" for a recursive model) re-rooted there: embedded in place, one level down, they would
    point at the call object instead. The result keeps `$defs` at its top; a caller that nests
    it further lifts them with `lift_defs`."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        name = f"weir_tool_{i}"
        params = rebase_refs(fn.get("parameters") or {"type": "object"}, f"#/$defs/{name}")
        defs[name] = close_objects(params)
        ids = {id_key: {"type": "string"}} if id_key else {}
        options.append(
            {
                "type": "object",
                "properties": {
                    **ids,
                    name_key: {"const": fn["name"]},
                    key: {"$ref": f"#/$defs/{name}"},
                },
                "required": [*ids, name_key, key],
                "additionalProperties": False,
            }
        )
    top = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": json_options(Constraint("json")), "$defs": defs, **top}


def args_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool's arguments as a document of their own (markup that names the function outside
    the JSON: Mistral's v11 calls), closed and whitespace-bounded as call_schema's are."""
    params = tool["function"].get("parameters") or {"type": "object"}
    return {"x-guidance": json_options(Constraint("json")), **close_objects(params)}


def lift_defs(inner: dict[str, Any], wrap) -> dict[str, Any]:
    """`wrap(inner)` with `inner`'s `$defs` (and llguidance's options) moved to the new
    document's top, where its references ("#/$defs/...") resolve."""
    inner = dict(inner)
    top = {key: inner.pop(key) for key in ("x-guidance", "$defs") if key in inner}
    return {**top, **wrap(inner)}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema)


def literal(text: str, special: Mapping[str, int]) -> str:
    """`text` as a Lark sequence: each special token in it (`special`: the tokenizer's, text
    -> id) as the token itself, `<[id]>`, and the rest as quoted text. llguidance never
    matches a grammar's quoted text against a special token, so markup a tokenizer holds as
    one (Mistral's [TOOL_CALLS]) must be written so, or the model is forced to spell it out
    in ordinary tokens, which it was never trained to do."""
    found = [t for t in special if t and t in text]
    if not found:
        return json.dumps(text)
    pattern = "|".join(re.escape(t) for t in sorted(found, key=len, reverse=True))
    pieces = []
    for piece in re.split(f"({pattern})", text):
        if piece in special:
            pieces.append(f"<[{special[piece]}]>")
        elif piece:
            pieces.append(json.dumps(piece))
    return " ".join(pieces)


def text_or_calls(marker: str, answer: bool, special: Mapping[str, int]) -> str:
    """The top of an auto_grammar for markup where `marker` opens the calls: the reply is
    text (any text that never writes `marker`), or text and then calls (the parser's rule
    `after`: what follows the marker). A lazy lexeme takes the text with the marker, ending
    where the marker does; a marker that is (or opens with) a special token follows the text
    as that token. With `answer` the text is the nested grammar @answer (a response format's)
    instead, and calls open the reply."""
    if answer:
        return f"start: @answer | {literal(marker, special)} after\n"
    mark = re.escape(marker).replace("/", "\\/")
    text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{mark}.*)/\n"
    if any(t and marker.startswith(t) for t in special):  # (InternLM's: two of them)
        return f"start: TEXT | TEXT? {literal(marker, special)} after\n" + text
    return "start: TEXT | lead after\n" + text + f"lead[lazy]: /(?s:.*){mark}/\n"


def calls_rule(tools: list[dict[str, Any]], parallel: bool, **keys: str) -> str:
    """The `calls` rule: a JSON list of call objects to `tools` (one unless `parallel`); `keys`:
    call_schema's names of the object's members."""
    bound = {} if parallel else {"maxItems": 1}
    calls = lift_defs(
        call_schema(tools, **keys),
        lambda one: {"type": "array", "items": one, "minItems": 1, **bound},
    )
    return f"calls: {lark_json(calls)}"


def listed_grammar(
    marker: str, tools: list[dict[str, Any]], parallel: bool, special: Mapping[str, int]
) -> str:
    """The call grammar of `marker` then a JSON list of calls (Mistral's, Phi-4-mini's)."""
    return f"start: {literal(marker, special)} calls\n" + calls_rule(tools, parallel)


def listed_auto_grammar(
    marker: str,
    tools: list[dict[str, Any]],
    parallel: bool,
    answer: bool,
    special: Mapping[str, int],
) -> str:
    """Text, then `marker` and the list of calls (as listed_grammar's)."""
    top = text_or_calls(marker, answer, special)
    return top + "after: calls\n" + calls_rule(tools, parallel)


def strict_only(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as enforced under tool_choice auto: a strict tool's arguments validate
    against its parameters, any other's are any JSON object (still a whole call to a tool the
    request offers)."""
    out = []
    for tool in tools:
        fn = tool["function"]
        if fn.get("strict") is not True:
            fn = {**fn, "parameters": {"type": "object"}}
        out.append({**tool, "function": fn})
    return out
