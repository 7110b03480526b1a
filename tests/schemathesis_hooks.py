"""A check schemathesis runs beside its own, and a log of its responses (tests/test_schema.py
loads this module).

tests/schemathesis.toml lets a schema-valid request be answered 422 (400 on
/v1/chat/completions): it may pass a limit no schema can state (the tenant's output, thinking
and context budgets, a blank question or document id, one document id twice). That must never
hide a schema looser than the server's validation, so a request schemathesis generated to fit
the schema must not be refused for its shape."""
from __future__ import annotations

import os

import schemathesis

# The error codes of a body or parameter that does not fit the schema (gateway/http/app.py's
# JSONRequest and gateway/errors.py).
SHAPE_CODES = {"invalid_field", "invalid_body", "invalid_json", "invalid_utf8", "too_deep", "missing_body",
               "unsupported_media_type", "bad_request"}


@schemathesis.check
def schema_valid_requests_pass_validation(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code not in (400, 415, 422):
        return None
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code in SHAPE_CODES:
        raise AssertionError(f"a request that fits the schema was refused for its shape ({code}): {response.text}")
    return None


@schemathesis.hook
def after_call(context, case, response):
    """Each response's operation and status, one line a response, to the file named by
    SLUICE_FUZZ_LOG: tests/test_schema.py reports from it how many were rate-limited."""
    path = os.environ.get("SLUICE_FUZZ_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{case.operation.method.upper()} {case.operation.path} {response.status_code}\n")
