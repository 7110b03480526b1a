"""A check schemathesis runs beside its own (tests/test_schema.py loads this module).

tests/schemathesis.toml lets a schema-valid request be answered 422: it may pass a limit no
schema can state (the tenant's output, thinking and context budgets, one document id twice).
That must never hide a schema looser than the server's validation, so a request schemathesis
generated to fit the schema must not be refused for its shape."""
from __future__ import annotations

import schemathesis

# The error codes of a body or parameter that does not fit the schema (gateway/app.py's
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
