"""Running totals of the ledger by time bucket, for the operator's view (docs/gateway.md).

Every committed row is added to a minute, an hour and a day bucket of `rollup` (one row per
tenant, arm and outcome) and of `latency` (a histogram of TTFT and total time per tenant).
The dashboard then reads at most a few thousand rows for any window, whatever the ledger
holds: an hour is 60 minute buckets, a day 24 hour buckets, a month 30 day buckets, not every
request of that month. Both databases (ledger.py, ledger_postgres.py) run this SQL; it is
written with %s, PostgreSQL's placeholder, and SQLite's ? is substituted in.

Dollars saved are estimated from the tokens, not stored: each row adds its tokens per engine
call (a request the cascade answered twice counts once), and the reader prices those at the
large model's prices: what the same requests would have cost had the large model alone
answered each with the same prompt and as many output tokens.

Folding, off the request's path. A request waits for its row's transaction (the row and its
tenant's spend, which the cap reads), not for these totals: after that commit, once its
callers are answered, the ledger's writer thread folds committed rows into the totals in a
transaction of its own (Ledger._fold). What counts each row exactly once, whatever crashes,
and with several replicas writing one PostgreSQL ledger:

- A row is written with `rolled = 0`. A fold takes rows with one statement, CLAIM, that sets
  `rolled = 1` on up to a batch of them and returns them, and adds them to the totals in the
  same transaction: a row is in the totals if and only if it is marked, since both commit or
  neither does.
- A crash between the two transactions leaves committed rows unmarked: nothing is lost, and
  the next fold takes them (after the next commit of any writer, at the next open, or the
  writer's retry after a failed fold). A partial index holds only the unmarked rows, so
  finding them costs the same in a ledger of millions.
- Two folds never take the same row. SQLite has one writer at a time (BEGIN IMMEDIATE). On
  PostgreSQL the claim locks its rows FOR UPDATE SKIP LOCKED: a second fold skips rows another
  holds rather than waiting for them, and a row a committed fold marked no longer matches
  `rolled = 0` (READ COMMITTED re-checks a locked row's newest version).
- So a fold takes any unmarked row, not only its own writer's: no grace period is needed, and
  rows a crashed replica left are folded by whichever replica commits next. Totals are
  updated in key order (fold() sorts them), so two folds may wait on each other, never deadlock.
- Losing a fold costs nothing but a redo, so it is not worth an fsync: PostgreSQL commits it
  with synchronous_commit off and SQLite's folding connection with synchronous=NORMAL. A crash
  may lose the latest folds, never part of one: their rows are found unmarked and folded again.
- Rows written before the marker existed were folded in their own transactions or by the
  backfill that created the totals: the column's default, 1, says so, also for the rows an
  older replica still writes during a rolling upgrade.

Why a mark on each row rather than a high-water mark of ids: PostgreSQL hands out ids at
insert and concurrent replicas commit them out of order, so "every row up to id N is folded"
is nothing a fold can know. Why not a separate queue table: the mark claims and returns the
rows in one statement on both databases.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from gateway.usage.rows import CACHE_HIT, COLUMNS, UsageRow

GRAINS = (60, 3600, 86400)          # seconds a bucket spans: minutes (an hour), hours (a day), days (a month)
# Latency bins grow by 25%: bin 0 is under 1 ms, bin k >= 1 holds [1.25^(k-1), 1.25^k) ms.
# A percentile read from them is the bin's geometric middle, within 12% of the true value.
BIN_RATIO = 1.25

TABLES = """
CREATE TABLE IF NOT EXISTS rollup(
    grain INTEGER NOT NULL, bucket BIGINT NOT NULL,     -- seconds it spans, and the unix second it starts
    tenant TEXT NOT NULL,
    arm TEXT NOT NULL,                 -- the router's arm, or (not routed by arms) the answering model
    status TEXT NOT NULL,              -- the ledger's: ok | cancelled | error | timeout
    requests BIGINT NOT NULL, escalated BIGINT NOT NULL, widened BIGINT NOT NULL,
    cache_hits BIGINT NOT NULL,        -- answered from the answer cache (models = 'cache')
    prompt_tokens BIGINT NOT NULL, cached_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL, thinking_tokens BIGINT NOT NULL,
    cost DOUBLE PRECISION NOT NULL,
    call_prompt DOUBLE PRECISION NOT NULL, call_cached DOUBLE PRECISION NOT NULL,
    call_output DOUBLE PRECISION NOT NULL,    -- tokens per engine call: the large-alone estimate
    PRIMARY KEY(grain, bucket, tenant, arm, status));
CREATE TABLE IF NOT EXISTS latency(
    grain INTEGER NOT NULL, bucket BIGINT NOT NULL, tenant TEXT NOT NULL,
    kind TEXT NOT NULL,                -- ttft | total
    bin INTEGER NOT NULL, n BIGINT NOT NULL,
    PRIMARY KEY(grain, bucket, tenant, kind, bin));
"""
SUMS = ("requests", "escalated", "widened", "cache_hits", "prompt_tokens", "cached_tokens", "completion_tokens",
        "thinking_tokens", "cost", "call_prompt", "call_cached", "call_output")
KEY = ("grain", "bucket", "tenant", "arm", "status")
ADD_ROLLUP = (f"INSERT INTO rollup({', '.join(KEY + SUMS)}) VALUES ({', '.join(['%s'] * (len(KEY) + len(SUMS)))}) "
              f"ON CONFLICT({', '.join(KEY)}) DO UPDATE SET "
              + ", ".join(f"{c} = rollup.{c} + excluded.{c}" for c in SUMS))
ADD_LATENCY = ("INSERT INTO latency(grain, bucket, tenant, kind, bin, n) VALUES (%s, %s, %s, %s, %s, %s) "
               "ON CONFLICT(grain, bucket, tenant, kind, bin) DO UPDATE SET n = latency.n + excluded.n")
# Every read is bounded by the primary keys' leading columns (one grain, a range of buckets)
# and added up by the database, which hands back a few dozen rows, or one per chart point.
# (PostgreSQL sums integers as numeric: cast back. `{tenant}` is "" or "AND tenant = %s".)
_INT_SUMS = SUMS[:8]
_total = lambda c: f"CAST(sum({c}) AS BIGINT)" if c in _INT_SUMS else f"sum({c})"
RANGE = "grain = %s AND bucket >= %s AND bucket < %s"
READ_TOTALS = (f"SELECT tenant, arm, status, {', '.join(map(_total, SUMS))} FROM rollup WHERE {RANGE} "
               "GROUP BY tenant, arm, status")
# Per chart point of `step` seconds: requests, answered (ok), billed, and the tokens per call
# of what was billed (an engine failure is not).
_billed = lambda c: f"sum(CASE WHEN status <> 'error' THEN {c} ELSE 0 END)"
READ_SERIES = ("SELECT (bucket / {step}) * {step} AS t, CAST(sum(requests) AS BIGINT), "
               "CAST(sum(CASE WHEN status = 'ok' THEN requests ELSE 0 END) AS BIGINT), sum(cost), "
               f"{_billed('call_prompt')}, {_billed('call_cached')}, {_billed('call_output')} "
               f"FROM rollup WHERE {RANGE} {{tenant}} GROUP BY t")
READ_LATENCY = ("SELECT (bucket / {step}) * {step} AS t, kind, bin, CAST(sum(n) AS BIGINT) FROM latency "
                f"WHERE {RANGE} {{tenant}} GROUP BY t, kind, bin")
MONTH_SPEND = "SELECT tenant, cost FROM spend WHERE month = %s"

# The rows not yet folded (rolled = 0), oldest first, marked and returned by the transaction
# that folds them. `{lock}`: "" on SQLite (one writer at a time), SKIP_LOCKED on PostgreSQL.
UNROLLED_INDEX = "CREATE INDEX IF NOT EXISTS requests_unrolled ON requests(id) WHERE rolled = 0"
CLAIM = ("UPDATE requests SET rolled = 1 WHERE rolled = 0 AND id IN "
         "(SELECT id FROM requests WHERE rolled = 0 ORDER BY id LIMIT %s{lock}) RETURNING " + ", ".join(COLUMNS))
SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"


def latency_bin(ms: float) -> int:
    return 0 if ms < 1 else 1 + int(math.log(ms) / math.log(BIN_RATIO))


def bin_ms(b: int) -> float:
    """What a bin stands for: its geometric middle."""
    return 0.5 if b == 0 else BIN_RATIO ** (b - 0.5)


def fold(rows: list[UsageRow]) -> tuple[list[tuple], list[tuple]]:
    """A batch of rows as the rollup and latency additions they make, summed per key so that
    a batch costs one statement per bucket it touches, not per row."""
    sums: dict[tuple, list] = defaultdict(lambda: [0] * len(SUMS))
    counts: dict[tuple, int] = defaultdict(int)
    for row in rows:
        names = row.models.split(",") if row.models else []
        calls = max(1, len(names))
        widened = len(names) > 1 and len(set(names)) == 1      # the same model again, with a wider context
        output = row.completion_tokens                            # thinking is part of it
        add = (1, int(row.escalated and not widened), int(widened), int(row.models == CACHE_HIT),
               row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.thinking_tokens, row.cost,
               row.prompt_tokens / calls, row.cached_tokens / calls, output / calls)
        for grain in GRAINS:
            bucket = int(row.ts // grain) * grain
            s = sums[grain, bucket, row.tenant, row.arm or row.model, row.status]
            for i, v in enumerate(add):
                s[i] += v
            counts[grain, bucket, row.tenant, "total", latency_bin(row.total_ms)] += 1
            if row.ttft_ms is not None:
                counts[grain, bucket, row.tenant, "ttft", latency_bin(row.ttft_ms)] += 1
    return ([k + tuple(v) for k, v in sorted(sums.items())], [k + (n,) for k, n in sorted(counts.items())])


@dataclass
class Totals:
    """One tenant's rows of one arm and outcome in a window, added up."""
    tenant: str
    arm: str
    status: str
    requests: int
    escalated: int
    widened: int
    cache_hits: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    thinking_tokens: int
    cost: float
    call_prompt: float
    call_cached: float
    call_output: float


def reads(kind: str, step: int, tenant: str | None) -> tuple[str, tuple]:
    """READ_SERIES or READ_LATENCY at chart points of `step` seconds, for one tenant or all."""
    sql = {"series": READ_SERIES, "latency": READ_LATENCY}[kind]
    return sql.format(step=int(step), tenant="AND tenant = %s" if tenant else ""), (tenant,) if tenant else ()


def percentile(counts: dict[int, int], q: float) -> float | None:
    """The q-th percentile (0-100) of a latency histogram {bin: n}, in milliseconds."""
    total = sum(counts.values())
    if not total:
        return None
    need, seen = q / 100 * total, 0
    for b in sorted(counts):
        seen += counts[b]
        if seen >= need:
            return round(bin_ms(b), 1)
    return round(bin_ms(max(counts)), 1)
