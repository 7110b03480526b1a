"""Errors as JSON: every refusal, whatever raised it, reaches the client in one shape.

The shape is OpenAI's (`{"error": {"message", "type", "param", "code"}}`) so that a frontend
on an OpenAI SDK reports our messages as it reports OpenAI's. Bad input is a 4xx whose
message names the field and what was expected; only a fault of ours is a 5xx. `STATUSES`
says when each status is sent; the OpenAPI schema documents every endpoint's from it.
"""
from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

log = logging.getLogger("sluice.gateway")

# OpenAI's error types, by status, so SDKs map them to their exception classes.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "insufficient_quota",
         403: "permission_error", 404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 503: "overloaded_error"}
# What OpenAI sends for an exhausted quota: 429 with this type and code.
QUOTA = "insufficient_quota"

STATUSES = {
    400: "The body is not JSON (malformed, not UTF-8, nested too deeply), is missing, or is not an object.",
    401: "No API key, not a Bearer key, or an unknown key (`WWW-Authenticate: Bearer`).",
    402: "The monthly spend cap is reached, or this request's worst case would pass it.",
    403: "The tenant may not use the model asked for.",
    404: "Unknown collection (another tenant's is exactly as unknown), document or model.",
    413: "The body is over the server's `max_body_bytes`.",
    415: "The body is not `application/json`.",
    422: "A field is of the wrong type, missing, unknown or out of range (`param` names it), the question is "
         "blank, or the request passes a limit of the tenant or the model: output, thinking or context budget, "
         "prompt length.",
    429: "Over the tenant's requests or tokens per minute (`Retry-After`); on /v1/chat/completions also an "
         "exhausted spend cap, with code `insufficient_quota`.",
    500: "A fault of the server's own (the engine failed); it is logged.",
    503: "Models are still loading, the server is shutting down, the bounded queue is full or too slow to start "
         "the request before its deadline, or the usage ledger or the shared limits store takes no writes "
         "(`Retry-After`).",
    504: "The request passed its deadline (the tenant's `request_timeout_s`, else the server's) and was cut; "
         "what it generated is billed. A stream ends with an `error` event instead.",
}
# /v1/chat/completions answers as OpenAI's API does: an invalid request is a 400 (on_openai_error).
OPENAI_STATUSES = {**STATUSES, 400: (
    "The body is not JSON or not an object, or is missing; or (what is a 422 on /v1/ask) a field is of the "
    "wrong type, missing, unknown or out of range (`param` names it), the question is blank, or the request "
    "passes a limit of the tenant or the model: output or context budget, prompt length.")}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None     # the request field at fault, if any
    code: str | None      # a stable name for the refusal, e.g. invalid_field, spend_cap_reached


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class GatewayError(Exception):
    """A refusal with its status, a message for the client, and the field at fault if any."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def retry_after(status: int, message: str, seconds: float, code: str) -> GatewayError:
    return GatewayError(status, message, code=code, headers={"Retry-After": str(max(1, int(seconds + 0.999)))})


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    kind = QUOTA if code == QUOTA else TYPES.get(status, "api_error")
    return ErrorBody(ErrorDetail(message, kind, param, code))


def documented(*statuses: int, openai: bool = False) -> dict[int, ResponseSpec]:
    """The OpenAPI responses of an endpoint that can refuse with these statuses (`openai`: in
    OpenAI's conventions, on_openai_error's)."""
    descriptions = OPENAI_STATUSES if openai else STATUSES
    return {status: ResponseSpec(ErrorBody, description=descriptions[status], generate_examples=False)
            for status in statuses}


def _response(status: int, message: str, param=None, code=None, headers=None) -> Response:
    return Response(body(status, message, param, code), status_code=status, headers=headers or {})


def on_gateway_error(_: Request, exc: GatewayError) -> Response:
    return _response(exc.status, exc.message, exc.param, exc.code, exc.headers)


def on_openai_error(request: Request, exc: GatewayError) -> Response:
    """OpenAI's conventions on its endpoint, so that its SDKs raise what client code catches:
    an invalid request is 400 (BadRequestError; a 422 would be UnprocessableEntityError, which
    OpenAI's API never sends), with `param` and `code` kept; an exhausted spend cap is 429
    `insufficient_quota`, which SDKs and retry libraries know (a 402 reaches an OpenAI SDK as a
    bare APIStatusError), with `x-should-retry: false` so the SDK does not retry what waiting
    will not fix."""
    if exc.status == 422:
        exc = GatewayError(400, exc.message, exc.param, exc.code, exc.headers)
    elif exc.code == "spend_cap_reached":
        exc = GatewayError(429, exc.message, exc.param, QUOTA, {**exc.headers, "x-should-retry": "false"})
    return on_gateway_error(request, exc)


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_FIELD = re.compile(r"^Object (?P<kind>missing required|contains unknown) field `(?P<name>[^`]+)`$")


def explain(exc: msgspec.ValidationError, prefix: str = "") -> tuple[str | None, str]:
    """(field, message) from a msgspec error: "Expected `int`, got `str` - at `$.limits.rpm`"
    becomes ("limits.rpm", "field 'limits.rpm': expected int, got str")."""
    m = _AT.match(str(exc))
    what, path = m["what"], (m["path"] or "")
    path = path[len(prefix):] if path.startswith(prefix) else path
    field = path.lstrip(".") or None
    f = _FIELD.match(what)
    if f:
        field = f"{field}.{f['name']}" if field else f["name"]
        what = "is required but missing" if f["kind"] == "missing required" else "is not a known field"
        return field, f"field '{field}' {what}"
    what = clause(what)
    return field, f"field '{field}': {what}" if field else what


def clause(what: str) -> str:
    """msgspec's "Expected `int`, got `str`" as the rest of a sentence."""
    what = what.replace("`", "")
    return what[:1].lower() + what[1:]


def on_validation_error(_: Request, exc: ValidationException) -> Response:
    """A path or query parameter Litestar refused. (Bodies are decoded by the app's JSONRequest;
    an empty one never reaches it and arrives here as a missing `data`.)"""
    problems = [e for e in exc.extra or [] if isinstance(e, dict) and e.get("key")]
    if any(e["key"] == "data" for e in problems):
        return _response(400, "the request body is missing: send a JSON object", code="missing_body")
    if not problems:
        return _response(400, str(exc.detail), code="bad_request")
    message = "; ".join(f"{getattr(e.get('source'), 'value', 'request')} parameter '{e['key']}': "
                        f"{clause(e.get('message', ''))}" for e in problems)
    return _response(422, message, problems[0]["key"], "invalid_field")


def on_http_error(_: Request, exc: HTTPException) -> Response:
    message = str(exc.detail)
    if exc.status_code == 413:
        message = "the request body is too large (see max_body_bytes in the server config)"
    return _response(exc.status_code, message, headers=exc.headers)


def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _response(500, f"internal error ({type(exc).__name__}); it is logged on the server")


HANDLERS = {GatewayError: on_gateway_error, ValidationException: on_validation_error,
            HTTPException: on_http_error, Exception: on_unexpected}
