"""The operator view's running totals, folded after the ledger's commit rather than in it
(gateway/usage/rollup.py): on SQLite and PostgreSQL the totals equal a fresh fold of every
row, a caller is answered before its row is folded, rows a crash left unfolded are folded
exactly once later, and two writers (replicas) folding one ledger count each row once."""
from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gateway.usage import rollup
from gateway.usage.ledger import FOLD_EVERY_S, Ledger, open_database
from gateway.usage.rows import Database, UsageRow
from tests.services import ledger_at  # noqa: F401
from tests.test_dashboard import usage_row

ROOT = Path(__file__).parent.parent


def traffic(n: int, start: int = 0, now: float | None = None) -> list[UsageRow]:
    """Rows over the last three hours: two tenants, every arm, escalations, widenings, errors."""
    now = now or time.time()
    kinds = [dict(models="small", arm="small"), dict(models="small,large", arm="small", escalated=True),
             dict(models="large,large", arm="large@192", escalated=True), dict(models="large", arm="large"),
             dict(models="small", arm="small", status="error", ttft=None), dict(models="large", arm=None)]
    return [usage_row(i, ("alpha", "beta")[i % 2], (i * 37) % 10_800, total=50.0 + (i * 13) % 4000,
                      completion=5 + i % 30, now=now, **kinds[i % len(kinds)]) for i in range(start, start + n)]


def stored(ledger: Ledger) -> tuple[list[tuple], list[tuple]]:
    """The running totals as the database holds them, in key order."""
    db = ledger.db._reader()
    sums = db.execute(f"SELECT {', '.join(rollup.KEY + rollup.SUMS)} FROM rollup "
                      f"ORDER BY {', '.join(rollup.KEY)}").fetchall()
    counts = db.execute("SELECT grain, bucket, tenant, kind, bin, n FROM latency "
                        "ORDER BY grain, bucket, tenant, kind, bin").fetchall()
    return [tuple(r) for r in sums], [tuple(r) for r in counts]


def unfolded(db: Database) -> int:
    return db._reader().execute("SELECT count(*) FROM requests WHERE rolled = 0").fetchone()[0]


def assert_totals_are_a_fresh_fold(ledger: Ledger, rows: int) -> None:
    """Every row in the totals once: what they hold equals folding all of `requests` anew."""
    every = ledger.rows()
    assert len(every) == rows and unfolded(ledger.db) == 0
    want_sums, want_counts = rollup.fold(every)
    have_sums, have_counts = stored(ledger)
    assert have_counts == want_counts
    assert [r[:5 + 8] for r in have_sums] == [r[:5 + 8] for r in want_sums]        # keys and integer sums
    assert [r[13:] for r in have_sums] == [pytest.approx(r[13:]) for r in want_sums]


def record_all(ledgers: list[Ledger], rows: list[UsageRow]) -> None:
    async def go():
        await asyncio.gather(*(ledgers[i % len(ledgers)].record(r) for i, r in enumerate(rows)))
    asyncio.run(go())


def test_the_totals_equal_a_fresh_fold_of_every_row(ledger_at):
    ledger = Ledger(ledger_at)
    rows = traffic(300)
    record_all([ledger], rows[:200])                  # group commits of whatever waits
    for r in rows[200:]:                              # and one row a commit
        asyncio.run(ledger.record(r))
    ledger.close()
    assert_totals_are_a_fresh_fold(ledger, 300)
    assert ledger.folded == 300 and ledger.fold_failures == 0


def test_a_caller_is_answered_before_its_row_is_folded(ledger_at):
    ledger = Ledger(ledger_at)
    events: list[str] = []
    started, release = threading.Event(), threading.Event()
    fold = ledger.db.fold

    def held_fold(limit: int) -> int:
        started.set()
        assert release.wait(30)
        n = fold(limit)
        events.append(f"folded {n}")
        return n

    ledger.db.fold = held_fold
    row = traffic(1)[0]

    async def answer():
        await ledger.record(row)
        events.append("answered")
    asyncio.run(answer())
    assert started.wait(30)                          # the writer is in the fold, held there
    assert events == ["answered"]
    assert [r.request_id for r in ledger.rows()] == [row.request_id]     # committed, and billed
    assert ledger.spent(row.tenant, row.month) == pytest.approx(row.cost)
    assert stored(ledger) == ([], []) and unfolded(ledger.db) == 1          # but not in the totals yet
    release.set()
    ledger.close()
    assert events == ["answered", "folded 1"]
    assert_totals_are_a_fresh_fold(ledger, 1)


def test_folds_come_at_most_every_fold_every_s_whatever_the_commits(ledger_at):
    """Rows answered one after another are folded in a few folds, each taking every row
    committed since the last, not one fold per commit."""
    ledger = Ledger(ledger_at)
    fold, calls = ledger.db.fold, []
    ledger.db.fold = lambda limit: calls.append(fold(limit)) or calls[-1]
    start = time.monotonic()
    for r in traffic(60):
        asyncio.run(ledger.record(r))
    elapsed = time.monotonic() - start
    ledger.close()
    assert sum(calls) == 60 and len(calls) <= 2 + elapsed / FOLD_EVERY_S     # the last one: at close
    assert len(calls) < 60
    assert_totals_are_a_fresh_fold(ledger, 60)


def test_rows_a_crash_left_unfolded_are_folded_once_at_the_next_open(ledger_at):
    """The writer's process dies inside the folding transaction, after its claim marked the
    rows: the claim rolls back with it, the rows stay committed, and the next open folds them."""
    script = textwrap.dedent(f"""
        import asyncio, os
        from gateway.usage import rollup
        from tests.test_ledger_folds import traffic
        from gateway.usage.ledger import Ledger
        rows = traffic(40, now={time.time()})
        async def main():
            ledger = Ledger({ledger_at!r})
            for r in rows[:20]:
                await ledger.record(r)
            ledger.close()                       # these are folded; the next ones are not
            fold = rollup.fold
            def die(rows):
                if rows:
                    os._exit(3)                  # the claim ran, the totals are not added, no commit
                return fold(rows)
            rollup.fold = die
            ledger = Ledger({ledger_at!r})
            await asyncio.gather(*(ledger.record(r) for r in rows[20:]))     # each answered
            await asyncio.sleep(30)              # the writer dies folding them
        asyncio.run(main())
    """)
    assert subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120).returncode == 3
    db = open_database(ledger_at)
    if ledger_at.startswith("postgresql"):     # the server drops the dead writer's transaction at once; make it certain
        while db._reader().execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND pid <> pg_backend_pid()").fetchone()[0]:
            time.sleep(0.01)
    assert len(db.rows()) == 40 and unfolded(db) == 20         # every row committed; 20 not in the totals
    ledger = Ledger(ledger_at)
    assert ledger.folded == 20
    assert_totals_are_a_fresh_fold(ledger, 40)
    again = Ledger(ledger_at)                                  # opened again: nothing left to fold
    assert again.folded == 0
    assert_totals_are_a_fresh_fold(again, 40)


def test_a_failed_fold_is_tried_again_by_the_writer(ledger_at, monkeypatch):
    ledger = Ledger(ledger_at, retry_s=0.05)
    fold, failed = rollup.fold, []

    def fail_once(rows):
        if not failed:
            failed.append(len(rows))
            raise RuntimeError("the folding transaction fails once")
        return fold(rows)

    monkeypatch.setattr(rollup, "fold", fail_once)
    record_all([ledger], traffic(30))                 # every caller answered all the same
    deadline = time.monotonic() + 30
    while unfolded(ledger.db) and time.monotonic() < deadline:       # no more writes: the retry folds them
        time.sleep(0.02)
    assert failed and ledger.fold_failures == 1
    assert_totals_are_a_fresh_fold(ledger, 30)
    ledger.close()


def test_two_writers_and_a_sweeper_on_one_ledger_count_each_row_once(ledger_at):
    """Two ledgers on one database (two replicas on PostgreSQL; two processes on a SQLite file)
    commit and fold at once, while a third folds a few rows at a time: whoever claims a row
    folds it, and only they."""
    one, two = Ledger(ledger_at), Ledger(ledger_at)
    sweeper, swept, stop = open_database(ledger_at), [0], threading.Event()

    def sweep():
        while not stop.wait(0.001):
            swept[0] += sweeper.fold(7)
    thread = threading.Thread(target=sweep)
    thread.start()
    rows = traffic(600)
    try:
        record_all([one, two], rows[:300])
        for i in range(300, 600, 50):                 # and in waves, so folds find rows to race for
            record_all([one, two], rows[i:i + 50])
    finally:
        stop.set()
        thread.join()
        one.close(), two.close(), sweeper.close_writer()
    assert one.folded + two.folded + swept[0] == 600
    assert_totals_are_a_fresh_fold(one, 600)


def test_a_ledger_written_before_the_fold_mark_keeps_its_totals(ledger_at):
    """Rows of an older version were folded in their own transactions: once the mark is added
    (default 1: folded), none of them is folded again."""
    ledger = Ledger(ledger_at)
    record_all([ledger], traffic(50))
    ledger.close()
    before = stored(ledger)
    db = ledger.db._reader()
    if ledger_at.startswith("postgresql"):
        with db.transaction():
            db.execute("DROP INDEX requests_unrolled")
            db.execute("ALTER TABLE requests DROP COLUMN rolled")
            db.execute("DELETE FROM sluice_schema_migrations WHERE version = 4")
    else:
        db.execute("DROP INDEX requests_unrolled")
        db.execute("ALTER TABLE requests DROP COLUMN rolled")
    again = Ledger(ledger_at)
    assert again.folded == 0 and stored(again) == before
    record_all([again], [dataclasses.replace(r, request_id=r.request_id + "_new") for r in traffic(10)])
    again.close()
    assert_totals_are_a_fresh_fold(again, 60)
