"""The OpenAPI schema the server serves, made to tell the truth.

Litestar builds the paths (operations, parameters, security) from the handlers, but its
schemas of msgspec structs lose what the structs enforce: unknown fields refused, bounds on
optional fields (`thinking_budget >= 0`, `temperature` in chat). So the components are
msgspec's own JSON Schema of the same structs that decode every body; each operation lists
its success and exactly the error statuses its handler declares (Litestar would add a 400 in
its own error shape to any handler with parameters); a streamed answer is documented as
`text/event-stream` beside the JSON one; and what the structs cannot say is filled in: what
comes from the server's config (the models, the longest question), and that a question (a
chat's from a user message) has something to read.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable

import msgspec
from litestar import Litestar
from litestar.openapi.spec import OpenAPIMediaType

from gateway.errors import ErrorBody
from gateway.http import schemas

SSE = "text/event-stream"


def _json_data(*components: str) -> dict:
    """An event whose data is the JSON of one of these components."""
    refs = [{"$ref": f"#/components/schemas/{c}"} for c in components]
    return {"properties": {"data": {"contentMediaType": "application/json",
                                    "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}


# One Server-Sent Event ({"event": ..., "data": ...}), as schemathesis and OpenAPI 3.2's
# itemSchema read an event stream's schema. /v1/ask names its events:
ASK_EVENTS = {"type": "object", "required": ["event", "data"],
              "properties": {"event": {"enum": ["meta", "token", "done", "error"]}, "data": {"type": "string"}},
              "allOf": [{"if": {"properties": {"event": {"const": name}}}, "then": _json_data(component)}
                        for name, component in (("meta", "MetaEvent"), ("token", "TokenEvent"),
                                                ("done", "DoneEvent"), ("error", "ErrorBody"))]}
# /v1/chat/completions sends OpenAI's unnamed chunks (or an error), then the literal [DONE].
# (An unnamed event is a `message` event to an SSE client.)
CHAT_EVENTS = {"type": "object", "required": ["data"],
               "properties": {"event": {"const": "message"}, "data": {"type": "string"}},
               "if": {"properties": {"data": {"const": "[DONE]"}}},
               "else": _json_data("ChatCompletionChunk", "ErrorBody")}


def make_truthful(app: Litestar, models: Iterable[str], max_input_chars: int) -> None:
    """Rewrite `app`'s OpenAPI schema in place, before it is first served, for a server that
    serves `models`. A handler with `opt={"sse": <event schema>}` answers `stream: true`
    with those Server-Sent Events."""
    openapi = app.openapi_schema
    structs = [t for _, t in inspect.getmembers(schemas, inspect.isclass)
               if issubclass(t, msgspec.Struct) and t.__module__ == schemas.__name__] + [ErrorBody]
    _, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    unknown = set(openapi.components.schemas or {}) - set(components)
    if unknown:     # a handler speaks a type that is not one of our structs: its schema would be Litestar's
        raise RuntimeError(f"OpenAPI components without a msgspec struct: {', '.join(sorted(unknown))}")
    # A question has something to read: more than whitespace, as far as a pattern can say it
    # (the pipeline's refusal, pipeline.answer.blank, also counts control and format
    # characters as nothing; the fields' descriptions say so).
    visible = {"type": "string", "pattern": r"\S"}
    components["AskRequest"]["properties"]["question"] |= {"maxLength": max_input_chars, **visible}
    components["ChatRequest"]["properties"]["model"]["enum"] = ["auto", *models]
    # The chat handler needs a question: a message from the user, with something to read.
    components["ChatRequest"]["properties"]["messages"]["contains"] = {
        "type": "object", "required": ["role", "content"], "properties": {"role": {"const": "user"}, "content": {
            "anyOf": [visible, {"type": "array", "contains": {"type": "object", "properties": {"text": visible},
                                                              "required": ["text"]}}]}}}
    openapi.components.schemas = components
    for route in app.routes:
        for handler in getattr(route, "route_handlers", ()):
            path_item = openapi.paths.get(route.path_format) if handler.include_in_schema else None
            if path_item is None:
                continue
            for method in handler.http_methods:
                operation = getattr(path_item, method.lower())
                declared = {str(handler.status_code), *map(str, handler.responses or {})}
                operation.responses = {k: v for k, v in operation.responses.items() if k in declared}
                if "sse" in handler.opt:
                    operation.responses[str(handler.status_code)].content[SSE] = OpenAPIMediaType(
                        schema=handler.opt["sse"])
