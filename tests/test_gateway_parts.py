"""The gateway's parts on their own: the ledger (group commit, crash safety), token buckets,
the bounded queue, the Prometheus text, and how msgspec errors are explained."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from gateway.errors import GatewayError, explain
from gateway.metrics import Counter, Histogram, Registry
from gateway.usage import limits
from gateway.usage.ledger import Ledger
from gateway.usage.limits import Admission, TokenBucket
from gateway.usage.rows import UsageRow
from tests.services import ledger_at  # noqa: F401


@pytest.fixture
def anyio_backend():
    return "asyncio"


def row(i: int, tenant: str = "alpha", cost: float = 0.5, request_id: str | None = None) -> UsageRow:
    return UsageRow(request_id or f"req_{i}", 1.0, "2025-06", tenant, "ask", "ok", "small", "small", None,
                    10, 2, 5, 0, cost, 1.0, 0.0, 3.0, 9.0, "router not installed; tenant default", None, None, False,
                    "length")


@pytest.mark.anyio
async def test_ledger_keeps_the_arm_and_adds_its_column_to_an_older_ledger(ledger_at, tmp_path):
    import dataclasses
    import re
    import sqlite3

    from gateway.usage.ledger import SCHEMA
    ledger = Ledger(ledger_at)
    await ledger.record(dataclasses.replace(row(1), arm="large+think256"))
    await ledger.record(row(2))
    assert [r.arm for r in ledger.rows()] == ["large+think256", None]
    ledger.close()
    # A SQLite ledger written before arms existed: opened, it gains the column; old rows read NULL.
    old = tmp_path / "old.sqlite"
    db = sqlite3.connect(old)
    db.executescript(re.sub(r",\n    arm TEXT,.*\n    rolled INTEGER NOT NULL DEFAULT 1\)", ")", SCHEMA))
    db.execute("INSERT INTO requests(request_id, ts, month, tenant, endpoint, status, model, models, prompt_tokens, "
               "cached_tokens, completion_tokens, thinking_tokens, cost, retrieval_ms, queue_ms, total_ms, "
               "route_reason, escalated) VALUES ('req_old', 1, '2025-06', 'alpha', 'ask', 'ok', 'small', 'small', "
               "1, 0, 1, 0, 0.1, 0, 0, 1, 'r', 0)")
    db.commit()
    assert not {"arm", "rolled"} & {c[1] for c in db.execute("PRAGMA table_info(requests)")}
    db.close()
    ledger = Ledger(old)
    await ledger.record(dataclasses.replace(row(3), arm="small"))
    assert [(r.request_id, r.arm) for r in ledger.rows()] == [("req_old", None), ("req_3", "small")]
    ledger.close()
    assert sum(t.requests for t in ledger.totals(86400, 0, 86400)) == 2       # backfilled, then folded: once each


@pytest.mark.anyio
async def test_ledger_commits_every_concurrent_row_and_keeps_the_monthly_spend(ledger_at):
    ledger = Ledger(ledger_at)
    await asyncio.gather(*(ledger.record(row(i, "alpha" if i % 3 else "beta")) for i in range(300)))
    assert len(ledger.rows()) == 300 and len(ledger.rows("beta")) == 100
    assert ledger.spent("alpha", "2025-06") == pytest.approx(100.0) and ledger.spent("alpha", "2025-07") == 0.0
    usage = ledger.usage("beta", "2025-06")["small"]
    assert usage == {"requests": 100, "prompt": 1000, "cached": 200, "completion": 500, "thinking": 0,
                     "cost": pytest.approx(50.0)}
    # A bad row (no tenant) fails alone; the rows committed with it stand. (A request id used
    # twice is not one: it is the same row written again after a lost acknowledgement.)
    results = await asyncio.gather(ledger.record(row(999, None)), ledger.record(row(1000)),
                                   return_exceptions=True)
    assert isinstance(results[0], ledger.db.Error) and results[1] is None
    assert "null" in str(results[0]).lower() and "tenant" in str(results[0])
    assert len(ledger.rows()) == 301
    ledger.close()


def test_ledger_rows_survive_a_crash_right_after_they_are_answered(ledger_at):
    path = ledger_at
    script = textwrap.dedent(f"""
        import asyncio, os
        from tests.test_gateway_parts import row
        from gateway.usage.ledger import Ledger
        async def main():
            ledger = Ledger({path!r})
            for i in range(50):
                await ledger.record(row(i))      # each "answered" once this returns
            os._exit(3)                          # die without closing anything
        asyncio.run(main())
    """)
    assert subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent).returncode == 3
    ledger = Ledger(path)
    assert [r.request_id for r in ledger.rows()] == [f"req_{i}" for i in range(50)]
    assert ledger.spent("alpha", "2025-06") == pytest.approx(25.0)
    assert sum(t.requests for t in ledger.totals(86400, 0, 86400)) == 50     # folded before or at this open


def test_token_bucket_refills_and_lets_an_oversized_take_run_into_debt(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    bucket = TokenBucket(60)                    # one a second
    assert bucket.take(50) == 0 and bucket.take(20) == pytest.approx(10.0)
    now[0] += 10
    assert bucket.take(20) == 0 and bucket.level == pytest.approx(0)
    now[0] += 60
    assert bucket.take(100) == 0 and bucket.level == pytest.approx(-40)   # needs a full bucket, then owes
    assert bucket.take(1) == pytest.approx(41.0)
    bucket.give_back(30)
    assert bucket.level == pytest.approx(-10)
    bucket.resize(30)
    assert bucket.capacity == 30 and bucket.level == pytest.approx(-10)


@pytest.mark.anyio
async def test_admission_queues_up_to_its_bound_then_refuses():
    admission = Admission(slots=1, queue=1)
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold():
        async with admission.slot():
            held.set()
            await release.wait()

    async def wait_turn():
        async with admission.slot() as waited:
            return waited

    first = asyncio.create_task(hold())
    await held.wait()
    second = asyncio.create_task(wait_turn())
    await asyncio.sleep(0.01)
    assert (admission.running, admission.waiting) == (1, 1)
    with pytest.raises(GatewayError) as e:
        async with admission.slot():
            pass
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    release.set()
    assert await second >= 0.01 and await first is None     # it waited out the sleep above, at least
    assert (admission.running, admission.waiting) == (0, 0)


def test_prometheus_text_format():
    r = Registry()
    c = r.add(Counter("x_total", "things", ("who",)))
    c.inc('a "quoted"\nname', amount=2)
    h = r.add(Histogram("y_seconds", "waits", (), buckets=(0.1, 1.0)))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    assert r.render().splitlines() == [
        "# HELP x_total things", "# TYPE x_total counter", 'x_total{who="a \\"quoted\\"\\nname"} 2',
        "# HELP y_seconds waits", "# TYPE y_seconds histogram",
        'y_seconds_bucket{le="0.1"} 1', 'y_seconds_bucket{le="1"} 2', 'y_seconds_bucket{le="+Inf"} 3',
        "y_seconds_sum 5.55", "y_seconds_count 3"]


class Inner(msgspec.Struct, forbid_unknown_fields=True):
    rpm: int


class Outer(msgspec.Struct, forbid_unknown_fields=True):
    limits: Inner
    keys: list[str]


@pytest.mark.parametrize("data,field,message", [
    ({"limits": {"rpm": "x"}, "keys": []}, "limits.rpm", "field 'limits.rpm': expected int, got str"),
    ({"limits": {}, "keys": []}, "limits.rpm", "field 'limits.rpm' is required but missing"),
    ({"limits": {"rpm": 1}, "keys": [], "x": 1}, "x", "field 'x' is not a known field"),
    ({"limits": {"rpm": 1}, "keys": [1]}, "keys[0]", "field 'keys[0]': expected str, got int"),
    ([], None, "expected object, got array"),
])
def test_msgspec_errors_are_explained_by_field(data, field, message):
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.convert(data, Outer)
    assert explain(e.value) == (field, message)

