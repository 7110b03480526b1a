"""The served OpenAPI schema tells the truth: every status each endpoint can send, in the
error shape the server really sends, request bodies that refuse unknown fields and state
their bounds; and schemathesis, run over it against a live server with every check, finds
nothing."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from litestar.testing import TestClient

from gateway.config import RouterConfig
from gateway.http.app import create_app
from router.model import TRAINED_ROUTER, RouterModel
from tests.test_gateway_support import KEYS, Server, embedder, llm, make_gateway, tenant_toml, wait_ready  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def schema(tmp_path, llm, embedder) -> dict:
    with TestClient(create_app(make_gateway(tmp_path, llm, embedder))) as c:
        wait_ready(c)
        return c.get("/schema/openapi.json").json()


def refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in refs(v)]
    return [r for v in node for r in refs(v)] if isinstance(node, list) else []


def test_every_endpoint_documents_its_statuses_in_the_error_shape_it_sends(schema):
    statuses = {(path, method): sorted(op["responses"]) for path, item in schema["paths"].items()
                for method, op in item.items()}
    assert statuses == {
        ("/v1/ask", "post"): ["200", "400", "401", "402", "403", "404", "413", "415", "422", "429", "500", "503",
                              "504"],
        ("/v1/chat/completions", "post"): ["200", "400", "401", "403", "404", "413", "415", "429", "500", "503", "504"],
        ("/v1/models", "get"): ["200", "401", "429", "503"],
        ("/v1/collections/{name}/documents", "post"): ["200", "400", "401", "413", "415", "422", "429", "503"],
        ("/v1/collections/{name}/files", "post"): ["200", "400", "401", "413", "415", "422", "429", "503"],
        ("/v1/collections/{name}/documents/{doc_id}", "delete"): ["200", "401", "404", "422", "429", "503"],
        ("/v1/collections", "get"): ["200", "401", "429", "503"],
        ("/v1/usage", "get"): ["200", "401", "422", "429", "503"],
        ("/healthz", "get"): ["200"], ("/readyz", "get"): ["200", "503"], ("/metrics", "get"): ["200"],
        ("/v1/admin/summary", "get"): ["200", "401", "403", "404", "422"]}
    for (path, method), codes in statuses.items():
        for code in codes:
            response = schema["paths"][path][method]["responses"][code]
            if code != "200" and path != "/readyz":
                assert response["content"] == {"application/json":
                                               {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
                assert response["description"]
    components = schema["components"]["schemas"]
    assert components["ErrorBody"]["required"] == ["error"]
    assert set(components["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "status_code" not in str(schema)                 # Litestar's own error shape is gone
    for path in ("/v1/ask", "/v1/chat/completions"):        # stream: true answers with events
        assert set(schema["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                       "text/event-stream"}
    assert all(r.removeprefix("#/components/schemas/") in components for r in refs(schema))


def test_request_bodies_refuse_unknown_fields_and_state_every_bound(schema):
    c = schema["components"]["schemas"]
    for name in ("AskRequest", "ChatRequest", "ChatMessage", "TextPart", "StreamOptions", "IngestRequest",
                 "DocumentIn"):
        assert c[name]["additionalProperties"] is False, name
    ask, chat = c["AskRequest"]["properties"], c["ChatRequest"]["properties"]
    assert ask["thinking_budget"]["anyOf"][0] == {"type": "integer", "minimum": 0}
    assert ask["max_output_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert ask["question"] | {"description": ""} == {"type": "string", "minLength": 1, "maxLength": 16_000,
                                                     "pattern": r"\S", "description": ""}   # max_input_chars
    # The tenant's limits a request that fits the schema can still pass, each with its refusal.
    document = c["DocumentIn"]["properties"]
    for field, refusal in ((ask["thinking_budget"], "422 over_thinking_budget"),
                           (ask["max_output_tokens"], "422 over_output_budget"),
                           (chat["max_tokens"], "400 over_output_budget"),
                           (chat["max_completion_tokens"], "400 over_output_budget"),
                           (ask["question"], "422 blank_question"), (ask["question"], "422 over_context_budget"),
                           (chat["messages"], "400 blank_question"), (chat["messages"], "400 over_context_budget"),
                           (document["id"], "422 bad_document"), (document["id"], "422 bad_documents"),
                           (document["text"], "422 bad_document")):
        assert refusal in field["description"], (field, refusal)
    usage = c["ChatUsage"]["properties"]
    assert usage["sluice_billed"] == {"$ref": "#/components/schemas/BilledUsage"}
    for seed in (ask["seed"], chat["seed"]):
        assert seed["anyOf"][0] == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0,
                                               "description": "0, or below 1e-05: greedy"}
    assert chat["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert (ask["temperature"]["minimum"], ask["top_p"]["exclusiveMinimum"]) == (0.0, 0.0)
    assert chat["n"] == {"type": "integer", "minimum": 1, "maximum": 1, "description": "one choice per request",
                         "default": 1}
    assert chat["model"]["enum"] == ["auto", "small", "large"]
    user = chat["messages"]["contains"]["properties"]
    assert user["role"] == {"const": "user"} and user["content"]["anyOf"][0]["pattern"] == r"\S"
    params = {p["name"]: p["schema"] for item in schema["paths"].values() for op in item.values()
              for p in op.get("parameters", [])}
    assert params["name"]["pattern"] == ask["collection"]["anyOf"][0]["pattern"] == r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
    assert params["month"]["pattern"] == r"^\d{4}-(0[1-9]|1[0-2])$"


def test_schemathesis_finds_nothing_in_the_served_schema(tmp_path, llm, embedder, capsys):
    """Every check, bounded examples (fixed seed: the same run each time), the tiny models and
    the checked-in router. The tenant has no rate limit or spend cap a run could reach, so the
    requests get past the limits to the handlers, and small budgets, so the answers are quick.
    Its summary is printed, with each operation's responses and how many were rate-limited."""
    # An output budget one token past what the router's early verdict reads: an auto answer
    # judged doomed ends on the step after the verdict (issue 38's 500 was there).
    output = RouterModel.load(TRAINED_ROUTER).early.tokens + 1
    tenant = tenant_toml(KEYS["alpha"], rpm=10**9, tpm=10**12, cap=10.0**12, output=output, thinking=8)
    gw = make_gateway(tmp_path, llm, embedder, {"alpha": tenant}, max_input_chars=200,
                      router=RouterConfig(str(TRAINED_ROUTER)))
    log = tmp_path / "responses.log"        # schemathesis_hooks.after_call: "METHOD PATH STATUS"
    command = [sys.executable, "-m", "schemathesis.cli", "--no-color", "--config-file",
               str(ROOT / "tests" / "schemathesis.toml"), "run", "--checks", "all", "--max-examples", "10",
               "--seed", "1", "--workers", "1", "--request-timeout", "60",
               "-H", f"Authorization: Bearer {KEYS['alpha']}"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(ROOT),
           "SLUICE_FUZZ_LOG": str(log)}
    with Server(gw) as server:
        start = time.monotonic()
        run = subprocess.run([*command, f"{server.url}/schema/openapi.json"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=600)
        wall = time.monotonic() - start
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20_000:]
    summary = output[output.rindex("SUMMARY"):].strip()
    by_operation: dict[str, list[int]] = {}
    for line in log.read_text().splitlines():
        method, path, status = line.split()
        by_operation.setdefault(f"{method} {path}", []).append(int(status))
    total = sum(len(statuses) for statuses in by_operation.values())
    limited = sum(statuses.count(429) for statuses in by_operation.values())
    table = "\n".join(f"  {op:<50} {len(statuses):4} responses, {statuses.count(429):3} rate-limited"
                      for op, statuses in sorted(by_operation.items()))
    with capsys.disabled():                            # in CI's output, even under pytest -q
        print(f"\nschemathesis over the served schema ({wall:.0f} s):\n{summary}\n"
              f"{total} responses, {limited} rate-limited ({limited / total:.1%}):\n{table}")
    assert "Tested: 12" in summary and "Selected: 12/12" in summary
    assert len(by_operation) == 12 and limited < 0.2 * total
    assert all(len(statuses) > statuses.count(429) for statuses in by_operation.values())
