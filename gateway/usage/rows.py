"""A usage row, and what every ledger database (SQLite in ledger.py, PostgreSQL in ledger_postgres.py)
writes and reads, in one place both import."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

# UsageRow.models of an answer served from the answer cache (no engine call).
CACHE_HIT = "cache"


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    ts: float
    month: str
    tenant: str
    endpoint: str
    status: str
    model: str
    models: str
    collection: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    thinking_tokens: int
    cost: float
    retrieval_ms: float
    queue_ms: float
    ttft_ms: float | None
    total_ms: float
    route_reason: str
    difficulty: str | None
    confidence: float | None
    escalated: bool
    finish_reason: str | None
    arm: str | None = None


COLUMNS = [f.name for f in fields(UsageRow)]
SELECT_ROWS = f"SELECT {', '.join(COLUMNS)} FROM requests"
# Written with %s (PostgreSQL's placeholder); SQLite's ? is substituted in.
# A new row is not yet in the operator view's running totals (rolled = 0): rollup.py folds it.
# A row already there was committed by a write whose acknowledgement was lost (the server
# restarting), which the ledger tries again: it is skipped, and returns nothing, so that its
# cost is not added twice.
INSERT = (f"INSERT INTO requests({', '.join(COLUMNS)}, rolled) VALUES ({', '.join(['%s'] * len(COLUMNS))}, 0) "
          "ON CONFLICT(request_id) DO NOTHING RETURNING request_id")
USAGE = ("SELECT model, count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), "
         "sum(thinking_tokens), sum(cost) FROM requests WHERE tenant = %s AND month = %s GROUP BY model")
USAGE_KEYS = ("requests", "prompt", "cached", "completion", "thinking", "cost")


class Database(Protocol):
    """What the ledger needs of a database. `write` is called from the writer thread only;
    the reads from any thread."""
    Error: type[Exception]          # what a row that cannot be committed raises
    Unavailable: type[Exception]    # of those, the store's own trouble (full, read-only, gone), not the row's

    def write(self, rows: list[UsageRow]) -> None:
        """Commit the rows and add their costs to the monthly totals, all in one transaction, or raise
        Error. A row already committed (written again after a lost acknowledgement) is skipped."""

    def fold(self, limit: int) -> int:
        """Add up to `limit` committed rows not yet in the running totals (rollup.py) to them, in
        one transaction of its own; returns how many (fewer than `limit`: none are left)."""

    def close_writer(self) -> None: ...

    def spent(self, tenant: str, month: str) -> float: ...

    def usage(self, tenant: str, month: str) -> dict[str, dict]:
        """Per model: requests, tokens by kind and cost of one tenant in one month."""

    def rows(self, tenant: str | None = None) -> list[UsageRow]: ...

    # The operator's view: the running totals (rollup.py) that `fold` keeps.
    def totals(self, grain: int, start: int, end: int) -> list: ...

    def series(self, kind: str, grain: int, start: int, end: int, step: int, tenant: str | None) -> list[tuple]: ...

    def month_spend(self, month: str) -> dict[str, float]: ...
