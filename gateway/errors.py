"""Errors as JSON: every refusal, whatever raised it, reaches the client in one shape.

The shape is OpenAI's (`{"error": {"message", "type", "param", "code"}}`) so that a frontend
on an OpenAI SDK reports our messages as it reports OpenAI's. Bad input is a 4xx whose
message names the field and what was expected; only a fault of ours is a 5xx.
"""
from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

log = logging.getLogger("sluice.gateway")

# OpenAI's error types, by status, so SDKs map them to their exception classes.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "insufficient_quota",
         403: "permission_error", 404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "overloaded_error"}


class GatewayError(Exception):
    """A refusal with its status, a message for the client, and the field at fault if any."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def retry_after(status: int, message: str, seconds: float, code: str) -> GatewayError:
    return GatewayError(status, message, code=code, headers={"Retry-After": str(max(1, int(seconds + 0.999)))})


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": code}}


def _response(status: int, message: str, param=None, code=None, headers=None) -> Response:
    return Response(body(status, message, param, code), status_code=status, headers=headers or {})


def on_gateway_error(_: Request, exc: GatewayError) -> Response:
    return _response(exc.status, exc.message, exc.param, exc.code, exc.headers)


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
    what = what.replace("`", "")
    what = what[:1].lower() + what[1:]
    return field, f"field '{field}': {what}" if field else what


def on_validation_error(_: Request, exc: ValidationException) -> Response:
    """Litestar wraps msgspec's error on the body; turn it back into one naming the field."""
    cause = exc.__cause__
    if isinstance(cause, msgspec.ValidationError):
        if str(cause).startswith("Object missing required field `data`"):     # nothing decoded
            return _response(400, "the request body is missing: send a JSON object", code="missing_body")
        field, message = explain(cause, prefix=".data")
        if field is None:                   # the body itself is not an object
            return _response(400, f"the request body must be a JSON object: {message}", code="invalid_body")
        return _response(422, message, field, "invalid_field")
    detail = "; ".join(f"{e.get('key')}: {e.get('message')}" for e in exc.extra or [] if isinstance(e, dict))
    return _response(400, detail or str(exc.detail), code="bad_request")


def on_http_error(_: Request, exc: HTTPException) -> Response:
    message = str(exc.detail)
    if isinstance(exc.__cause__, SerializationException):         # the body did not decode
        message = "the request body is not valid JSON: " + message.removeprefix("JSON is malformed: ")
        return _response(400, message, code="invalid_json")
    if exc.status_code == 413:
        message = "the request body is too large (see max_body_bytes in the server config)"
    return _response(exc.status_code, message, headers=exc.headers)


def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _response(500, f"internal error ({type(exc).__name__}); it is logged on the server")


HANDLERS = {GatewayError: on_gateway_error, ValidationException: on_validation_error,
            HTTPException: on_http_error, Exception: on_unexpected}
