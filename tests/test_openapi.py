"""/openapi.json is a valid OpenAPI 3.1 document (openapi-spec-validator) and describes every
route the app serves, path parameters declared: a route added later cannot slip out of it."""

from __future__ import annotations

import re

import httpx
from openapi_spec_validator import validate

from core.config import EngineConfig
from server.openapi import openapi_document

# Routes that describe themselves or are not part of the API.
UNDOCUMENTED = {"/openapi.json", "/docs", "/static/{}"}


def test_the_document_is_valid():
    validate(openapi_document("test"))


def test_every_route_is_documented_with_its_path_parameters():
    from server.app import create_app
    from server.options import ServerOptions

    app = create_app(EngineConfig(model=None), ServerOptions())
    doc = openapi_document("test")
    documented = {
        (re.sub(r"\{[^}]+\}", "{}", path), method)
        for path, ops in doc["paths"].items()
        for method in ops
    }
    served = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:>]+:)?[^>]+>", "{}", rule.rule)
        if path in UNDOCUMENTED:
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((path, method.lower()))
    assert served - documented == set(), "routes missing from /openapi.json"
    assert documented - served == set(), "documented routes the app does not serve"
    for path, ops in doc["paths"].items():
        names = re.findall(r"\{([^}]+)\}", path)
        for method, op in ops.items():
            declared = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
            assert declared == names, (path, method)


def test_the_served_document_is_the_validated_one(live_server):
    served = httpx.get(live_server.url + "/openapi.json").json()
    validate(served)
    assert served["paths"]["/v1/responses/{response_id}"]["get"]["parameters"][0] == {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
