"""The usage ledger: one row per request that reached the engine, in SQLite (WAL) for one
process, or in PostgreSQL (ledger_postgres.py) that every replica of a deployment shares.

A request is answered only after its row is committed, so no answered request is missing
from the ledger, whatever crashes afterwards. One writer thread commits every row waiting
at that moment in one transaction (group commit): under load one fsync serves many rows.
Each row also adds its cost to a per-tenant monthly total in the same transaction, which
is what the spend cap reads (a primary-key lookup, not a sum over the month). The operator
view's running totals are not in that transaction: the writer folds the committed rows into
them after their callers are answered, in a transaction of its own (rollup.py says how each
row is counted there exactly once, whatever crashes).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path

from gateway.usage import rollup
from gateway.usage.rollup import Totals
from gateway.usage.rows import INSERT, SELECT_ROWS, USAGE, USAGE_KEYS, Database, UsageRow

log = logging.getLogger("sluice.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests(
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL UNIQUE,
    ts REAL NOT NULL,                 -- unix seconds when the request ended
    month TEXT NOT NULL,              -- YYYY-MM (UTC): the month its cost counts against
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,           -- ask | chat | cli
    status TEXT NOT NULL,             -- ok | cancelled (client went away) | error (engine failed) | timeout
    model TEXT NOT NULL,              -- the model that gave the answer
    models TEXT NOT NULL,             -- every model that ran, comma-separated
    collection TEXT,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    thinking_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,               -- US dollars
    retrieval_ms REAL NOT NULL, queue_ms REAL NOT NULL, ttft_ms REAL, total_ms REAL NOT NULL,
    route_reason TEXT NOT NULL, difficulty TEXT, confidence REAL, escalated INTEGER NOT NULL,
    finish_reason TEXT,
    arm TEXT,                         -- the router's arm (NULL: not routed by arms)
    rolled INTEGER NOT NULL DEFAULT 1);  -- 0 until folded into the running totals (rollup.py)
CREATE INDEX IF NOT EXISTS requests_by_tenant ON requests(tenant, month);
CREATE TABLE IF NOT EXISTS spend(
    tenant TEXT NOT NULL, month TEXT NOT NULL, cost REAL NOT NULL, PRIMARY KEY(tenant, month));
"""


ADD_SPEND = ("INSERT INTO spend(tenant, month, cost) VALUES (?, ?, ?) "
             "ON CONFLICT(tenant, month) DO UPDATE SET cost = cost + excluded.cost")
INSERT, ADD_ROLLUP, ADD_LATENCY, CLAIM = (q.replace("%s", "?") for q in (
    INSERT, rollup.ADD_ROLLUP, rollup.ADD_LATENCY, rollup.CLAIM.format(lock="")))
BACKFILL_BATCH = 10_000
FOLD_BATCH = 10_000         # rows a folding transaction takes at most
FOLD_EVERY_S = 0.1          # folds come at most this often, each taking every row committed since
FOLD_LAG_S = 1.0            # under load, the running totals trail the ledger by about this at most
WRITER_CHECKPOINT_PAGES = 10_000


class SqliteDatabase:
    Error = sqlite3.Error
    Unavailable = sqlite3.OperationalError        # disk full, read-only, locked past the timeout

    def __init__(self, path: str | Path, synchronous: str = "NORMAL"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.synchronous = synchronous
        self._migrate()
        self._local = threading.local()          # one reading connection per thread
        self._writer: sqlite3.Connection | None = None
        self._folder: sqlite3.Connection | None = None

    def _migrate(self) -> None:
        """Create the ledger or bring an older one up to date, in one transaction (two processes
        opening one ledger do it once): the router's arm (NULL in older rows), the fold mark (1
        in older rows: they were folded in their own transactions), and the operator view's
        running totals, which a ledger written before them gets from its rows."""
        db = self._connect()
        try:
            with _immediate(db):
                for statement in SCHEMA.split(";")[:-1]:
                    db.execute(statement)
                columns = {r[1] for r in db.execute("PRAGMA table_info(requests)")}
                if "arm" not in columns:
                    db.execute("ALTER TABLE requests ADD COLUMN arm TEXT")
                if "rolled" not in columns:
                    db.execute("ALTER TABLE requests ADD COLUMN rolled INTEGER NOT NULL DEFAULT 1")
                db.execute(rollup.UNROLLED_INDEX)
                if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'rollup'").fetchone():
                    for statement in rollup.TABLES.split(";")[:-1]:
                        db.execute(statement)
                    cursor = db.execute(SELECT_ROWS + " ORDER BY id")
                    while batch := cursor.fetchmany(BACKFILL_BATCH):
                        _add_to_rollups(db, [_row(r) for r in batch])
                    db.execute("UPDATE requests SET rolled = 1 WHERE rolled = 0")     # all of them are in now
        finally:
            db.close()

    def _connect(self, synchronous: str | None = None) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous or self.synchronous}")
        return db

    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        return db

    def write(self, rows: list[UsageRow]) -> None:
        # The commit that finds the log past a threshold copies it into the database (a
        # checkpoint, with an fsync). The folding connection's threshold is SQLite's default,
        # 1000 pages, and it folds after every commit: its commits checkpoint, after the callers
        # are answered. This one's, ten times that, is a backstop for when folds fail.
        if self._writer is None:
            self._writer = self._connect()
            self._writer.execute(f"PRAGMA wal_autocheckpoint = {WRITER_CHECKPOINT_PAGES}")
        db = self._writer
        with _immediate(db):
            for row in rows:
                if db.execute(INSERT, astuple(row)).fetchall():
                    db.execute(ADD_SPEND, (row.tenant, row.month, row.cost))

    def fold(self, limit: int) -> int:
        # A connection of its own that never syncs: a fold lost to a power cut is done again
        # (rollup.py), and the next ledger commit (FULL) syncs the log it wrote to anyway.
        db = self._folder = self._folder or self._connect("NORMAL")
        with _immediate(db):
            rows = [_row(r) for r in db.execute(CLAIM, (limit,))]
            _add_to_rollups(db, rows)
        return len(rows)

    def close_writer(self) -> None:
        for db in (self._writer, self._folder):
            if db is not None:
                db.close()
        self._writer = self._folder = None

    def spent(self, tenant: str, month: str) -> float:
        row = self._reader().execute("SELECT cost FROM spend WHERE tenant = ? AND month = ?",
                                     (tenant, month)).fetchone()
        return row[0] if row else 0.0

    def usage(self, tenant: str, month: str) -> dict[str, dict]:
        rows = self._reader().execute(USAGE.replace("%s", "?"), (tenant, month))
        return {r[0]: dict(zip(USAGE_KEYS, r[1:])) for r in rows}

    def rows(self, tenant: str | None = None) -> list[UsageRow]:
        sql = SELECT_ROWS + (" WHERE tenant = ?" if tenant else "") + " ORDER BY id"
        return [_row(r) for r in self._reader().execute(sql, (tenant,) if tenant else ())]

    def totals(self, grain: int, start: int, end: int) -> list[Totals]:
        sql = rollup.READ_TOTALS.replace("%s", "?")
        return [Totals(*r) for r in self._reader().execute(sql, (grain, start, end))]

    def series(self, kind: str, grain: int, start: int, end: int, step: int, tenant: str | None) -> list[tuple]:
        sql, more = rollup.reads(kind, step, tenant)
        return self._reader().execute(sql.replace("%s", "?"), (grain, start, end, *more)).fetchall()

    def month_spend(self, month: str) -> dict[str, float]:
        return dict(self._reader().execute(rollup.MONTH_SPEND.replace("%s", "?"), (month,)).fetchall())


@contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    """A write transaction that takes the database's one write lock at its start."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _add_to_rollups(db: sqlite3.Connection, rows: list[UsageRow]) -> None:
    sums, counts = rollup.fold(rows)
    db.executemany(ADD_ROLLUP, sums)
    db.executemany(ADD_LATENCY, counts)


def _row(r: tuple) -> UsageRow:
    """A requests row as read from SQLite, where `escalated` is stored as 0 or 1."""
    return UsageRow(*r[:-3], bool(r[-3]), *r[-2:])


def open_database(where: str | Path, synchronous: str = "NORMAL") -> Database:
    """A postgresql:// URL, or the path of a SQLite file."""
    if isinstance(where, str) and where.startswith(("postgresql://", "postgres://")):
        from gateway.usage.ledger_postgres import PostgresDatabase
        return PostgresDatabase(where)
    return SqliteDatabase(where, synchronous)


class LedgerUnavailable(Exception):
    """The store refused the row for a reason of its own (full, read-only, unreachable). The
    row is kept and written once the store takes writes again; meanwhile `unavailable` says why."""


class Ledger:
    """Group commit in front of a database. `after_commit` hooks see each committed batch in
    the writer thread before any of its callers return (the shared spend cap counts it there).

    Once the callers are answered, the same thread folds the committed rows into the operator
    view's running totals (`db.fold`): at most every FOLD_EVERY_S, all rows committed since in
    one fold (a fold per commit would cost several times as much a row, and write as much
    again to SQLite's log, whose checkpoints a caller arriving during one waits for). Rows
    waiting to be committed go first, unless the totals are FOLD_LAG_S behind. A fold that
    fails leaves its rows marked unfolded; it is tried again every `retry_s`, and whatever a
    crash left is folded when a ledger is next opened.

    When the store itself fails (not a bad row), the rows are kept in memory, their callers
    get LedgerUnavailable, `unavailable` says why, and the writer tries them again every
    `retry_s`: the first success clears it, without a restart."""

    def __init__(self, where: str | Path, synchronous: str = "NORMAL", retry_s: float = 1.0):
        self.db = open_database(where, synchronous)
        self.after_commit: list[Callable[[list[UsageRow]], None]] = []
        self.unavailable: str | None = None
        self.retry_s = retry_s
        self._pending: list[UsageRow] = []          # refused by the store; written when it is back
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.folded = 0                  # rows this process folded into the running totals
        self.fold_failures = 0
        self._unfolded = True            # committed rows may wait for a fold (at open: a crash's)
        self._fold_at = time.monotonic()     # the next fold, not before
        self._fold()

    # ---- writing ----

    async def record(self, row: UsageRow) -> None:
        """Returns once the row is committed; raises if it could not be."""
        self._ensure_writer()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.put((row, loop, done))
        await asyncio.shield(done)       # a cancelled caller still gets its row written

    def _ensure_writer(self) -> None:
        with self._start_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="sluice-ledger", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        while True:
            try:
                batch = [self._queue.get(timeout=self._idle_s())]
            except queue.Empty:              # time to try the kept rows, or the fold, again
                batch = []
            while not self._queue.empty():
                batch.append(self._queue.get())
            if self._pending:
                self._retry()
            items = [b for b in batch if b is not None]
            if items:
                rows = [row for row, _, _ in items]
                try:
                    self.db.write(rows)
                    errors = [None] * len(items)
                except self.db.Error:        # one bad row must not cost the others theirs
                    errors = [self._write_alone(row) for row in rows]
                committed = [row for row, error in zip(rows, errors) if error is None]
                self._committed(committed)
                for (_, loop, done), error in zip(items, errors):
                    try:
                        loop.call_soon_threadsafe(_settle, done, error)
                    except RuntimeError:     # that caller's event loop is gone; the row is written
                        pass
            stopping = len(items) < len(batch)
            if self._unfolded and (stopping or self._fold_due()):
                self._fold()
            if stopping:                     # close() asked us to stop
                if self._pending:
                    log.error("closing with %d usage rows the store never took", len(self._pending))
                self.db.close_writer()
                return

    def _write_alone(self, row: UsageRow) -> Exception | None:
        try:
            self.db.write([row])
        except self.db.Unavailable as e:
            self.unavailable = f"{type(e).__name__}: {e}"
            self._pending.append(row)
            log.error("usage ledger unavailable, %d rows kept to write later: %s", len(self._pending), e)
            return LedgerUnavailable(self.unavailable)
        except self.db.Error as e:
            return e
        self.unavailable = None
        return None

    def _retry(self) -> None:
        try:
            self.db.write(self._pending)
        except self.db.Error as e:
            self.unavailable = f"{type(e).__name__}: {e}"
            return
        log.warning("usage ledger available again: wrote the %d rows kept", len(self._pending))
        self._committed(self._pending)
        self._pending, self.unavailable = [], None

    def _committed(self, rows: list[UsageRow]) -> None:
        self._unfolded = self._unfolded or bool(rows)
        for hook in self.after_commit if rows else ():
            try:
                hook(rows)
            except Exception:        # the rows stand; the hook reports its own trouble
                log.exception("after-commit hook failed")

    def _fold_due(self) -> bool:
        """FOLD_EVERY_S after the last fold, once no rows wait to be committed (they go first),
        or FOLD_LAG_S later whatever waits."""
        now = time.monotonic()
        return now >= self._fold_at and (self._queue.empty() or now >= self._fold_at + FOLD_LAG_S)

    def _idle_s(self) -> float | None:
        """How long the writer may wait for rows: until kept rows are tried again, or a fold is due."""
        waits = [self.retry_s] if self._pending else []
        if self._unfolded:
            waits.append(max(0.0, self._fold_at - time.monotonic()))
        return min(waits, default=None)

    def _fold(self) -> None:
        """Fold committed rows into the running totals, a batch a transaction, until none are
        left or rows wait to be committed (they go first)."""
        try:
            while True:
                n = self.db.fold(FOLD_BATCH)
                self.folded += n
                if n < FOLD_BATCH:
                    self._unfolded = False
                    break
                if not self._queue.empty():
                    break
        except Exception as e:       # the rows stay committed and unfolded; folded at the next try
            self.fold_failures += 1
            log.warning("folding committed rows into the operator view's totals failed; tried again later: %s", e)
            self._fold_at = time.monotonic() + self.retry_s
            return
        self._fold_at = time.monotonic() + FOLD_EVERY_S

    def close(self) -> None:
        with self._start_lock:
            if self._writer is not None:
                self._queue.put(None)
                self._writer.join()          # it closes the writing connections as it ends
                self._writer = None
            else:
                self.db.close_writer()       # the one the fold at open used

    # ---- reading ----

    def spent(self, tenant: str, month: str) -> float:
        return self.db.spent(tenant, month)

    def usage(self, tenant: str, month: str) -> dict[str, dict]:
        """Per model: requests, tokens by kind and cost of one tenant in one month."""
        return self.db.usage(tenant, month)

    def rows(self, tenant: str | None = None) -> list[UsageRow]:
        return self.db.rows(tenant)

    # The operator's view (rollup.py): bounded reads of the running totals, never of `requests`.

    def totals(self, grain: int, start: int, end: int) -> list[Totals]:
        """Every tenant's totals per arm and outcome over the buckets of `grain` seconds in [start, end)."""
        return self.db.totals(grain, start, end)

    def series(self, kind: str, grain: int, start: int, end: int, step: int, tenant: str | None = None) -> list[tuple]:
        """Per point of `step` seconds: "series" (t, requests, answered, cost, prompt, cached and
        output tokens per call) or "latency" (t, kind, bin, n), over every tenant or one."""
        return self.db.series(kind, grain, start, end, step, tenant)

    def month_spend(self, month: str) -> dict[str, float]:
        """Each tenant's spend in a month, as the cap counts it."""
        return self.db.month_spend(month)


def _settle(done: asyncio.Future, error: Exception | None) -> None:
    if not done.done():
        done.set_exception(error) if error else done.set_result(None)
