"""Running totals of the ledger by time bucket, for the operator's view (docs/gateway.md).

Every committed row also adds itself, in the same transaction, to a minute, an hour and a day
bucket of `rollup` (one row per tenant, arm and outcome) and of `latency` (a histogram of
TTFT and total time per tenant). The dashboard then reads at most a few thousand rows for
any window, whatever the ledger holds: an hour is 60 minute buckets, a day 24 hour buckets,
a month 30 day buckets, not every request of that month. Both databases (ledger.py,
ledger_postgres.py) run this SQL; it is written with %s, PostgreSQL's placeholder, and
SQLite's ? is substituted in.

Dollars saved are estimated from the tokens, not stored: each row adds its tokens per engine
call (a request the cascade answered twice counts once), and the reader prices those at the
large model's prices: what the same requests would have cost had the large model alone
answered each with the same prompt and as many output tokens.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from gateway.usage.rows import CACHE_HIT, UsageRow

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
