"""The answer cache on a replay of SQuAD traffic: hit rate, hit and miss latency, dollars saved,
and that no answer is served from before a re-ingest or from another tenant.

2,000 requests over 500 distinct SQuAD questions (dev half: every question of randomly drawn
paragraphs, so several about each passage), repeats Zipf-distributed (s=1.1) over a shuffled
order, in the gateway itself (`Gateway.ask`: limits, the cache, retrieval, the engine, the
ledger row; HTTP auth and parsing are not in the times). Of the requests, 15% are
tenant beta's (its own collection of the same paragraphs; exact hits only), the rest alpha's
(near duplicates on, the default similarity); 15% of alpha's are reworded as people repeat a
question ("Can you tell me ...", "..., please?", an embedded question, a contraction, no
articles) and 10% differ only in case, spacing and the question mark. Halfway, alpha
re-ingests the paragraph of its most asked question (one sentence added): its collection's
revision changes, so every answer from before must be made again.

Every hit names the request that made its answer (its route reason); the replay checks that
that request was the same tenant's, asked the same SQuAD question, and (for alpha after the
re-ingest) came after the re-ingest. The baseline is the same replay by a tenant with the cache
off, in the same run: latency and dollars as ratios.

The misses' engine: `--model tiny` (default) two random-weight Qwen2 models with a word-level
tokenizer (tests/conftest.py), so a miss costs retrieval and a few milliseconds of engine and
its token counts are about the words of the prompt; `--model smollm2` SmolLM2-135M (the
`smollm2-135m` store model) answering at most --max-tokens tokens. Dollars are at the default
prices (pipeline/prices.py), the small model's.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/answer_cache.py [--model tiny|smollm2]
Prints a table; writes benchmarks/results/answer_cache[-smollm2].json.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

from answer_cache_guard import REWORDINGS, SQUAD
from common import ROOT, machine, percentile, write_results
from tqdm import tqdm

from pipeline import CacheTerms, Query
from retrieval import Document

TENANTS = {"alpha": "near", "beta": "exact", "plain": "off"}
FRAMING = ["polite", "please", "embedded", "contraction", "no_articles"]
ORIGIN = re.compile(r"first answered as (req_[0-9a-f]+)")


def tenant_file(name: str, cache: str, output: int) -> str:
    key = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
    table = "" if cache == "off" else \
        f"[answer_cache]\nenabled = true\nnear_duplicates = {str(cache == 'near').lower()}\n"
    return f"""api_key_sha256 = ["{key}"]
allowed_models = ["small"]
default_model = "small"
context_budget = 400
output_budget = {output}
passage_selection = false
prefix_cache_salt = "salt-{name}-bench"
[limits]
requests_per_minute = 100000000
tokens_per_minute = 100000000
monthly_spend_cap_usd = 1000000.0
{table}"""


def squad(path: Path) -> list[tuple[str, str, str, list[str]]]:
    """(paragraph id, title, text, questions) per paragraph."""
    data = json.loads(path.read_text())["data"]
    return [(f"{a['title']}-{i}", a["title"].replace("_", " "), p["context"],
             [qa["question"].strip() for qa in p["qas"]]) for a in data for i, p in enumerate(a["paragraphs"])]


def workload(paras, n_requests: int, distinct: int, zipf: float, beta: float, reworded: float, normalized: float,
             seed: int) -> tuple[list[tuple[str, int]], list[dict]]:
    """The distinct questions (text, paragraph index) and the requests, in order."""
    rng = random.Random(seed)
    # Whole paragraphs' questions, paragraphs in random order: several questions about each
    # passage, as a help centre's are (and as near duplicates must tell apart).
    seen, questions = set(), []
    for i in rng.sample(range(len(paras)), len(paras)):
        for q in paras[i][3]:
            if q.casefold() not in seen and len(questions) < distinct:
                seen.add(q.casefold())
                questions.append((q, i))
    rng.shuffle(questions)
    weights = [1 / (rank + 1) ** zipf for rank in range(distinct)]
    requests = []
    for base in rng.choices(range(distinct), weights, k=n_requests):
        q = questions[base][0]
        tenant = "beta" if rng.random() < beta else "alpha"
        kind, r = "same", rng.random()
        if tenant == "alpha" and r < reworded:
            made = [(k, REWORDINGS[k](q)) for k in FRAMING]
            made = [(k, t) for k, t in made if t is not None and t != q]
            if made:
                kind, q = rng.choice(made)
        elif r < reworded + normalized:
            kind, q = "case and spacing", "  ".join(q.rstrip("?").lower().split(" "))
        requests.append({"base": base, "tenant": tenant, "question": q, "kind": kind})
    return questions, requests


async def replay(args) -> dict:
    from engine.config import EngineConfig, ModelEntry
    from engine.llm_engine import LLMEngine
    from gateway.config import ServerConfig
    from gateway.service import Gateway
    from gateway.tenants import TenantRegistry
    from pipeline import default_prices
    from retrieval import Embedder

    paras = squad(args.squad)
    questions, requests = workload(paras, args.requests, args.distinct, args.zipf, args.beta, args.reworded,
                                   args.normalized, args.seed)
    folder = Path(tempfile.mkdtemp(prefix="sluice-answer-cache-"))
    if args.model == "tiny":
        from tests.conftest import make_tiny_model
        model = ModelEntry(str(make_tiny_model(folder / "small", "qwen2", seed=1)))
    else:
        model = ModelEntry("smollm2-135m")
    engine = EngineConfig(models={"small": model}, memory_budget_gb=2.0, max_kv_blocks=4096)
    config = ServerConfig(engine=engine, prices={"small": default_prices()["small"]}, tenant_reload_interval_s=60)
    (folder / "tenants").mkdir()
    for name, cache in TENANTS.items():
        (folder / "tenants" / f"{name}.toml").write_text(tenant_file(name, cache, args.max_tokens))
    registry = TenantRegistry(folder / "tenants", {"small"})
    gw = Gateway(config, registry, folder / "data", engine=LLMEngine(engine, progress=False),
                 embedder=Embedder(device="cpu"))
    await gw.start()
    await gw.wait_ready()
    used = sorted({i for _, i in questions})
    docs = [Document(paras[i][0], paras[i][2], paras[i][1]) for i in used]
    for name in TENANTS:
        for i in range(0, len(docs), 64):
            await gw.ingest(registry.get(name), "squad", docs[i:i + 64])
    counts = Counter(r["base"] for r in requests[:args.requests // 2] if r["tenant"] == "alpha")
    changed_para = questions[counts.most_common(1)[0][0]][1]
    changed = Document(paras[changed_para][0], paras[changed_para][2] + " This paragraph was revised.",
                       paras[changed_para][1])

    for q, _ in questions[:20]:           # warm-up: the engine's and the embedder's first calls
        await gw.ask(registry.get("plain"), Query(f"Warm up: {q}", endpoint="eval", collection="squad",
                                                  max_output_tokens=args.max_tokens))
    # The cached replay and the baseline (cache off) interleaved, request by request, so both
    # run on the same machine at the same moments.
    out: dict = {"cached": [], "baseline": []}
    made = {}                             # request id -> (tenant, base question, request index)
    for n, r in enumerate(tqdm(requests, unit="req")):
        if n == len(requests) // 2:
            for name in ("alpha", "plain"):
                await gw.ingest(registry.get(name), "squad", [changed])
        for mode, tenant in (("cached", registry.get(r["tenant"])), ("baseline", registry.get("plain"))):
            start = time.perf_counter()
            meta, done = await gw.ask(tenant, Query(r["question"], endpoint="eval", collection="squad",
                                                    max_output_tokens=args.max_tokens))
            took = time.perf_counter() - start
            match = None
            if meta.cache == "hit":
                match = "near" if "a near duplicate" in meta.decision.reason else "exact"
            else:
                made[done.request_id] = (tenant.id, r["base"], n)
            origin = ORIGIN.search(meta.decision.reason)
            out[mode].append({**r, "n": n, "ms": took * 1000, "cache": meta.cache, "match": match, "cost": done.cost,
                              "origin": made.get(origin[1]) if origin else None})
    saved_metric = sum(gw.metrics.answer_cache_saved.values.values())
    stats = gw.pipeline.cache.stats()
    await gw.stop()
    return {"questions": len(questions), "paragraphs": len(used), "changed_paragraph": paras[changed_para][0],
            "records": out, "saved_metric": saved_metric, "store": stats}


def summarize(args, run: dict) -> dict:
    cached, base = run["records"]["cached"], run["records"]["baseline"]
    half = len(cached) // 2
    hits = [r for r in cached if r["cache"] == "hit"]
    exact = [r["ms"] for r in hits if r["match"] == "exact"]
    near = [r["ms"] for r in hits if r["match"] == "near"]
    misses = [r["ms"] for r in cached if r["cache"] != "hit"]
    # Every hit is checked against the request that made its answer.
    unknown = [r for r in hits if r["origin"] is None]
    other_tenant = [r for r in hits if r["origin"] and r["origin"][0] != r["tenant"]]
    other_question = [r for r in hits if r["origin"] and r["origin"][1] != r["base"]]
    stale = [r for r in hits if r["tenant"] == "alpha" and r["n"] >= half and r["origin"] and r["origin"][2] < half]
    by_kind = {}
    for kind in sorted({r["kind"] for r in cached}):
        rs = [r for r in cached if r["kind"] == kind]
        by_kind[kind] = {"requests": len(rs), "hits": sum(r["cache"] == "hit" for r in rs),
                         "near_hits": sum(r["match"] == "near" for r in rs)}
    dollars = sum(r["cost"] for r in cached)
    baseline = sum(r["cost"] for r in base)
    q = lambda xs: {"n": len(xs), "p50_ms": round(percentile(xs, 0.5), 3) if xs else None,
                    "p99_ms": round(percentile(xs, 0.99), 3) if xs else None}
    return {
        "machine": machine(), "model": args.model, "max_tokens": args.max_tokens,
        "settings": {"requests": args.requests, "distinct": args.distinct, "zipf": args.zipf, "beta": args.beta,
                     "reworded": args.reworded, "normalized": args.normalized, "seed": args.seed,
                     "default_similarity": CacheTerms().similarity},
        "questions": run["questions"], "paragraphs": run["paragraphs"], "re_ingested": run["changed_paragraph"],
        "hit_rate": round(len(hits) / len(cached), 4),
        "hit_rate_by_tenant": {t: round(sum(r["cache"] == "hit" for r in cached if r["tenant"] == t) /
                                        max(1, sum(r["tenant"] == t for r in cached)), 4) for t in ("alpha", "beta")},
        "hit_rate_first_half": round(sum(r["cache"] == "hit" for r in cached[:half]) / half, 4),
        "hit_rate_second_half": round(sum(r["cache"] == "hit" for r in cached[half:]) / (len(cached) - half), 4),
        "by_kind": by_kind,
        "latency": {"exact_hit": q(exact), "near_hit": q(near), "miss": q(misses),
                    "baseline": q([r["ms"] for r in base])},
        "dollars": {"cached_run": round(dollars, 6), "baseline_run": round(baseline, 6),
                    "saved": round(baseline - dollars, 6), "saved_metric": round(run["saved_metric"], 6),
                    "ratio": round(dollars / baseline, 4) if baseline else None},
        "checks": {"hits": len(hits), "origin_unknown": len(unknown), "from_another_tenant": len(other_tenant),
                   "of_another_question": len(other_question), "from_before_the_re_ingest": len(stale),
                   "alpha_hits_after_re_ingest": sum(r["tenant"] == "alpha" and r["n"] >= half for r in hits)},
        "store": run["store"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--squad", type=Path, default=SQUAD)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--distinct", type=int, default=500)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--beta", type=float, default=0.15)
    ap.add_argument("--reworded", type=float, default=0.15)
    ap.add_argument("--normalized", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(2)
    result = summarize(args, asyncio.run(replay(args)))
    lat, d, c = result["latency"], result["dollars"], result["checks"]
    print(f"\n{'':<12}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'p50 / baseline':>16}")
    for name in ("exact_hit", "near_hit", "miss", "baseline"):
        x = lat[name]
        ratio = f"{x['p50_ms'] / lat['baseline']['p50_ms']:.3f}" if x["n"] else "-"
        print(f"{name:<12}{x['n']:>6}{x['p50_ms'] or 0:>10.2f}{x['p99_ms'] or 0:>10.2f}{ratio:>16}")
    print(f"\nhit rate {result['hit_rate']:.1%} (first half {result['hit_rate_first_half']:.1%}, second "
          f"{result['hit_rate_second_half']:.1%}); by kind: " +
          ", ".join(f"{k} {v['hits']}/{v['requests']}" for k, v in result["by_kind"].items()))
    print(f"dollars: {d['cached_run']:.6f} cached against {d['baseline_run']:.6f} uncached ({d['ratio']}x); "
          f"saved {d['saved']:.6f}")
    print(f"checks over {c['hits']} hits: from another tenant {c['from_another_tenant']}, of another question "
          f"{c['of_another_question']}, from before the re-ingest {c['from_before_the_re_ingest']}, origin unknown "
          f"{c['origin_unknown']}")
    name = "answer_cache.json" if args.model == "tiny" else f"answer_cache-{args.model}.json"
    write_results(args.out or ROOT / "benchmarks" / "results" / name, result)


if __name__ == "__main__":
    main()
