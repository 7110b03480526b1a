"""The operator's figures: `GET /v1/admin/summary`, and what /dashboard (dashboard.py) draws.

Behind an operator key from the server config (`operator_key_sha256`), never a tenant's: no
key or an unknown one is a 401, a tenant's key a 403. Keys travel as `Authorization: Bearer`
or, so that a browser can open the page, as HTTP Basic's password (any user name).

Everything windowed is read from the ledger's running totals (gateway/usage/rollup.py): a
bounded number of rows however large the ledger. What is "now" (the queue, KV blocks, the
prefix cache) and the refusals that never reached the ledger come from this process, as
/metrics reads them.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

import anyio
from litestar import Request, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter

from gateway.errors import ErrorBody, GatewayError
from gateway.http import schemas as s
from gateway.usage.limits import month_of
from gateway.usage.rollup import Totals, percentile
from pipeline.prices import cost

# window -> (seconds it spans, the rollup buckets it reads, seconds a chart point spans)
WINDOWS = {"hour": (3600, 60, 60), "day": (86400, 3600, 3600), "month": (30 * 86400, 86400, 86400)}
FUTURE_SLACK_S = 60          # clocks disagree a little; an `end` further ahead is refused
SAVINGS_METHOD = ("Estimated, not measured: each request's tokens per engine call (a request the cascade answered "
                  "twice counts once: its tokens over its calls) priced at the large model's prices, against what "
                  "the requests were billed. The large model alone would have written answers of its own length; "
                  "the estimate assumes the same.")
LATENCY_METHOD = ("From the ledger, arrival to first token (TTFT) and to last token (total), per request; percentiles "
                  "read from histogram bins 25% wide (within 12% of the exact value).")
RESPONSES = {
    401: "No key, a malformed Authorization header, or a key that is not an operator key "
         "(`WWW-Authenticate`); also every key where the server config has no `operator_key_sha256`.",
    403: "A tenant's API key: the operator's view is never open to a tenant.",
    404: "`tenant` names no loaded tenant.",
    422: "`window` is not hour, day or month, or `end` is not an ISO 8601 time, or is in the future "
         "(`param` names it).",
}


def operator_key(authorization: str | None) -> str | None:
    """The key in a Bearer header, or the password of a Basic one."""
    scheme, _, value = (authorization or "").partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value, validate=True).decode().partition(":")[2] or None
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def require_operator(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """A guard: the operator's key passes; a tenant's is a 403; anything else a 401."""
    gateway = connection.app.state.gateway
    challenge = {"WWW-Authenticate": handler.opt.get("challenge", 'Bearer realm="sluice operator"')}
    key = operator_key(connection.headers.get("authorization"))
    if key is None:
        raise GatewayError(401, "missing operator key: send 'Authorization: Bearer <operator key>'",
                           code="missing_api_key", headers=challenge)
    digest = hashlib.sha256(key.encode()).digest()
    found = False
    for known in gateway.config.operator_key_sha256:      # every one compared: timing tells nothing
        found |= hmac.compare_digest(bytes.fromhex(known), digest)
    if found:
        return
    if gateway.tenants.authenticate(key) is not None:
        raise GatewayError(403, "a tenant's API key does not open the operator's view; use the operator key",
                           code="not_operator")
    raise GatewayError(401, "unknown operator key" if gateway.config.operator_key_sha256 else
                       "this server has no operator key (operator_key_sha256 in the server config)",
                       code="invalid_api_key", headers=challenge)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def window_bounds(window: str, end: str | None, now: float) -> tuple[int, int, int, int]:
    """(start, end, rollup grain, chart step): whole chart points, the last one holding `end`
    (default: now)."""
    if window not in WINDOWS:
        raise GatewayError(422, f"query parameter 'window': expected one of {', '.join(WINDOWS)}, got {window!r}",
                           "window", "invalid_field")
    t = now
    if end is not None:
        try:
            at = datetime.fromisoformat(end.replace("Z", "+00:00"))
        except ValueError:
            raise GatewayError(422, f"query parameter 'end': expected an ISO 8601 time such as "
                                    f"2026-01-31T12:00:00Z, got {end!r}", "end", "invalid_field") from None
        t = (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()
        if t > now + FUTURE_SLACK_S:
            raise GatewayError(422, f"query parameter 'end': {end} is in the future (the server's time is "
                                    f"{_iso(now)}); a window must have happened", "end", "in_future")
    span, grain, step = WINDOWS[window]
    stop = (int(t) // step + 1) * step
    return stop - span, stop, grain, step


class _Sums:
    """Rollup totals (one tenant's, or every tenant's) added up."""

    def __init__(self):
        self.outcomes: dict[str, int] = defaultdict(int)
        self.arms: dict[str, int] = defaultdict(int)
        self.n = defaultdict(float)

    def add(self, r: Totals) -> None:
        self.outcomes[r.status] += r.requests
        self.arms[r.arm] += r.requests
        for f in ("requests", "escalated", "widened", "cache_hits", "prompt_tokens", "cached_tokens",
                  "completion_tokens", "thinking_tokens", "cost"):
            self.n[f] += getattr(r, f)
        if r.status != "error":         # an engine failure is not billed, and would not have been
            for f in ("call_prompt", "call_cached", "call_output"):
                self.n[f] += getattr(r, f)


def _figures(tenant: str, x: _Sums, large_price, refused: dict[str, int], month_spend: float,
             cap: float | None) -> s.TenantFigures:
    n = x.n
    alone = cost(large_price, n["call_prompt"], n["call_cached"], n["call_output"])
    return s.TenantFigures(
        tenant, int(n["requests"]), x.outcomes.get("ok", 0), dict(sorted(x.outcomes.items())), refused,
        round(n["cost"], 6), round(alone, 6), round(alone - n["cost"], 6), round(month_spend, 6), cap,
        s.Tokens(int(n["prompt_tokens"]), int(n["cached_tokens"]), int(n["completion_tokens"]),
                 int(n["thinking_tokens"])),
        dict(sorted(x.arms.items())), int(n["escalated"]), int(n["widened"]), int(n["cache_hits"]))


def large_model(config) -> str:
    """The dearest model by output price: the cascade's large one (service.pipeline_for)."""
    return max(config.engine.models, key=lambda m: config.prices[m].output)


@dataclass
class ProcessState:
    """What this process knows now, taken on the event loop that changes it."""
    refused: dict[tuple[str, str, str], float]        # sluice_http_requests_total's values
    engine: dict[str, dict]
    queue: s.QueueState

    @classmethod
    def of(cls, gateway) -> ProcessState:
        return cls(dict(gateway.metrics.http.values), gateway.engine.stats() if gateway.engine is not None else {},
                   s.QueueState(gateway.admission.running, gateway.admission.waiting))


async def summary_of(gateway, window: str, end: str | None, tenant: str | None) -> s.AdminSummary:
    """The ledger is read, and the figures added up, in a worker thread: the event loop serving
    answers waits for neither."""
    now = time.time()
    bounds = window_bounds(window, end, now)
    if tenant is not None and gateway.tenants.get(tenant) is None:
        raise GatewayError(404, f"query parameter 'tenant': no tenant {tenant!r} is loaded", "tenant",
                           "tenant_not_found")
    state = ProcessState.of(gateway)
    return await anyio.to_thread.run_sync(summarize, gateway, window, bounds, tenant, state, now)


def summarize(gateway, window: str, bounds: tuple[int, int, int], tenant: str | None, state: ProcessState,
              now: float) -> s.AdminSummary:
    start, stop, grain, step = bounds
    ledger, config = gateway.ledger, gateway.config
    big = large_model(config)
    price = config.prices[big]
    per_tenant: dict[str, _Sums] = defaultdict(_Sums)
    everyone = _Sums()
    for r in ledger.totals(grain, start, stop):
        if tenant is None or r.tenant == tenant:
            per_tenant[r.tenant].add(r)
            everyone.add(r)
    loaded = gateway.tenants.tenants
    names = [tenant] if tenant else sorted(set(loaded) | set(per_tenant))
    refused: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (_, code, who), n in state.refused.items():
        if int(code) >= 400:
            refused[who][code] += int(n)
    spend = ledger.month_spend(month_of(now))
    cap = lambda t: loaded[t].spec.limits.monthly_spend_cap_usd if t in loaded else None
    tenants = [_figures(t, per_tenant[t], price, dict(sorted(refused[t].items())), spend.get(t, 0.0), cap(t))
               for t in names]
    all_refused: dict[str, int] = defaultdict(int)
    for t in names:
        for code, n in refused[t].items():
            all_refused[code] += n
    caps = [f.spend_cap for f in tenants]
    totals = _figures("*", everyone, price, dict(sorted(all_refused.items())), sum(f.month_spend for f in tenants),
                      None if None in caps else sum(caps))

    hist: dict[int, dict[str, dict[int, int]]] = defaultdict(lambda: {"ttft": defaultdict(int),
                                                                     "total": defaultdict(int)})
    overall = {"ttft": defaultdict(int), "total": defaultdict(int)}
    for t, kind, b, n in ledger.series("latency", grain, start, stop, step, tenant):
        hist[t][kind][b] += n
        overall[kind][b] += n
    points = {r[0]: r[1:] for r in ledger.series("series", grain, start, stop, step, tenant)}
    pct = lambda counts: s.Percentiles(*(percentile(counts, q) for q in (50, 95, 99)))
    series = []
    for t in range(start, stop, step):
        requests, ok, billed, *per_call = points.get(t, (0, 0, 0.0, 0.0, 0.0, 0.0))
        h = hist.get(t)
        series.append(s.SeriesPoint(
            t, requests, requests - ok, round(billed, 6), round(cost(price, *per_call), 6),
            percentile(h["ttft"], 50) if h else None, percentile(h["total"], 50) if h else None,
            percentile(h["total"], 95) if h else None))

    arms = [s.ArmShare(a, n, round(n / max(1, totals.requests), 4)) for a, n in
            sorted(totals.arms.items(), key=lambda kv: -kv[1])]
    saved_share = round(totals.saved / totals.large_alone_cost, 4) if totals.large_alone_cost else None
    models = [s.ModelState(m, st["running"], st["waiting"], st["kv_blocks_total"] - st["kv_blocks_free"],
                           st["kv_blocks_total"],
                           round(1 - st["kv_blocks_free"] / st["kv_blocks_total"], 4)
                           if st["kv_blocks_total"] else None,
                           round(st["prefix_cache_hits"] / st["prefix_cache_queries"], 4)
                           if st["prefix_cache_queries"] else None)
              for m, st in sorted(state.engine.items())]
    return s.AdminSummary(
        window, _iso(start), _iso(stop), step, tenant, totals, tenants, arms,
        s.Savings(totals.cost, totals.large_alone_cost, totals.saved, saved_share, big, SAVINGS_METHOD),
        s.LatencyFigures(pct(overall["ttft"]), pct(overall["total"]), LATENCY_METHOD),
        state.queue, models, series)


WindowParam = Annotated[str, Parameter(description="hour, day or month (30 days), ending at `end`")]
EndParam = Annotated[str | None, Parameter(description="ISO 8601 time the window ends (default: now; never later)")]
TenantParam = Annotated[str | None, Parameter(description="one tenant's figures (default: every tenant's)")]


@get("/v1/admin/summary", summary="The operator's figures for a window: per tenant, routing, savings, latency",
     guards=[require_operator], security=[{"operator": []}],
     responses={code: ResponseSpec(ErrorBody, description=text, generate_examples=False)
                for code, text in RESPONSES.items()})
async def admin_summary(request: Request, window: WindowParam = "day", end: EndParam = None,
                        tenant: TenantParam = None) -> s.AdminSummary:
    return await summary_of(request.app.state.gateway, window, end, tenant)
