"""The operator's view: /v1/admin/summary and /dashboard behind the operator key, their
figures against a seeded ledger worked out by hand, refusals naming the parameter, and the
ledger's running totals (rollup) on SQLite and PostgreSQL, backfilled for an older ledger."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import sqlite3
import time

import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from gateway.usage.ledger import Ledger
from gateway.usage.rollup import KEY, SUMS, bin_ms, fold, latency_bin
from gateway.usage.rows import CACHE_HIT, UsageRow
from pipeline.prices import cost
from tests.services import ledger_at  # noqa: F401
from tests.test_gateway_support import KEYS, PRICES, auth, embedder, llm, make_gateway, wait_for, wait_ready  # noqa: F401

OPERATOR_KEY = "sk-operator-test"
OPERATOR = {"operator_key_sha256": [hashlib.sha256(OPERATOR_KEY.encode()).hexdigest()]}


def operator(basic: bool = False) -> dict[str, str]:
    if basic:
        return {"Authorization": "Basic " + base64.b64encode(f"ops:{OPERATOR_KEY}".encode()).decode()}
    return {"Authorization": f"Bearer {OPERATOR_KEY}"}


def usage_row(i: int, tenant: str, ago: float, *, models: str = "small", arm: str | None = "small",
              status: str = "ok", escalated: bool = False, prompt: int = 100, cached: int = 0, completion: int = 10,
              thinking: int = 0, ttft: float | None = 20.0, total: float = 200.0, now: float | None = None) -> UsageRow:
    """A ledger row billed as the gateway bills it: each call's tokens at its model's price."""
    calls = models.split(",")
    n = len(calls)
    billed = 0.0 if status == "error" else sum(cost(PRICES[m], prompt // n, cached // n, completion // n)
                                               for m in calls)
    ts = (now or time.time()) - ago
    return UsageRow(f"req_{tenant}_{i}", ts, time.strftime("%Y-%m", time.gmtime(ts)), tenant, "ask", status,
                    calls[-1], models, None, prompt, cached, completion, thinking, billed, 1.0, 0.5, ttft, total,
                    "seeded", None, None, escalated, "length", arm)


def seed(now: float) -> list[UsageRow]:
    """alpha: 4 answered by small, 2 escalated small->large, 1 widened large@192->large, 1
    engine error; beta: 2 answered by large, 1 cancelled; and an alpha row 2 hours ago (outside
    the last hour, inside the last day)."""
    rows = [usage_row(i, "alpha", 60 + i, total=100.0 * (i + 1), now=now) for i in range(4)]
    rows += [usage_row(4 + i, "alpha", 300, models="small,large", arm="small", escalated=True, prompt=200,
                       completion=20, total=1500.0, now=now) for i in range(2)]
    rows.append(usage_row(6, "alpha", 400, models="large,large", arm="large@192", escalated=True, prompt=300,
                          completion=20, total=2500.0, now=now))
    rows.append(usage_row(7, "alpha", 500, status="error", ttft=None, now=now))
    rows += [usage_row(i, "beta", 120, models="large", arm="large", cached=40, completion=30, now=now)
             for i in range(2)]
    rows.append(usage_row(2, "beta", 130, models="large", arm="large+think256", status="cancelled", completion=6,
                          thinking=4, now=now))
    rows.append(usage_row(99, "alpha", 7200, now=now))
    return rows


@pytest.fixture
def seeded(tmp_path, llm, embedder):
    gw = make_gateway(tmp_path, llm, embedder, **OPERATOR)
    now = time.time()
    rows = seed(now)
    gw.ledger.db.write(rows)
    gw.ledger.db.fold(len(rows))
    with TestClient(create_app(gw)) as client:
        wait_ready(client)
        yield client, rows, now


def large_alone(rows: list[UsageRow]) -> float:
    """The estimate the page states, worked out row by row: each row's tokens per call at large's prices."""
    out = 0.0
    for r in rows:
        if r.status != "error":
            n = len(r.models.split(","))
            out += cost(PRICES["large"], r.prompt_tokens / n, r.cached_tokens / n, r.completion_tokens / n)
    return out


def test_the_summary_adds_up_the_ledger_of_the_window(seeded):
    client, rows, now = seeded
    body = client.get("/v1/admin/summary?window=hour", headers=operator()).json()
    recent = [r for r in rows if r.ts > now - 3600]
    alpha = next(t for t in body["tenants"] if t["tenant"] == "alpha")
    beta = next(t for t in body["tenants"] if t["tenant"] == "beta")
    assert alpha["requests"] == 8 and alpha["answers"] == 7 and alpha["outcomes"] == {"error": 1, "ok": 7}
    assert beta["requests"] == 3 and beta["outcomes"] == {"cancelled": 1, "ok": 2}
    assert alpha["escalations"] == 2 and alpha["widenings"] == 1
    assert alpha["arms"] == {"large@192": 1, "small": 7}
    assert beta["arms"] == {"large": 2, "large+think256": 1}
    assert alpha["tokens"] == {"prompt": 4 * 100 + 2 * 200 + 300 + 100, "cached": 0,
                               "completion": 4 * 10 + 2 * 20 + 20 + 10, "thinking": 0}
    assert beta["tokens"]["thinking"] == 4 and beta["tokens"]["cached"] == 80
    for figures, tenant in ((alpha, "alpha"), (beta, "beta")):
        mine = [r for r in recent if r.tenant == tenant]
        assert figures["cost"] == pytest.approx(sum(r.cost for r in mine), rel=1e-9)
        assert figures["large_alone_cost"] == pytest.approx(large_alone(mine), rel=1e-9)
        assert figures["saved"] == pytest.approx(large_alone(mine) - sum(r.cost for r in mine), rel=1e-9)
        assert figures["month_spend"] == pytest.approx(sum(r.cost for r in rows if r.tenant == tenant
                                                           and r.month == time.strftime("%Y-%m", time.gmtime(now))))
        assert figures["spend_cap"] == 1000.0
    # beta was answered by the large model alone: nothing saved. alpha's small answers saved.
    assert beta["saved"] == pytest.approx(0.0, abs=1e-12) and alpha["saved"] > 0
    t = body["totals"]
    assert t["requests"] == 11 and t["cost"] == pytest.approx(sum(r.cost for r in recent))
    assert body["savings"]["large_model"] == "large"
    assert body["savings"]["saved_share"] == pytest.approx(1 - t["cost"] / t["large_alone_cost"], abs=1e-4)
    assert "large model's prices" in body["savings"]["method"]
    assert {a["arm"]: a["requests"] for a in body["arms"]} == {"small": 7, "large": 2, "large@192": 1,
                                                               "large+think256": 1}
    # Latency: percentiles of the histogram, within a bin (25%) of the exact ones.
    totals = sorted(r.total_ms for r in recent)
    assert body["latency"]["total_ms"]["p50"] == pytest.approx(totals[len(totals) // 2], rel=0.25)
    assert body["latency"]["total_ms"]["p99"] == pytest.approx(bin_ms(latency_bin(2500.0)), abs=0.1)
    assert body["latency"]["ttft_ms"]["p50"] == pytest.approx(20.0, rel=0.13)
    # The series: 60 minute buckets that add up to the totals.
    series = body["series"]
    assert len(series) == 60 and body["bucket_s"] == 60
    assert sum(p["requests"] for p in series) == 11 and sum(p["errors"] for p in series) == 2
    assert sum(p["cost"] for p in series) == pytest.approx(t["cost"])
    # The day holds the row from two hours ago too; one tenant's view holds only its own.
    day = client.get("/v1/admin/summary?window=day", headers=operator()).json()
    assert day["totals"]["requests"] == 12 and len(day["series"]) == 24
    month = client.get("/v1/admin/summary?window=month", headers=operator()).json()
    assert month["totals"] == day["totals"] and len(month["series"]) == 30 and month["bucket_s"] == 86400
    only = client.get("/v1/admin/summary?window=day&tenant=beta", headers=operator()).json()
    assert [f["tenant"] for f in only["tenants"]] == ["beta"] and only["totals"]["requests"] == 3
    # A past window: ending three hours ago, the last hour held nothing.
    past = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 3 * 3600))
    assert client.get(f"/v1/admin/summary?window=hour&end={past}", headers=operator()).json()["totals"][
        "requests"] == 0
    assert [m["model"] for m in body["models"]] == ["large", "small"]
    assert all(m["kv_blocks_total"] > 0 for m in body["models"])


def test_refusals_that_never_reached_the_ledger_are_counted_by_code(seeded):
    client, _, _ = seeded
    assert client.post("/v1/ask", json={"question": "t1", "max_output_tokens": 10_000}, headers=auth()).status_code \
        == 422
    alpha = next(t for t in client.get("/v1/admin/summary", headers=operator()).json()["tenants"]
                 if t["tenant"] == "alpha")
    assert alpha["refused"] == {"422": 1}


@pytest.mark.parametrize("path", ["/v1/admin/summary", "/dashboard"])
def test_only_the_operator_key_opens_the_view(seeded, path):
    client, _, _ = seeded
    missing = client.get(path)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"].startswith("Basic" if path == "/dashboard" else "Bearer")
    assert client.get(path, headers={"Authorization": "Bearer sk-nobody"}).status_code == 401
    for tenant in KEYS:
        refused = client.get(path, headers=auth(tenant))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_operator"
    assert client.get(path, headers=operator()).status_code == 200
    assert client.get(path, headers=operator(basic=True)).status_code == 200


def test_a_server_without_an_operator_key_opens_the_view_to_nobody(tmp_path, llm, embedder):
    with TestClient(create_app(make_gateway(tmp_path, llm, embedder))) as client:
        r = client.get("/v1/admin/summary", headers=operator())
        assert r.status_code == 401 and "operator_key_sha256" in r.json()["error"]["message"]
        assert client.get("/dashboard", headers=auth()).status_code == 403


@pytest.mark.parametrize("query, status, param", [
    ("window=week", 422, "window"),
    ("window=hour&end=2999-01-01T00:00:00Z", 422, "end"),
    ("window=day&end=yesterday", 422, "end"),
    ("tenant=nobody", 404, "tenant"),
])
@pytest.mark.parametrize("path", ["/v1/admin/summary", "/dashboard"])
def test_bad_input_is_a_4xx_naming_the_parameter(seeded, path, query, status, param):
    client, _, _ = seeded
    r = client.get(f"{path}?{query}", headers=operator())
    assert r.status_code == status and r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"]


def test_the_page_shows_the_figures_and_never_a_key(seeded):
    client, rows, now = seeded
    r = client.get("/dashboard?window=hour", headers=operator())
    assert r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page = r.text
    summary = client.get("/v1/admin/summary?window=hour", headers=operator()).json()
    assert 'data-key="alpha"' in page and 'data-key="large@192"' in page
    assert f"${summary['savings']['saved']:,.4f}" in page and "<script" not in page
    assert page.count('class="chart"') == 3 and 'data-points="60"' in page
    for secret in [OPERATOR_KEY, *KEYS.values(), OPERATOR["operator_key_sha256"][0],
                   *(hashlib.sha256(k.encode()).hexdigest() for k in KEYS.values())]:
        assert secret not in page and secret not in str(summary)


def test_the_summary_is_in_the_openapi_schema(seeded):
    client, _, _ = seeded
    schema = client.get("/schema/openapi.json").json()
    op = schema["paths"]["/v1/admin/summary"]["get"]
    assert sorted(op["responses"]) == ["200", "401", "403", "404", "422"]
    assert op["security"] == [{"operator": []}]
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AdminSummary"}
    assert "/dashboard" not in schema["paths"]


def test_the_rollup_matches_its_rows_on_every_database(ledger_at):
    now = time.time()
    rows = seed(now)
    ledger = Ledger(ledger_at)
    for batch in (rows[:5], rows[5:]):    # a second batch adds to the same buckets
        ledger.db.write(batch)
        ledger.db.fold(len(batch))
    start = int(now // 3600) * 3600 - 3 * 3600
    by_tenant: dict[str, list] = {}
    for r in ledger.totals(3600, start, start + 5 * 3600):
        by_tenant.setdefault(r.tenant, []).append(r)
    for tenant in ("alpha", "beta"):
        mine = [r for r in rows if r.tenant == tenant]
        assert sum(r.requests for r in by_tenant[tenant]) == len(mine)
        assert sum(r.cost for r in by_tenant[tenant]) == pytest.approx(sum(r.cost for r in mine))
        assert sum(r.completion_tokens for r in by_tenant[tenant]) == sum(r.completion_tokens for r in mine)
    minute = int(now // 60) * 60
    assert sum(r.requests for r in ledger.totals(60, minute - 3600, minute + 60)) == len(rows) - 1   # not 2 h ago
    # Chart points of 10 minutes from minute buckets: requests, answered, billed.
    points = ledger.series("series", 60, minute - 3600, minute + 60, 600, None)
    assert all(t % 600 == 0 for t, *_ in points)
    assert sum(p[1] for p in points) == len(rows) - 1 and sum(p[2] for p in points) == len(rows) - 3
    assert sum(p[3] for p in points) == pytest.approx(sum(r.cost for r in rows if r.ts > now - 3600))
    hist = ledger.series("latency", 3600, start, start + 5 * 3600, 3600, "beta")
    assert sum(n for _, kind, _, n in hist if kind == "total") == 3
    assert ledger.month_spend(rows[0].month)["beta"] == pytest.approx(sum(r.cost for r in rows if r.tenant == "beta"))
    ledger.close()


def test_an_older_ledger_gets_its_rollup_from_its_rows(tmp_path):
    path = tmp_path / "ledger.sqlite"
    now = time.time()
    rows = seed(now)
    Ledger(path).db.write(rows)
    with sqlite3.connect(path) as db:                   # as a ledger written before the rollup was
        db.execute("DROP TABLE rollup")
        db.execute("DROP TABLE latency")
    again = Ledger(path)
    start = int(now // 3600) * 3600 - 3 * 3600
    assert sum(r.requests for r in again.totals(3600, start, start + 5 * 3600)) == len(rows)
    assert len(again.rows()) == len(rows)
    Ledger(path)                                        # opened again: nothing is added twice
    assert sum(r.requests for r in again.totals(3600, start, start + 5 * 3600)) == len(rows)


def test_an_answer_through_the_gateway_reaches_the_summary(seeded):
    client, _, _ = seeded
    totals = lambda: client.get("/v1/admin/summary?window=hour", headers=operator()).json()["totals"]
    before = totals()
    answer = client.post("/v1/ask", json={"question": "t1 t2", "mode": "small", "max_output_tokens": 4},
                         headers=auth("beta")).json()
    wait_for(lambda: totals()["requests"] > before["requests"])      # folded after the answer, not before
    after = totals()
    assert after["requests"] == before["requests"] + 1
    assert after["cost"] == pytest.approx(before["cost"] + answer["cost"])
    assert after["tokens"]["completion"] == before["tokens"]["completion"] + 4
    # /metrics counts the arm as the rollup does (not routed by arms: the answering model).
    assert 'sluice_arm_answers_total{tenant="beta",arm="small"} 1' in client.get("/metrics").text


def test_answer_cache_hits_are_counted_from_their_ledger_rows():
    """A hit's row (models = CACHE_HIT, no tokens) counts as a request and as a cache hit."""
    hit = UsageRow("r1", 1_700_000_000.0, "2023-11", "alpha", "ask", "ok", "large", CACHE_HIT, "docs",
                   0, 0, 0, 0, 0.0, 1.0, 0.0, 2.0, 2.0, "cache", None, None, False, "stop", "large")
    miss = dataclasses.replace(hit, request_id="r2", models="large", prompt_tokens=100, completion_tokens=10)
    sums = [row[len(KEY):] for row in fold([hit, miss])[0] if row[0] == 60]
    assert sum(v[SUMS.index("requests")] for v in sums) == 2
    assert sum(v[SUMS.index("cache_hits")] for v in sums) == 1

