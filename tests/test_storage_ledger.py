"""The usage ledger on every database it runs on (SQLite, PostgreSQL): group commit, a bad
row failing alone, monthly totals, rows that survive a crash, replicas writing at once, and
PostgreSQL's versioned schema."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from dataclasses import astuple
from pathlib import Path

import pytest

from gateway.config import ServerConfig
from gateway.ledger import Ledger
from gateway.storage import open_storage
from tests.services import Postgres, postgres_url, server  # noqa: F401
from tests.test_gateway_parts import row


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=["sqlite", "postgres"])
def where(request, tmp_path) -> str | Path:
    """Where a ledger lives: a SQLite file, or a fresh PostgreSQL database."""
    return tmp_path / "ledger.sqlite" if request.param == "sqlite" else server(Postgres).fresh_database()


@pytest.mark.anyio
async def test_every_concurrent_row_is_committed_and_a_bad_one_fails_alone(where):
    ledger = Ledger(where)
    await asyncio.gather(*(ledger.record(row(i, "alpha" if i % 3 else "beta")) for i in range(300)))
    assert len(ledger.rows()) == 300 and len(ledger.rows("beta")) == 100
    assert ledger.spent("alpha", "2025-06") == pytest.approx(100.0) and ledger.spent("alpha", "2025-07") == 0.0
    assert ledger.usage("beta", "2025-06") == {"small": {"requests": 100, "prompt": 1000, "cached": 200,
                                                         "completion": 500, "thinking": 0, "cost": pytest.approx(50.0)}}
    results = await asyncio.gather(ledger.record(row(0, request_id="req_1")), ledger.record(row(1000)),
                                   return_exceptions=True)
    assert isinstance(results[0], ledger.db.Error) and "request_id" in str(results[0]) and results[1] is None
    assert len(ledger.rows()) == 301 and ledger.spent("alpha", "2025-06") == pytest.approx(100.5)
    assert ledger.rows()[0] == row(0, "beta")            # every field comes back as written
    ledger.close()


def test_rows_survive_a_crash_right_after_they_are_answered(postgres_url):
    """PostgreSQL's twin of test_gateway_parts' SQLite test (which covers the default)."""
    rows = [astuple(row(i)) for i in range(50)]
    script = textwrap.dedent(f"""
        import asyncio, os
        from gateway.ledger import Ledger, UsageRow
        async def main():
            ledger = Ledger({postgres_url!r})
            for values in {rows!r}:
                await ledger.record(UsageRow(*values))   # each "answered" once this returns
            os._exit(3)                                  # die without closing anything
        asyncio.run(main())
    """)
    assert subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent).returncode == 3
    ledger = Ledger(postgres_url)
    assert [r.request_id for r in ledger.rows()] == [f"req_{i}" for i in range(50)]
    assert ledger.spent("alpha", "2025-06") == pytest.approx(25.0)


@pytest.mark.anyio
async def test_two_replicas_writing_the_same_tenants_at_once_lose_nothing(postgres_url):
    """Two ledgers (two replicas) commit batches that touch the same spend rows in opposite
    orders: sorted updates mean they wait on each other but never deadlock."""
    one, two = Ledger(postgres_url), Ledger(postgres_url)
    tenants = ["alpha", "beta", "gamma"]
    await asyncio.gather(*(ledger.record(row(i, tenants[(i if ledger is one else -i) % 3], request_id=f"r{n}_{i}"))
                           for n, ledger in enumerate((one, two)) for i in range(200)))
    assert len(one.rows()) == 400
    assert [one.spent(t, "2025-06") for t in tenants] == [two.spent(t, "2025-06") for t in tenants]
    assert sum(one.spent(t, "2025-06") for t in tenants) == pytest.approx(200.0)
    one.close(), two.close()


def test_postgres_schema_is_migrated_once_by_version(postgres_url):
    import psycopg
    from gateway.ledger_postgres import MIGRATIONS, migrate
    Ledger(postgres_url)
    assert migrate(postgres_url) == []                       # a second replica applies nothing
    with psycopg.connect(postgres_url) as db:
        versions = [v for (v,) in db.execute("SELECT version FROM sluice_schema_migrations ORDER BY version")]
    assert versions == [v for v, _ in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))


def test_the_config_picks_the_ledger(tmp_path, postgres_url):
    default, _, _ = open_storage(ServerConfig(), tmp_path)
    assert default.db.path == tmp_path / "ledger.sqlite"
    absolute, _, _ = open_storage(ServerConfig(ledger=f"sqlite:///{tmp_path}/elsewhere.db"), tmp_path / "data")
    assert absolute.db.path == tmp_path / "elsewhere.db"
    shared, _, _ = open_storage(ServerConfig(ledger=postgres_url), tmp_path)
    assert type(shared.db).__name__ == "PostgresDatabase" and shared.db.url == postgres_url
