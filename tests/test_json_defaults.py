"""weir's JSON-constraint defaults, as vLLM's xgrammar backend: an object schema that lists
properties and leaves additionalProperties unsaid allows no other keys (a weak model then
cannot grow keys until its length limit), and the free whitespace between JSON tokens is
bounded (compact and pretty-printed JSON fit, runs of blank lines do not). Per request,
`structured_outputs.disable_additional_properties: false` allows further keys and
`whitespace_pattern` sets the whitespace."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from core.structured import Constraint, close_objects
from tests.conftest import GrammarProbe, LiveServer, tiny_config
from tests.test_structured import close_bias, no_whitespace_bias

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["paid", "open"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["id", "status", "items"],
}
VALUE = {"id": 7, "status": "paid", "items": [{"sku": "a1", "qty": 2}]}


@pytest.fixture(scope="module")
def grammars(model_dir):
    return GrammarProbe(model_dir)


def accepts(grammars, c: Constraint, text: str) -> bool:
    return grammars.accepts(c, text)


def json_constraint(schema=SCHEMA, **kw) -> Constraint:
    return Constraint("json", json.dumps(schema), **kw)


def test_objects_are_closed_by_default(grammars):
    assert accepts(grammars, json_constraint(), json.dumps(VALUE))
    extra_top = {**VALUE, "noise": 1}
    extra_inner = {**VALUE, "items": [{"sku": "a1", "qty": 2, "colour": "red"}]}
    for value in (extra_top, extra_inner):
        assert not accepts(grammars, json_constraint(), json.dumps(value))
        assert accepts(grammars, json_constraint(additional_properties=True), json.dumps(value))


def test_what_closing_leaves_open():
    """Said is said; an object that lists no properties means any object; allOf members each
    list part of the keys, so they stay open."""
    said = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(said) == said
    assert close_objects({"type": "object"}) == {"type": "object"}
    parts = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(parts) == parts
    nested = close_objects({"$defs": {"X": {"properties": {"a": {}}}}, "$ref": "#/$defs/X"})
    assert nested["$defs"]["X"]["additionalProperties"] is False
    # a property that happens to be named "properties" is a name, not a keyword
    named = close_objects({"properties": {"properties": {"type": "string"}}})
    assert named["properties"] == {"properties": {"type": "string"}}


def test_whitespace_is_bounded_by_default(grammars):
    for text in (
        json.dumps(VALUE),
        json.dumps(VALUE, separators=(",", ":")),
        json.dumps(VALUE, indent=2),
        json.dumps(VALUE, indent=4),
        json.dumps(VALUE, indent="\t"),
    ):
        assert accepts(grammars, json_constraint(), text), text
    blank_lines = '{\n\n\n"id": 7, "status": "paid", "items": []}'
    spaces = "{" + " " * 40 + '"id": 7, "status": "paid", "items": []}'
    for text in (blank_lines, spaces):
        assert not accepts(grammars, json_constraint(), text)
    # compact only, and a pattern of the request's own
    compact = json_constraint(any_whitespace=False)
    assert not accepts(grammars, compact, json.dumps(VALUE, indent=2))
    one_space = json_constraint(whitespace_pattern=" ?")
    assert accepts(grammars, one_space, json.dumps(VALUE))
    assert not accepts(grammars, one_space, json.dumps(VALUE, indent=2))


# ---------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(tiny_config(model_dir, max_model_len=1024)).start()
    yield s
    s.stop()


def test_a_schema_without_strict_cannot_run_away(client, server):
    """instructor's JSON_SCHEMA mode and LangChain's with_structured_output: the schema without
    `strict`. Every sample ends by the grammar, never by the length limit, with only the
    schema's keys, even when the model is pushed away from closing its objects (a bias against
    "}" that, with open objects, has it add keys until the limit)."""
    tok = server.state.tokenizer
    push = close_bias(tok) | no_whitespace_bias(tok)
    push[str(tok.convert_tokens_to_ids("}"))] = -8.0
    push[str(tok.convert_tokens_to_ids(","))] = 4.0
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "An order, please."}],
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
        max_tokens=600,
        temperature=1.0,
        seed=5,
        n=4,
        logit_bias=push,
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        value = json.loads(c.message.content)
        jsonschema.validate(value, SCHEMA)
        assert set(value) == {"id", "status", "items"}
        assert all(set(item) == {"sku", "qty"} for item in value["items"])


def test_the_request_options(server):
    body = {"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": 3}
    url = server.url + "/v1/completions"
    for so in (
        {"json": SCHEMA, "disable_additional_properties": False},
        {"json": SCHEMA, "whitespace_pattern": "[ ]?"},
        {"json_object": True, "whitespace_pattern": "[ \n]{0,4}"},
    ):
        r = httpx.post(url, json=body | {"structured_outputs": so}, timeout=60)
        assert r.status_code == 200, (so, r.text)
    r = httpx.post(url, json=body | {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"})
    assert r.status_code == 200, r.text
    so = "structured_outputs"
    for fields, param in (
        ({so: {"json": SCHEMA, "whitespace_pattern": "(["}}, so),
        ({so: {"regex": "a", "whitespace_pattern": " "}}, so),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        # more than JSON's whitespace: the output would not parse (it had been {xxx})
        ({so: {"json_object": True, "whitespace_pattern": "x+"}}, so),
        ({so: {"json": SCHEMA, "whitespace_pattern": r"\s*"}}, so),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ,]?"}, "guided_json"),
        # a pattern beside no whitespace at all (the pattern had been ignored)
        (
            {so: {"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "}},
            so,
        ),
    ):
        r = httpx.post(url, json=body | fields, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
