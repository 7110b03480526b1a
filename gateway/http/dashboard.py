"""GET /dashboard: the operator's figures (admin.py) as one HTML page, charts drawn as SVG on
the server. No script, no font or file from elsewhere: it works with no internet, and its
Content-Security-Policy forbids loading anything at all."""
from __future__ import annotations

from datetime import UTC, datetime
from html import escape

import anyio
from litestar import Request, Response, get

from gateway.http import schemas as s
from gateway.http.admin import EndParam, TenantParam, WindowParam, require_operator, summary_of

HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:",
           "Cache-Control": "no-store", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}
WIDTH, HEIGHT, PAD = 560, 170, 44
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#111;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
nav a{margin-right:12px} nav a.on{font-weight:bold;text-decoration:none;color:#111}
table{border-collapse:collapse;background:#fff;margin-bottom:8px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right;white-space:nowrap} th{background:#f0f0f0}
td:first-child,th:first-child{text-align:left}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{background:#fff;border:1px solid #ddd;padding:8px 14px}
.card b{display:block;font-size:22px} .note{color:#555;max-width:900px}
.charts{display:flex;gap:12px;flex-wrap:wrap} svg{background:#fff;border:1px solid #ddd}
svg text{font:11px system-ui,sans-serif;fill:#333}
"""


def _usd(x: float | None) -> str:
    return "–" if x is None else f"${x:,.4f}" if abs(x) < 1 else f"${x:,.2f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}"


def _table(name: str, head: list[str], rows: list[list], keys: list[str] | None = None) -> str:
    """`keys`: each row's data-key, so a test (or a script) can find a row by what it is."""
    out = [f'<table id="{name}"><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        key = f' data-key="{escape(keys[i])}"' if keys else ""
        out.append(f"<tr{key}>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>")
    return "".join(out) + "</table>"


def chart(name: str, title: str, times: list[int], lines: list[tuple[str, list[float | None]]], unit: str) -> str:
    """A line chart: one polyline per series over the buckets, a gap where a value is None."""
    values = [v for _, vs in lines for v in vs if v is not None]
    top = max(values, default=0) or 1
    span = max(1, len(times) - 1)
    x = lambda i: PAD + i * (WIDTH - PAD - 10) / span
    y = lambda v: HEIGHT - 24 - v / top * (HEIGHT - 48)
    parts = [f'<svg id="chart-{name}" class="chart" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="{escape(title)}" data-points="{len(times)}" data-max="{top:g}">',
             f'<text x="{PAD}" y="14">{escape(title)} ({escape(unit)})</text>',
             f'<line x1="{PAD}" y1="{y(0):.1f}" x2="{WIDTH - 10}" y2="{y(0):.1f}" stroke="#999"/>',
             f'<line x1="{PAD}" y1="{y(top):.1f}" x2="{PAD}" y2="{y(0):.1f}" stroke="#999"/>',
             f'<text x="4" y="{y(top) + 4:.1f}">{top:.3g}</text><text x="4" y="{y(0):.1f}">0</text>']
    if times:
        clock = lambda t: datetime.fromtimestamp(t, UTC).strftime("%m-%d %H:%M")
        parts.append(f'<text x="{PAD}" y="{HEIGHT - 6}">{clock(times[0])}</text>'
                     f'<text x="{WIDTH - 10}" y="{HEIGHT - 6}" text-anchor="end">{clock(times[-1])} UTC</text>')
    for (label, vs), color in zip(lines, COLORS):
        runs, run = [], []
        for i, v in enumerate(vs):
            if v is None:
                runs, run = runs + [run] if run else runs, []
            else:
                run.append(f"{x(i):.1f},{y(v):.1f}")
        runs += [run] if run else []
        for r in runs:
            if len(r) == 1:
                cx, cy = r[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
            else:
                parts.append(f'<polyline class="series" data-series="{escape(label)}" fill="none" '
                             f'stroke="{color}" stroke-width="1.5" points="{" ".join(r)}"/>')
    legend = "".join(f'<tspan fill="{c}" dx="10">■ {escape(label)}</tspan>' for (label, _), c in zip(lines, COLORS))
    parts.append(f'<text x="{WIDTH - 10}" y="14" text-anchor="end">{legend}</text></svg>')
    return "".join(parts)


def render(x: s.AdminSummary) -> str:
    t, sv = x.totals, x.savings
    link = lambda w: (f'<a href="?window={w}{"&amp;tenant=" + escape(x.tenant) if x.tenant else ""}"'
                      f'{" class=on" if w == x.window else ""}>last {w}</a>')
    cards = [("requests", f"{t.requests:,}"), ("answers", f"{t.answers:,}"), ("spend", _usd(t.cost)),
             ("large model alone", _usd(sv.large_alone_cost)),
             ("saved", f"{_usd(sv.saved)} ({_pct(sv.saved_share)})"),
             ("escalations", f"{t.escalations:,}"), ("widenings", f"{t.widenings:,}"),
             ("answer-cache hits", f"{t.cache_hits:,}")]
    tenants = _table("tenants", ["tenant", "requests", "answers", "errors by outcome", "refused by code (since start)",
                                 "spend", "large alone", "saved", "month spend / cap", "tokens in (cached)",
                                 "tokens out (thinking)", "escalations", "widenings", "cache hits"],
                     [[f.tenant, f"{f.requests:,}", f"{f.answers:,}",
                       " ".join(f"{k} {v}" for k, v in f.outcomes.items() if k != "ok") or "0",
                       " ".join(f"{k}: {v}" for k, v in f.refused.items()) or "0",
                       _usd(f.cost), _usd(f.large_alone_cost), _usd(f.saved),
                       f"{_usd(f.month_spend)} / {_usd(f.spend_cap)}"
                       + (f" ({_pct(f.month_spend / f.spend_cap)})" if f.spend_cap else ""),
                       f"{f.tokens.prompt:,} ({f.tokens.cached:,})", f"{f.tokens.completion:,} ({f.tokens.thinking:,})",
                       f"{f.escalations:,}", f"{f.widenings:,}", f"{f.cache_hits:,}"] for f in x.tenants],
                     [f.tenant for f in x.tenants])
    arms = _table("arms", ["arm", "requests", "share"], [[a.arm, f"{a.requests:,}", _pct(a.share)] for a in x.arms],
                  [a.arm for a in x.arms])
    lat = x.latency
    latency = _table("latency", ["ms", "p50", "p95", "p99"],
                     [["time to first token", _ms(lat.ttft_ms.p50), _ms(lat.ttft_ms.p95), _ms(lat.ttft_ms.p99)],
                      ["total", _ms(lat.total_ms.p50), _ms(lat.total_ms.p95), _ms(lat.total_ms.p99)]],
                     ["ttft", "total"])
    engine = _table("engine", ["model", "running", "waiting", "KV blocks used", "KV use", "prefix-cache hits"],
                    [[m.model, m.running, m.waiting, f"{m.kv_blocks_used:,} / {m.kv_blocks_total:,}",
                      _pct(m.kv_used_share), _pct(m.prefix_cache_hit_share)] for m in x.models],
                    [m.model for m in x.models])
    times = [p.start for p in x.series]
    charts = [chart("requests", "requests", times, [("requests", [p.requests for p in x.series]),
                                                    ("errors", [p.errors for p in x.series])], "per bucket"),
              chart("spend", "spend", times, [("billed", [p.cost for p in x.series]),
                                              ("large alone", [p.large_alone_cost for p in x.series])], "$"),
              chart("latency", "latency", times, [("total p50", [p.total_p50_ms for p in x.series]),
                                                  ("total p95", [p.total_p95_ms for p in x.series]),
                                                  ("TTFT p50", [p.ttft_p50_ms for p in x.series])], "ms")]
    scope = f"tenant {escape(x.tenant)}" if x.tenant else "all tenants"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sluice operator view</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head><body>
<h1>Sluice: the operator's view</h1>
<p class="note" id="window" data-window="{x.window}" data-start="{x.start}" data-end="{x.end}">{scope},
{x.start} to {x.end} (buckets of {x.bucket_s} s). <nav>{"".join(link(w) for w in ("hour", "day", "month"))}</nav></p>
<div class="cards" id="cards">{"".join(f'<div class="card" data-key="{escape(k)}">{escape(k)}<b>{escape(v)}</b></div>'
                                       for k, v in cards)}</div>
<h2>Tenants</h2>{tenants}
<h2>How answers were made</h2>{arms}
<h2>Dollars saved</h2><p class="note" id="savings-method">Against the large model ({escape(sv.large_model)}):
{escape(sv.method)}</p>
<h2>Over time</h2><div class="charts">{"".join(charts)}</div>
<h2>Latency</h2>{latency}<p class="note">{escape(lat.method)}</p>
<h2>Engine now</h2>{engine}<p class="note">Queue: {x.queue.inflight} holding an engine slot, {x.queue.queued} waiting.
Prefix-cache hits: full KV blocks found cached over those looked up, since the process started.</p>
</body></html>"""


@get("/dashboard", guards=[require_operator], include_in_schema=False,
     opt={"challenge": 'Basic realm="sluice operator"'})
async def dashboard(request: Request, window: WindowParam = "day", end: EndParam = None,
                    tenant: TenantParam = None) -> Response[str]:
    summary = await summary_of(request.app.state.gateway, window, end, tenant)
    page = await anyio.to_thread.run_sync(render, summary)
    return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)
