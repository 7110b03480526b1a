"""The usage ledger when its store fails: SQLite on a full disk (SQLite's own way to make one:
`PRAGMA max_page_count` on the writing connection), PostgreSQL restarted under load. A row the
store refuses is kept and written once it is back, its caller is told (LedgerUnavailable, a
503 at the gateway: an answer is withheld rather than given unbilled), new requests are
refused while the store refuses, nothing committed is lost, and it all recovers without a
restart."""
from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gateway.http.app import create_app
from gateway.usage.ledger import Ledger, LedgerUnavailable, open_database
from tests.services import Postgres, ledger_at, server  # noqa: F401
from tests.test_gateway_parts import row
from tests.test_gateway_support import auth, embedder, llm, make_gateway, wait_for, wait_ready  # noqa: F401

NO_LIMIT = 1073741823          # SQLite's largest max_page_count


def fill_disk(ledger: Ledger) -> None:
    """No page past the ones the file has: the next write that needs one fails as on a full disk."""
    db = ledger.db._writer
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")


def free_disk(ledger: Ledger) -> None:
    ledger.db._writer.execute(f"PRAGMA max_page_count = {NO_LIMIT}")


def big(i: int):
    """A row that needs pages of its own."""
    return dataclasses.replace(row(i), route_reason="x" * 20_000)


def test_a_full_disk_keeps_the_rows_it_refuses_and_writes_them_when_there_is_room(tmp_path):
    async def scenario():
        ledger = Ledger(tmp_path / "ledger.sqlite", retry_s=0.05)
        await ledger.record(row(1))
        fill_disk(ledger)
        with pytest.raises(LedgerUnavailable, match="full"):
            await ledger.record(big(2))
        assert "full" in ledger.unavailable
        assert [r.request_id for r in ledger.rows()] == ["req_1"]        # what was committed stays
        free_disk(ledger)
        for _ in range(200):                                            # the writer tries again
            if ledger.unavailable is None:
                break
            await asyncio.sleep(0.02)
        assert ledger.unavailable is None
        await ledger.record(row(3))
        assert [r.request_id for r in ledger.rows()] == ["req_1", "req_2", "req_3"]
        assert ledger.spent("alpha", "2025-06") == pytest.approx(1.5)
        ledger.close()

    asyncio.run(scenario())


def test_the_gateway_refuses_rather_than_answers_unbilled_and_recovers_by_itself(tmp_path, llm, embedder):
    from litestar.testing import TestClient
    gw = make_gateway(tmp_path, llm, embedder)
    ask = {"question": "t5 t6", "max_output_tokens": 2}
    with TestClient(create_app(gw)) as c:
        wait_ready(c)
        answered = [c.post("/v1/ask", json=ask, headers=auth())]
        gw.ledger.retry_s = 0.05
        fill_disk(gw.ledger)
        # Rows go into the last page's free room until it is full (a few dozen of them).
        while answered[-1].status_code == 200 and len(answered) < 200:
            answered.append(c.post("/v1/ask", json=ask, headers=auth()))
        withheld = answered.pop()
        refused = c.post("/v1/ask", json=ask, headers=auth())
        busy = llm.stats()["small"]["running"]
        free_disk(gw.ledger)
        wait_for(lambda: gw.ledger.unavailable is None)
        after = c.post("/v1/ask", json=ask, headers=auth())
    # Generated, but its row could not be written: the answer is withheld, the row kept.
    assert withheld.status_code == 503 and withheld.json()["error"]["code"] == "ledger_unavailable"
    # While the store refuses, nothing more is taken: refused before anything is generated.
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "ledger_unavailable" and busy == 0
    assert refused.headers["retry-after"] and "full" in refused.json()["error"]["message"]
    assert after.status_code == 200 and all(r.status_code == 200 for r in answered)
    rows = gw.ledger.rows()        # every answer's row, and the withheld one's, written when there was room
    assert len(rows) == len(answered) + 2 and {r.status for r in rows} == {"ok"}
    assert rows[-1].request_id == after.json()["id"]
    assert {r.json()["id"] for r in answered} < {r.request_id for r in rows}


def test_postgres_restarted_under_load_loses_no_row(tmp_path):
    pg = server(Postgres)
    url = pg.fresh_database()

    async def scenario():
        ledger = Ledger(url, retry_s=0.1)
        refused = 0

        async def write(i: int) -> None:
            nonlocal refused
            try:
                await ledger.record(row(i))
            except LedgerUnavailable:
                refused += 1

        writers = [asyncio.create_task(write(i)) for i in range(50)]
        await asyncio.gather(*writers)
        restart = asyncio.create_task(asyncio.to_thread(pg.restart))
        i = 50
        while not restart.done():                     # under load while the server restarts
            await write(i)
            i += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*(write(j) for j in range(i, i + 50)))
        for _ in range(300):
            if ledger.unavailable is None:
                break
            await asyncio.sleep(0.02)
        assert ledger.unavailable is None
        ids = {r.request_id for r in ledger.rows()}
        assert ids == {f"req_{j}" for j in range(i + 50)}       # every row, the refused ones too
        assert ledger.spent("alpha", "2025-06") == pytest.approx(0.5 * (i + 50))
        ledger.close()
        return refused

    refused = asyncio.run(scenario())
    assert refused > 0                                # the restart was felt, and recovered from


def test_a_batch_written_again_after_its_acknowledgement_was_lost_is_counted_once(ledger_at):
    """A restarting server can commit a batch and lose the acknowledgement; the ledger keeps
    those rows and writes them again, with whatever arrived meanwhile: the rows already there
    are neither refused nor counted again, the new one is."""
    db = open_database(ledger_at)
    batch = [row(1), row(2), row(3, "beta")]
    db.write(batch)
    db.write(batch)
    db.write([*batch, row(4, "beta")])
    assert sorted(r.request_id for r in db.rows()) == ["req_1", "req_2", "req_3", "req_4"]
    assert db.spent("alpha", "2025-06") == pytest.approx(1.0)
    assert db.spent("beta", "2025-06") == pytest.approx(1.0)
    assert db.usage("alpha", "2025-06")["small"]["requests"] == 2
    assert db.fold(100) == 4                                    # the running totals take each row once
    db.close_writer()
