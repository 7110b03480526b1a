"""/dashboard in a real browser: Debian's headless Chromium, driven by Playwright, opens the page
of a live server over a seeded ledger with the operator key (HTTP Basic, as a person would
type it), and finds the tables and charts with the summary's figures and no console error.

It needs the `chromium` package (`make browser` installs it). Without it the test skips here,
and fails in CI (CI=true), where a skip would hide a build that lost its browser. The page's
screenshot is written to SLUICE_DASHBOARD_SCREENSHOT when set (docs/dashboard.png is made so)."""
from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.test_dashboard import OPERATOR, OPERATOR_KEY, operator, seed, usage_row
from tests.test_gateway_support import Server, embedder, llm, make_gateway  # noqa: F401

CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def browser_or_skip():
    """Playwright's sync API and the browser, or a skip that CI turns into a failure."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package is not installed (pip install -e '.[dev]')"
    if missing is None and not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        missing = f"no Chromium at {CHROMIUM} (make browser installs Debian's chromium)"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the browser test to run: {missing}")
        pytest.skip(missing)
    return sync_playwright


def traffic(now: float, n: int = 3000, seed_: int = 0) -> list:
    """A day of made-up traffic for the charts: busier in the afternoon, some escalations."""
    rng = random.Random(seed_)
    rows = []
    for i in range(n):
        ago = rng.uniform(3700, 86_000)
        hour = time.gmtime(now - ago).tm_hour
        if rng.random() > 0.4 + 0.6 * abs(12 - hour) / 12:
            continue
        tenant = rng.choice(["acme", "acme", "globex", "initech"])
        kind = rng.random()
        if kind < 0.55:
            rows.append(usage_row(1000 + i, tenant, ago, prompt=rng.randint(300, 900), completion=rng.randint(20, 80),
                                  total=rng.lognormvariate(6.5, 0.4), ttft=rng.lognormvariate(4.5, 0.4), now=now))
        elif kind < 0.75:
            rows.append(usage_row(1000 + i, tenant, ago, models="small,large", escalated=True,
                                  prompt=2 * rng.randint(300, 900), completion=2 * rng.randint(20, 80),
                                  total=rng.lognormvariate(7.3, 0.4), ttft=rng.lognormvariate(6.8, 0.3), now=now))
        elif kind < 0.85:
            rows.append(usage_row(1000 + i, tenant, ago, models="large", arm="large@192", prompt=rng.randint(150, 192),
                                  completion=rng.randint(20, 80), total=rng.lognormvariate(6.9, 0.4),
                                  ttft=rng.lognormvariate(4.9, 0.3), now=now))
        else:
            rows.append(usage_row(1000 + i, tenant, ago, models="large", arm="large", prompt=rng.randint(300, 900),
                                  completion=rng.randint(20, 80), total=rng.lognormvariate(7.0, 0.4),
                                  status="timeout" if rng.random() < 0.03 else "ok",
                                  ttft=rng.lognormvariate(5.2, 0.3), now=now))
    return rows


def test_the_page_in_chromium_shows_the_figures_without_console_errors(tmp_path, llm, embedder):
    sync_playwright = browser_or_skip()
    tenants = {name: f'api_key_sha256 = ["{i:064x}"]\nallowed_models = ["small", "large"]\ndefault_model = "small"\n'
               f'context_budget = 400\noutput_budget = 32\nprefix_cache_salt = "salt-{name}"\n[limits]\n'
               f'requests_per_minute = 100\ntokens_per_minute = 100000\nmonthly_spend_cap_usd = {cap}\n'
               for i, (name, cap) in enumerate([("alpha", 50.0), ("beta", 20.0), ("acme", 5000.0),
                                                ("globex", 2000.0), ("initech", 1500.0)], start=1)}
    gw = make_gateway(tmp_path, llm, embedder, tenants, **OPERATOR)
    now = time.time()
    rows = seed(now) + traffic(now)
    gw.ledger.db.write(rows)
    gw.ledger.db.fold(len(rows))
    errors: list[str] = []
    with Server(gw) as server, sync_playwright() as p:
        summary = httpx.get(f"{server.url}/v1/admin/summary?window=hour", headers=operator()).json()
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=ARGS,
            http_credentials={"username": "operator", "password": OPERATOR_KEY},
            viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            response = page.goto(f"{server.url}/dashboard?window=hour")
            assert response.status == 200
            assert page.title() == "Sluice operator view"
            # The tenants table: one row per tenant, the summary's figures in its cells.
            for figures in summary["tenants"]:
                cells = page.locator(f'#tenants tr[data-key="{figures["tenant"]}"] td').all_inner_texts()
                assert cells[0] == figures["tenant"]
                assert cells[1] == f"{figures['requests']:,}" and cells[2] == f"{figures['answers']:,}"
                assert cells[5] == (f"${figures['cost']:,.4f}" if figures["cost"] < 1 else f"${figures['cost']:,.2f}")
            alpha = page.locator('#tenants tr[data-key="alpha"] td').all_inner_texts()
            assert alpha[1] == "8" and alpha[3] == "error 1" and alpha[12] == "1"      # 8 requests, 1 widened
            arms = {row.get_attribute("data-key"): row.locator("td").all_inner_texts()[1]
                    for row in page.locator("#arms tr[data-key]").all()}
            assert arms == {a["arm"]: f"{a['requests']:,}" for a in summary["arms"]}
            saved = page.locator('#cards [data-key="saved"] b').inner_text()
            assert saved.startswith(f"${summary['savings']['saved']:,.4f}")
            assert "large model's prices" in page.locator("#savings-method").inner_text()
            # Three charts, drawn and visible, one point per minute of the hour.
            for name in ("requests", "spend", "latency"):
                svg = page.locator(f"#chart-{name}")
                assert svg.is_visible() and svg.get_attribute("data-points") == "60"
                assert svg.locator("polyline, circle").count() >= 1
                box = svg.bounding_box()
                assert box["width"] > 400 and box["height"] > 100
            assert page.locator("#latency tr[data-key=total] td").all_inner_texts()[1] == \
                f"{summary['latency']['total_ms']['p50']:,.1f}"
            # The day, with its traffic, is what the docs show.
            page.goto(f"{server.url}/dashboard?window=day")
            assert page.locator("#chart-requests polyline").count() >= 1
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            if os.environ.get("SLUICE_DASHBOARD_SCREENSHOT"):
                shutil.copy(tmp_path / "dashboard.png", os.environ["SLUICE_DASHBOARD_SCREENSHOT"])
        finally:
            context.close()
    assert errors == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
