"""A request's structured-output fields (OpenAI's response_format, vLLM's structured_outputs and its
older guided_* names) into one core Constraint, checked by the same compiler the engine uses: a
constraint that cannot be enforced is a 400 naming the field, never free text."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from core.structured import Constraint, Grammars
from server.errors import APIError
from server.requests import SamplingFields
from server.state import ServerState

CHECKED_SIZE = 1024  # constraints whose check result is remembered


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", field, "invalid_value")


def schema_text(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _bad(field, f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise _bad(field, "a JSON schema must be an object")
    return json.dumps(schema)


def _choice(field: str, choices: list[str]) -> Constraint:
    if not choices:
        raise _bad(field, "the choice list is empty")
    return Constraint("choice", json.dumps(choices))


def _from_response_format(req: SamplingFields) -> Constraint | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint("json_object")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise _bad("response_format", "type json_schema needs json_schema.schema")
        return Constraint("json", schema_text("response_format", rf.json_schema.schema))
    raise _bad(
        "response_format",
        f"type {rf.type!r} is not supported; use text, json_object or json_schema",
    )


def _from_structured_outputs(req: SamplingFields) -> Constraint | None:
    so = req.structured_outputs
    if so is None:
        return None
    field = "structured_outputs"
    if so.structural_tag is not None:
        raise _bad(field, "structural_tag is not supported by weir's backend (llguidance)")
    given = [
        name
        for name in ("json", "regex", "choice", "grammar", "json_object")
        if getattr(so, name) not in (None, False)
    ]
    if len(given) != 1:
        raise _bad(
            field,
            "give exactly one of json, regex, choice, grammar, json_object"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    kind = given[0]
    if kind == "json":
        c = Constraint("json", schema_text(field, so.json))
    elif kind == "json_object":
        c = Constraint("json_object")
    elif kind == "choice":
        c = _choice(field, so.choice)
    else:
        c = Constraint(kind, getattr(so, kind))
    if so.whitespace_pattern is not None and c.kind not in ("json", "json_object"):
        raise _bad(field, "whitespace_pattern applies to json and json_object only")
    if so.whitespace_pattern is not None and so.disable_any_whitespace:
        raise _bad(field, "whitespace_pattern and disable_any_whitespace contradict: give one")
    return Constraint(
        c.kind,
        c.spec,
        any_whitespace=not so.disable_any_whitespace,
        whitespace_pattern=so.whitespace_pattern,
        # Unsaid: closed objects (weir's default, as vLLM's xgrammar); an explicit false keeps
        # JSON Schema's own default, any further keys.
        additional_properties=so.disable_additional_properties is False,
    )


def _from_guided(req: SamplingFields, name: str) -> Constraint | None:
    value = getattr(req, name)
    if value is None:
        return None
    if name == "guided_json":
        return Constraint(
            "json", schema_text(name, value), whitespace_pattern=req.guided_whitespace_pattern
        )
    if name == "guided_choice":
        return _choice(name, value)
    return Constraint(name.removeprefix("guided_"), value)


def constraint_of(req: SamplingFields) -> tuple[Constraint, str] | None:
    """The request's one constraint and the field it came from; a 400 for two at once."""
    if req.guided_whitespace_pattern is not None and req.guided_json is None:
        raise _bad("guided_whitespace_pattern", "applies with guided_json only")
    found = []
    for field, make in (
        ("response_format", _from_response_format),
        ("structured_outputs", _from_structured_outputs),
    ):
        c = make(req)
        if c is not None:
            found.append((c, field))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        c = _from_guided(req, name)
        if c is not None:
            found.append((c, name))
    if len(found) > 1:
        fields = ", ".join(f for _, f in found)
        raise _bad(found[1][1], f"a request may carry one constraint, this one has {fields}")
    return found[0] if found else None


def _checker(st: ServerState) -> Grammars:
    if st.grammar_checker is None:
        tok = st.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else [0]
        st.grammar_checker = Grammars(tok.backend_tokenizer.to_str(), st.vocab_size, eos)
    return st.grammar_checker


async def check(st: ServerState, c: Constraint, field: str) -> Constraint:
    """`c`, compiled once off the event loop to find errors (remembered per constraint): a 400
    naming `field`, with the compiler's message, when it cannot be enforced."""
    checked: OrderedDict = st.checked_constraints
    if c in checked:
        checked.move_to_end(c)
        error = checked[c]
    else:
        checker = _checker(st)
        error = await trio.to_thread.run_sync(checker.check, c)
        checked[c] = error
        while len(checked) > CHECKED_SIZE:
            checked.popitem(last=False)
    if error is not None:
        raise _bad(field, f"the constraint cannot be enforced: {error}")
    return c


async def request_constraint(
    st: ServerState,
    req: SamplingFields,
    tool_constraint: Constraint | None = None,
    think: str = "",
    given: tuple[Constraint, str] | None = None,
    auto_calls: Callable[[bool], str | None] | None = None,
    think_marks: tuple[str, str] | None = None,
) -> Constraint | None:
    """The request's constraint, checked; `tool_constraint` is the one tool_choice required or
    a named function imposes, which cannot be combined with another. `think` ("open" or
    "optional", for a thinking model) lets the reasoning run free before the constraint, its
    markers `think_marks` (Lark: the reasoning parser's, special tokens as tokens).
    `given` is one the route read from a field of its own (the Responses API's text.format).
    `auto_calls` (server/tools.py's AutoCalls) gives the grammar of strict tools' calls under
    tool_choice auto, beside free text or beside the answer another field constrains."""
    found = constraint_of(req)
    if given is not None:
        if found is not None:
            raise _bad(
                found[1], f"a request may carry one constraint, this one also has {given[1]}"
            )
        found = given
    if tool_constraint is not None:
        if found is not None:
            raise _bad(found[1], "cannot be combined with tool_choice required or a named function")
        found = (tool_constraint, "tools")
    if auto_calls is not None:
        grammar = auto_calls(found is not None)
        if grammar is not None:
            answer = None
            if found is not None:  # the answer alone first: its errors name its own field
                answer = await check(st, found[0], found[1])
            found = (Constraint("grammar", grammar, answer=answer), "tools")
    if found is None:
        return None
    c, field = found
    if think:
        c = msgspec.structs.replace(c, think=think)
        if think_marks is not None:
            c = msgspec.structs.replace(c, think_marks=think_marks)
    return await check(st, c, field)
