"""Property-based fuzzing of every route in /openapi.json: no 5xx, no hang, healthy afterwards.

Bodies start from a valid request and get fields (named by the OpenAPI schema) replaced with
values of the declared type, boundary values and arbitrary JSON, or are replaced whole. CI runs a
bounded number of examples; `WEIR_FUZZ_EXAMPLES=2000 make test PYTEST_ARGS=tests/test_fuzz.py`
runs a longer campaign locally.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.config import EngineConfig
from tests.conftest import LiveServer, wait_for

EXAMPLES = int(os.environ.get("WEIR_FUZZ_EXAMPLES", "30"))
BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/embeddings": {"input": ["hi", "there"]},
    "/v1/score": {"text_1": "hi", "text_2": ["hi", "there"]},  # by the embeddings' cosine
    "/v1/rerank": {"query": "hi", "documents": ["hi", "there"], "top_n": 1},
}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def typed_values(schema: dict, components: dict) -> st.SearchStrategy:
    """Values of the type a property declares, plus its boundaries, plus anything at all."""
    options = [json_values]
    if "$ref" in schema:
        schema = components[schema["$ref"].split("/")[-1]]
    for s in schema.get("anyOf", [schema]):
        if "$ref" in s:
            s = components[s["$ref"].split("/")[-1]]
        t = s.get("type")
        if t == "integer":
            lo, hi = s.get("minimum", -(2**40)), s.get("maximum", 2**40)
            options += [
                st.integers(lo, min(hi, lo + 64)),
                st.sampled_from([lo - 1, lo, hi, hi + 1]),
            ]
        elif t == "number":
            options.append(st.floats(s.get("minimum", -1e6) - 1, s.get("maximum", 1e6) + 1))
        elif t == "boolean":
            options.append(st.booleans())
        elif t == "string":
            options.append(st.text(max_size=30))
        elif t == "array":
            options.append(st.lists(st.integers(-5, 3000) | st.text(max_size=5), max_size=5))
    return st.one_of(options)


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(
        EngineConfig(
            model=str(model_dir("qwen3")),
            max_model_len=256,
            num_kv_blocks=512,
            check_integrity=True,
        ),
        enable_embeddings=True,
    ).start()
    yield s
    s.stop()


def body_strategy(path: str, doc: dict) -> st.SearchStrategy:
    components = doc["components"]["schemas"]
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = components[ref["$ref"].split("/")[-1]]["properties"]
    mutated = st.fixed_dictionaries(
        {}, optional={name: typed_values(schema, components) for name, schema in props.items()}
    ).map(lambda changes: {**BASE[path], **changes})
    dropped = st.sets(st.sampled_from(sorted(BASE[path]))).map(
        lambda drop: {k: v for k, v in BASE[path].items() if k not in drop}
    )
    return st.one_of(mutated, mutated, dropped, json_values)


def check(server, path: str, body) -> None:
    data = json.dumps(body).encode()  # may hold NaN/Infinity: not JSON, must still be a 400
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", server.url + path, content=data, headers={"content-type": "application/json"}
        ) as r:
            raw = r.read()
    assert r.status_code < 500, (path, body, raw[:500])
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert err["message"] and "type" in err and "param" in err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        if path == "/v1/responses":  # ends with the response's own final event
            last = json.loads(raw.rstrip().rsplit(b"data: ", 1)[1])
            assert last["type"] in ("response.completed", "response.incomplete"), raw[-500:]
        else:
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            assert b'"error"' not in raw, raw[-500:]


@pytest.mark.parametrize("path", sorted(BASE))
def test_fuzz_route(server, path):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert path in doc["paths"]

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(body_strategy(path, doc))
    def run(body):
        check(server, path, body)

    run()
    assert httpx.get(server.url + "/health").status_code == 200
    engine = server.engine
    stats = lambda: engine.last_stats  # noqa: E731
    assert wait_for(
        lambda: (
            stats().num_free_blocks == 512 and not stats().num_running and not stats().num_waiting
        )
    )
