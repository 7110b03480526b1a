"""The usage ledger in PostgreSQL, shared by every replica of a deployment (psycopg 3).

The schema is a list of numbered migrations applied in order, each in its own transaction
and recorded in `sluice_schema_migrations`, under an advisory lock so that replicas starting
together apply each one once. A new schema change is a new entry at the end, never an edit.

Replicas commit at the same time into the same `spend` rows; each transaction updates its
tenants' rows in one sorted order, so two of them can wait on each other but never deadlock.
They fold their rows into the operator view's running totals the same way, after the commit
(rollup.py says why no row is folded twice though any replica may fold any row).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import astuple

import psycopg

from gateway.usage import rollup
from gateway.usage.rollup import Totals
from gateway.usage.rows import INSERT, SELECT_ROWS, USAGE, USAGE_KEYS, UsageRow


def _add_to_rollups(cur: psycopg.Cursor, rows: list[UsageRow]) -> None:
    sums, counts = rollup.fold(rows)          # sorted by key, like the spend rows
    cur.executemany(rollup.ADD_ROLLUP, sums)
    cur.executemany(rollup.ADD_LATENCY, counts)


def _backfill_rollups(db: psycopg.Connection) -> None:
    """The operator view's running totals of the rows written before they existed."""
    with db.cursor(name="backfill") as rows, db.cursor() as out:
        rows.execute(SELECT_ROWS + " ORDER BY id")
        while batch := rows.fetchmany(10_000):
            _add_to_rollups(out, [UsageRow(*r) for r in batch])


MIGRATIONS: list[tuple[int, list[str | Callable[[psycopg.Connection], None]]]] = [
    (1, ["""CREATE TABLE requests(
            id BIGSERIAL PRIMARY KEY,
            request_id TEXT NOT NULL UNIQUE,
            ts DOUBLE PRECISION NOT NULL,           -- unix seconds when the request ended
            month TEXT NOT NULL,                    -- YYYY-MM (UTC): the month its cost counts against
            tenant TEXT NOT NULL,
            endpoint TEXT NOT NULL,                 -- ask | chat | cli
            status TEXT NOT NULL,                   -- ok | cancelled | error
            model TEXT NOT NULL,
            models TEXT NOT NULL,
            collection TEXT,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            thinking_tokens INTEGER NOT NULL,
            cost DOUBLE PRECISION NOT NULL,         -- US dollars
            retrieval_ms DOUBLE PRECISION NOT NULL, queue_ms DOUBLE PRECISION NOT NULL,
            ttft_ms DOUBLE PRECISION, total_ms DOUBLE PRECISION NOT NULL,
            route_reason TEXT NOT NULL, difficulty TEXT, confidence DOUBLE PRECISION,
            escalated BOOLEAN NOT NULL, finish_reason TEXT)""",
         "CREATE INDEX requests_by_tenant ON requests(tenant, month)",
         """CREATE TABLE spend(tenant TEXT NOT NULL, month TEXT NOT NULL, cost DOUBLE PRECISION NOT NULL,
            PRIMARY KEY(tenant, month))"""]),
    (2, ["ALTER TABLE requests ADD COLUMN arm TEXT"]),          # the router's arm; NULL: not routed by arms
    (3, [*rollup.TABLES.split(";")[:-1], _backfill_rollups]),   # the operator view's running totals
    # The fold mark (rollup.py); every older row was folded in its own transaction or by 3.
    (4, ["ALTER TABLE requests ADD COLUMN rolled SMALLINT NOT NULL DEFAULT 1", rollup.UNROLLED_INDEX]),
]
MIGRATION_LOCK = 0x511CE                 # the pg_advisory_lock key migrations hold
CLAIM = rollup.CLAIM.format(lock=rollup.SKIP_LOCKED)
ADD_SPEND = ("INSERT INTO spend(tenant, month, cost) VALUES (%s, %s, %s) "
             "ON CONFLICT(tenant, month) DO UPDATE SET cost = spend.cost + excluded.cost")


def migrate(url: str) -> list[int]:
    """Apply the migrations this database lacks; returns the versions applied now."""
    applied = []
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        try:
            db.execute("CREATE TABLE IF NOT EXISTS sluice_schema_migrations("
                       "version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
            have = {v for (v,) in db.execute("SELECT version FROM sluice_schema_migrations")}
            for version, statements in MIGRATIONS:
                if version in have:
                    continue
                with db.transaction():
                    for sql in statements:
                        sql(db) if callable(sql) else db.execute(sql)
                    db.execute("INSERT INTO sluice_schema_migrations(version) VALUES (%s)", (version,))
                applied.append(version)
        finally:
            db.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
    return applied


class PostgresDatabase:
    Error = psycopg.Error
    Unavailable = psycopg.OperationalError        # the server is down, restarting or unreachable

    def __init__(self, url: str):
        self.url = url
        migrate(url)
        self._local = threading.local()          # one reading connection per thread
        self._writer: psycopg.Connection | None = None

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True)

    def _reader(self) -> psycopg.Connection:
        db = getattr(self._local, "db", None)
        if db is None or db.closed:              # first use, or the server dropped it: connect again
            db = self._local.db = self._connect()
        return db

    def _writing(self) -> psycopg.Connection:
        if self._writer is None or self._writer.closed:
            self._writer = self._connect()
        return self._writer

    def write(self, rows: list[UsageRow]) -> None:
        spend: dict[tuple[str, str], float] = defaultdict(float)
        db = self._writing()
        with db.transaction(), db.cursor() as cur:
            cur.executemany(INSERT, [astuple(row) for row in rows], returning=True)
            for row, _ in zip(rows, cur.results()):
                if cur.fetchall():
                    spend[row.tenant, row.month] += row.cost
            cur.executemany(ADD_SPEND, [(t, m, c) for (t, m), c in sorted(spend.items())])

    def fold(self, limit: int) -> int:
        db = self._writing()
        with db.transaction(), db.cursor() as cur:
            cur.execute("SET LOCAL synchronous_commit = off")     # a fold lost to a crash is done again
            rows = [UsageRow(*r) for r in cur.execute(CLAIM, (limit,)).fetchall()]
            _add_to_rollups(cur, rows)
        return len(rows)

    def close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def spent(self, tenant: str, month: str) -> float:
        row = self._reader().execute("SELECT cost FROM spend WHERE tenant = %s AND month = %s",
                                     (tenant, month)).fetchone()
        return row[0] if row else 0.0

    def usage(self, tenant: str, month: str) -> dict[str, dict]:
        rows = self._reader().execute(USAGE, (tenant, month))
        return {r[0]: dict(zip(USAGE_KEYS, r[1:])) for r in rows}

    def rows(self, tenant: str | None = None) -> list[UsageRow]:
        sql = SELECT_ROWS + (" WHERE tenant = %s" if tenant else "") + " ORDER BY id"
        return [UsageRow(*r) for r in self._reader().execute(sql, (tenant,) if tenant else ())]

    def totals(self, grain: int, start: int, end: int) -> list[Totals]:
        return [Totals(*r) for r in self._reader().execute(rollup.READ_TOTALS, (grain, start, end))]

    def series(self, kind: str, grain: int, start: int, end: int, step: int, tenant: str | None) -> list[tuple]:
        sql, more = rollup.reads(kind, step, tenant)
        return self._reader().execute(sql, (grain, start, end, *more)).fetchall()

    def month_spend(self, month: str) -> dict[str, float]:
        return dict(self._reader().execute(rollup.MONTH_SPEND, (month,)).fetchall())
