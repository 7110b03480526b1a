"""The shared ledger in PostgreSQL: replicas writing the same tenants at once, the versioned
schema, the config's choice. (test_gateway_parts' ledger tests run on SQLite and PostgreSQL.)"""
from __future__ import annotations

import asyncio

import pytest

from gateway.config import ServerConfig
from gateway.usage.ledger import Ledger
from gateway.usage.storage import open_storage
from tests.services import postgres_url  # noqa: F401
from tests.test_gateway_parts import row


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_two_replicas_writing_the_same_tenants_at_once_lose_nothing(postgres_url):
    """Two ledgers (two replicas) commit batches that touch the same spend rows in opposite
    orders: sorted updates mean they wait on each other but never deadlock."""
    one, two = Ledger(postgres_url), Ledger(postgres_url)
    tenants = ["alpha", "beta", "gamma"]
    await asyncio.gather(*(ledger.record(row(i, tenants[(i if ledger is one else -i) % 3], request_id=f"r{n}_{i}"))
                           for n, ledger in enumerate((one, two)) for i in range(200)))
    assert len(one.rows()) == 400
    assert {r.request_id: r for r in two.rows()}["r0_5"] == row(5, "gamma", request_id="r0_5")   # as written
    assert [one.spent(t, "2025-06") for t in tenants] == [two.spent(t, "2025-06") for t in tenants]
    assert sum(one.spent(t, "2025-06") for t in tenants) == pytest.approx(200.0)
    one.close(), two.close()


def test_postgres_schema_is_migrated_once_by_version(postgres_url):
    import psycopg

    from gateway.usage.ledger_postgres import MIGRATIONS, migrate
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
