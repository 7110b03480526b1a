"""The operator's view under a big ledger: what a /dashboard load costs with 1,000,000 rows in
SQLite, and whether reloading it every second moves the serving path's overhead.

1. A ledger of --rows requests spread over the last 30 days (5 tenants, the router's arms,
   escalations, a few errors) is written through the ledger's own write path, in batches of
   500 as group commit makes them under load, each folded into the rollup after its commit.
   What the rollup (gateway/usage/rollup.py) costs the writer is measured on fresh ledgers
   (`--writes-only` runs only this part): per row, the commit a caller waits for (record()
   returns once it is done) at 1 and 64 rows a commit, for a ledger without the rollup, with
   the rollup folded in the same transaction (the former design), and with a fold after
   each commit; the folding transaction's own cost at 1, 64 and 1024 rows a fold; and
   record() itself, one caller at a time, for the three, the writer folding as it does.
2. `sluice serve` (tiny random models, as benchmarks/gateway_bench.py) opens that ledger and
   the page and the JSON summary are loaded --loads times per window, over HTTP with the
   operator key. Baseline: the same month's per-tenant, per-arm totals by a GROUP BY over the
   requests table itself (what the page would cost without the rollup).
3. gateway_bench's /v1/ask load (one client, one output token) runs three times: alone, while
   another client loads /dashboard?window=month every --reload-s seconds, and alone again.

    .venv/bin/python benchmarks/dashboard_bench.py [--rows 1000000] [--loads 20] [--requests 400] [--writes-only]
Prints tables; writes benchmarks/results/dashboard_bench.json (--writes-only: its write-cost
figures, the rest kept). Target: a load <= 300 ms at 1,000,000 rows; serving overhead p50
unchanged (within run-to-run noise) under reloads.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import ROOT, sluice_server
from gateway_bench import run_load, write_setup

sys.path.insert(0, str(ROOT))
from gateway.usage import ledger as sqlite_ledger  # noqa: E402
from gateway.usage.ledger import FOLD_BATCH, Ledger, SqliteDatabase  # noqa: E402
from gateway.usage.rows import UsageRow  # noqa: E402

OPERATOR_KEY = "sk-operator-bench"
TARGET_MS = 300.0
TENANTS = ["acme", "globex", "initech", "umbrella", "hooli"]
DAYS = 30


def synthetic_rows(n: int, now: float, start_id: int = 0, seed: int = 0) -> list[UsageRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(start_id, start_id + n):
        ts = now - rng.random() * DAYS * 86400
        kind = rng.random()
        prompt, completion = rng.randint(200, 1800), rng.randint(10, 200)
        models, arm, escalated = "small", "small", False
        if kind > 0.55:
            models, arm, escalated = "small,large", "small", True
        if kind > 0.75:
            models, arm, escalated = "large", "large@192", False
        if kind > 0.85:
            models, arm = "large", "large"
        if kind > 0.97:
            models, arm = "large", "large+think256"
        status = "error" if rng.random() < 0.005 else "ok"
        rows.append(UsageRow(f"req_{i:09d}", ts, time.strftime("%Y-%m", time.gmtime(ts)), rng.choice(TENANTS), "ask",
                             status, models.split(",")[-1], models, None, prompt, prompt // 4, completion, 0,
                             prompt * 3e-7 + completion * 1.2e-6, 5.0, 1.0, rng.lognormvariate(5, 0.5),
                             rng.lognormvariate(7, 0.5), "bench", None, None, escalated, "stop", arm))
    return rows


def build_ledger(path: Path, rows: int, batch: int = 500) -> dict:
    """The ledger at `path` with `rows` rows (reused when it already has them)."""
    if path.exists():
        with sqlite3.connect(path) as db:
            have = db.execute("SELECT count(*) FROM requests").fetchone()[0]
        if have >= rows:
            return {"rows": have, "reused": True}
        path.unlink()
    db = SqliteDatabase(path)
    now, start, done = time.time(), time.perf_counter(), 0
    while done < rows:
        chunk = synthetic_rows(min(50_000, rows - done), now, done, seed=done)
        for i in range(0, len(chunk), batch):
            db.write(chunk[i:i + batch])
            db.fold(FOLD_BATCH)
        done += len(chunk)
        print(f"  ledger: {done:,} / {rows:,} rows ({time.perf_counter() - start:.0f} s)", flush=True)
    db.close_writer()
    return {"rows": rows, "reused": False, "build_s": round(time.perf_counter() - start, 1)}


def fold_in_commit(db: SqliteDatabase, rows: list[UsageRow]) -> None:
    """The former design, as a baseline (on a ledger `without_rollup`): the rows, their spend
    and their rollup in one transaction."""
    db._writer = db._writer or db._connect()
    with sqlite_ledger._immediate(db._writer):
        for row in rows:
            db._writer.execute(sqlite_ledger.INSERT, dataclasses.astuple(row))
            db._writer.execute(sqlite_ledger.ADD_SPEND, (row.tenant, row.month, row.cost))
        sqlite_ledger._add_to_rollups(db._writer, rows)


def without_rollup(path: Path) -> SqliteDatabase:
    """A ledger as it was before the rollup: no index of unfolded rows to keep, nothing folded,
    and its writer checkpointing the log (SQLite's default threshold) as it commits."""
    db = SqliteDatabase(path)
    with sqlite3.connect(path) as c:
        c.execute("DROP INDEX requests_unrolled")
    db._writer = db._connect()
    return db


def bench_rows(n: int) -> list[UsageRow]:
    """Rows arriving as they do in service (100 a second, so a batch shares its buckets)."""
    now = time.time()
    return [dataclasses.replace(r, ts=now + i / 100) for i, r in enumerate(synthetic_rows(n, now, seed=7))]


def write_cost(folder: Path, n: int = 4000, repeats: int = 5) -> list[dict]:
    """Microseconds per row in the writer thread: the commit a caller waits for, with the
    rollup folded after it, in it, or without a rollup; and a fold after each commit on its own.
    Median of `repeats` runs, the three ledgers taking turns (the machine is shared)."""
    rows = bench_rows(n)
    out = []
    for batch in (1, 64):
        runs: dict[str, list[float]] = {k: [] for k in ("without_rollup", "rollup_in_commit",
                                                        "rollup_after_commit", "fold")}
        for r in range(repeats):
            db = without_rollup(folder / f"none-{batch}-{r}.sqlite")
            start = time.perf_counter()
            for i in range(0, n, batch):
                db.write(rows[i:i + batch])
            runs["without_rollup"].append(time.perf_counter() - start)
            db.close_writer()
            db = without_rollup(folder / f"in-commit-{batch}-{r}.sqlite")
            start = time.perf_counter()
            for i in range(0, n, batch):
                fold_in_commit(db, rows[i:i + batch])
            runs["rollup_in_commit"].append(time.perf_counter() - start)
            db.close_writer()
            db, commit, fold = SqliteDatabase(folder / f"after-{batch}-{r}.sqlite"), 0.0, 0.0
            for i in range(0, n, batch):
                start = time.perf_counter()
                db.write(rows[i:i + batch])
                middle = time.perf_counter()
                assert db.fold(FOLD_BATCH) == len(rows[i:i + batch])
                commit, fold = commit + middle - start, fold + time.perf_counter() - middle
            runs["rollup_after_commit"].append(commit)
            runs["fold"].append(fold)
            db.close_writer()
        out.append({"rows_per_commit": batch, "repeats": repeats,
                    **{k: round(statistics.median(v) / n * 1e6, 1) for k, v in runs.items()}})
    return out


def fold_cost(folder: Path, n: int = 8192) -> list[dict]:
    """Microseconds per row of the folding transaction alone, by how many rows it takes at
    once: one (an idle server), 64 (a group commit), 1024 (the writer catching up after a
    burst: under load it commits first and folds what piled up)."""
    rows = bench_rows(n)
    out = []
    for per_fold in (1, 64, 1024):
        db = SqliteDatabase(folder / f"fold-{per_fold}.sqlite")
        for i in range(0, n, 512):
            db.write(rows[i:i + 512])
        start = time.perf_counter()
        while db.fold(per_fold):
            pass
        out.append({"rows_per_fold": per_fold, "fold": round((time.perf_counter() - start) / n * 1e6, 1)})
        db.close_writer()
    return out


def record_latency(folder: Path, n: int = 1000, gap_s: float = 0.005, repeats: int = 3) -> dict:
    """What Ledger.record() waits for, one caller at a time with `gap_s` between requests (an
    idle server: the previous row's fold is usually done by then): on a ledger without the
    rollup, with the rollup in the commit, and folded after it as the writer does (all rows
    committed since, at most every FOLD_EVERY_S). Medians of `repeats` runs
    taking turns. `over_8ms`: the records that waited for a checkpoint (SQLite copying its log
    into the database, 10 ms and more here; other stalls of the shared machine rarely last 8)."""
    rows = bench_rows(n)
    runs: dict[str, list[tuple[float, float, int]]] = {"without_rollup": [], "rollup_in_commit": [],
                                                       "fold_after_commit": []}
    for r in range(repeats):
        for label in runs:
            ledger = Ledger(folder / f"record-{label}-{r}.sqlite")
            if label != "fold_after_commit":
                db = ledger.db = without_rollup(ledger.db.path)
                db.fold = lambda limit: 0
                if label == "rollup_in_commit":
                    db.write = lambda rows, db=db: fold_in_commit(db, rows)

            async def run() -> list[float]:
                times = []
                for row in rows:
                    start = time.perf_counter()
                    await ledger.record(row)
                    times.append((time.perf_counter() - start) * 1e6)
                    await asyncio.sleep(gap_s)
                return times
            times = asyncio.run(run())[10:]        # past the writer's start and first connection
            ledger.close()
            runs[label].append((percentile(times, 50), percentile(times, 99), sum(t > 8000 for t in times)))
    keys = ("p50_us", "p99_us", "over_8ms")
    return {"requests": n, "gap_ms": gap_s * 1000, "repeats": repeats,
            **{label: {key: statistics.median(r[i] for r in v) for i, key in enumerate(keys)}
               for label, v in runs.items()}}


def group_by_baseline(path: Path, repeats: int = 3) -> float:
    """The month's totals per tenant, arm and outcome straight from `requests` (no rollup)."""
    db = sqlite3.connect(path)
    since = time.time() - DAYS * 86400
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        db.execute("SELECT tenant, coalesce(arm, model), status, count(*), sum(prompt_tokens), sum(cached_tokens), "
                   "sum(completion_tokens), sum(cost), sum(escalated) FROM requests WHERE ts >= ? "
                   "GROUP BY 1, 2, 3", (since,)).fetchall()
        times.append((time.perf_counter() - start) * 1000)
    db.close()
    return round(sorted(times)[len(times) // 2], 1)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 1)


def page_loads(url: str, loads: int) -> list[dict]:
    out = []
    with httpx.Client(base_url=url, auth=("operator", OPERATOR_KEY), timeout=60) as c:
        for path in ("/dashboard", "/v1/admin/summary"):
            for window in ("hour", "day", "month"):
                for _ in range(3):                                    # warm: connection, page cache
                    assert c.get(f"{path}?window={window}").status_code == 200
                times = []
                for _ in range(loads):
                    start = time.perf_counter()
                    r = c.get(f"{path}?window={window}")
                    times.append((time.perf_counter() - start) * 1000)
                    assert r.status_code == 200, r.text[:300]
                out.append({"path": path, "window": window, "loads": loads, "bytes": len(r.content),
                            "p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
                            "max_ms": round(max(times), 1)})
    return out


class Reloader:
    """Loads /dashboard?window=month every `period` seconds in a thread of its own."""

    def __init__(self, url: str, period: float):
        self.url, self.period, self.times = url, period, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, auth=("operator", OPERATOR_KEY), timeout=60) as c:
            while not self.stop.is_set():
                start = time.perf_counter()
                assert c.get("/dashboard?window=month").status_code == 200
                self.times.append((time.perf_counter() - start) * 1000)
                self.stop.wait(max(0.0, self.period - (time.perf_counter() - start)))

    def __enter__(self) -> Reloader:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ledger", default=str(Path(tempfile.gettempdir()) / "sluice-dashboard-bench.sqlite"),
                        help="kept between runs: building a million rows takes minutes")
    parser.add_argument("--loads", type=int, default=20, help="timed loads per page and window")
    parser.add_argument("--requests", type=int, default=400, help="/v1/ask requests per serving run")
    parser.add_argument("--reload-s", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dashboard_bench.json"))
    parser.add_argument("--writes-only", action="store_true", help="only the rollup's cost to the ledger's writer")
    args = parser.parse_args()
    out = Path(args.out)

    print("the rollup's cost to the ledger's writer ...")
    with tempfile.TemporaryDirectory() as tmp:
        writes = {"write_us_per_row": write_cost(Path(tmp)), "fold_us_per_row": fold_cost(Path(tmp)),
                  "record_us": record_latency(Path(tmp))}
    print_writes(writes)
    if args.writes_only:
        results = json.loads(out.read_text()) if out.exists() else {"benchmark": "dashboard"}
        results.update(writes, writes_machine=machine_now(), writes_when=now_utc())
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out} (write costs only)")
        return 0

    ledger = Path(args.ledger)
    print(f"building a {args.rows:,}-row ledger at {ledger} ...")
    built = build_ledger(ledger, args.rows)
    baseline_ms = group_by_baseline(ledger)
    with tempfile.TemporaryDirectory() as tmp:
        setup = write_setup(Path(tmp), "NORMAL")
        config = Path(tmp) / "server.toml"
        config.write_text(f'ledger = "sqlite:///{ledger.resolve()}"\n'
                          f'operator_key_sha256 = ["{hashlib.sha256(OPERATOR_KEY.encode()).hexdigest()}"]\n'
                          + config.read_text())
        with sluice_server(setup, Path(tmp) / "server.log", {"OMP_NUM_THREADS": "1"}, timeout=180) as server:
            loads = page_loads(server.url, args.loads)
            host, port = server.url.removeprefix("http://").split(":")
            serving = []
            for label in ("alone", "reloading", "alone again"):
                if label == "reloading":
                    with Reloader(server.url, args.reload_s) as reloader:
                        result = asyncio.run(run_load(host, int(port), 1, args.requests))
                    result["reloads"] = len(reloader.times)
                    result["reload_p50_ms"] = percentile(reloader.times, 50)
                else:
                    result = asyncio.run(run_load(host, int(port), 1, args.requests))
                serving.append({"run": label, **result})

    print(f"\nledger: {built['rows']:,} rows over {DAYS} days, {len(TENANTS)} tenants")
    print(f"baseline: the month's totals by GROUP BY over requests: {baseline_ms} ms\n")
    print(f"{'page':<18} {'window':<6} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} {'KB':>6} {'vs GROUP BY':>11}  "
          f"target <= {TARGET_MS:.0f} ms")
    for r in loads:
        print(f"{r['path']:<18} {r['window']:<6} {r['p50_ms']:>7} {r['p95_ms']:>7} {r['max_ms']:>7} "
              f"{r['bytes'] / 1024:>6.0f} {r['p50_ms'] / baseline_ms:>10.2f}x  "
              f"{'met' if r['p95_ms'] <= TARGET_MS else 'MISSED'}")
    print(f"\n/v1/ask overhead, 1 client, {args.requests} requests per run; reloading: /dashboard?window=month every "
          f"{args.reload_s} s")
    print(f"{'run':<12} {'overhead p50':>12} {'p99':>7} {'vs alone':>8} {'reloads':>8} {'reload p50 ms':>13}")
    first = serving[0]["overhead_ms"]["p50"]
    for r in serving:
        print(f"{r['run']:<12} {r['overhead_ms']['p50']:>12.2f} {r['overhead_ms']['p99']:>7.2f} "
              f"{r['overhead_ms']['p50'] / first:>7.2f}x {r.get('reloads', ''):>8} {r.get('reload_p50_ms', ''):>13}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "dashboard", "target_ms": TARGET_MS, "ledger": built, "days": DAYS, "tenants": len(TENANTS),
        **writes, "group_by_baseline_ms": baseline_ms, "page_loads": loads, "serving": serving,
        "machine": machine_now(), "when": now_utc()}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def print_writes(writes: dict) -> None:
    print("\nledger writer, us per row; 'caller waits' is the commit record() returns after")
    print(f"{'rows/commit':>11} {'no rollup':>10} {'in commit':>10} {'caller waits':>13} {'vs no rollup':>12} "
          f"{'vs in commit':>12} {'a fold each':>11}")
    for w in writes["write_us_per_row"]:
        after = w["rollup_after_commit"]
        print(f"{w['rows_per_commit']:>11} {w['without_rollup']:>10} {w['rollup_in_commit']:>10} {after:>13} "
              f"{after / w['without_rollup']:>11.2f}x {after / w['rollup_in_commit']:>11.2f}x {w['fold']:>11}")
    print("folding transaction alone, us per row: " + ", ".join(
        f"{f['fold']} at {f['rows_per_fold']} a fold" for f in writes["fold_us_per_row"]))
    r = writes["record_us"]
    print(f"record(), one caller, {r['gap_ms']:.0f} ms apart, {r['requests']} rows, us:")
    base = r["without_rollup"]["p50_us"]
    for label in ("without_rollup", "rollup_in_commit", "fold_after_commit"):
        p50, p99 = r[label]["p50_us"], r[label]["p99_us"]
        print(f"  {label:<18} p50 {p50:>7} ({p50 / base:.2f}x)  p99 {p99:>7}  over 8 ms {r[label]['over_8ms']:>3}")


def machine_now() -> dict:
    return {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version()}


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


if __name__ == "__main__":
    sys.exit(main())
