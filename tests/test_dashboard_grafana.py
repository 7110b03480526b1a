"""deploy/grafana/sluice.json asks only for what the server exports: every metric a query
names is one of GatewayMetrics' families (a histogram's _bucket, _sum or _count), and every
label it groups or filters by is one of that metric's labels."""
from __future__ import annotations

import json
import re
from pathlib import Path

from gateway.metrics import GatewayMetrics, Histogram

BOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "sluice.json"
METRIC = re.compile(r"\bsluice_[a-z0-9_]+\b")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
MATCHER = re.compile(r"\{([^}]*)\}")


def exported() -> dict[str, set[str]]:
    """Each series name the server's /metrics can carry, with its labels."""
    metrics = GatewayMetrics(lambda: {}, lambda: (0, 0), lambda: (0, {}, {}))
    names: dict[str, set[str]] = {}
    for m in metrics.registry.metrics:
        labels = set(m.label_names)
        if isinstance(m, Histogram):
            names |= {f"{m.name}_bucket": labels | {"le"}, f"{m.name}_sum": labels, f"{m.name}_count": labels}
        else:
            names[m.name] = labels
    return names


def queries() -> list[tuple[str, str]]:
    board = json.loads(BOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel["targets"]]


def test_every_query_names_a_metric_the_server_exports():
    names = exported()
    found = queries()
    assert len(found) >= 16
    for title, expr in found:
        used = METRIC.findall(expr)
        assert used, f"{title}: {expr} names no sluice metric"
        for name in used:
            assert name in names, f"{title}: {name} is not exported (have {sorted(names)})"
        labels = set().union(*(names[n] for n in used))
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in labels, f"{title}: grouped by {label!r}, which {used} do not carry"
        for matchers in MATCHER.findall(expr):
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in labels, f"{title}: filtered on {label!r}, which {used} do not carry"


def test_the_board_covers_what_the_issue_asks_for():
    exprs = " ".join(e for _, e in queries())
    for metric in ("sluice_http_requests_total", "sluice_request_seconds_bucket", "sluice_ttft_seconds_bucket",
                   "sluice_queue_depth", "sluice_kv_blocks_free", "sluice_arm_answers_total",
                   "sluice_escalations_total", "sluice_widened_total", "sluice_cost_usd_total"):
        assert metric in exprs, metric
    templating = json.loads(BOARD.read_text())["templating"]["list"]
    assert {v["name"] for v in templating} == {"datasource", "tenant"}
