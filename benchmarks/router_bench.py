"""What routing adds to a request: the difficulty classifier plus the policy, per question,
against the policy alone (classifier off), and for a router with arms the arm model plus
its policy (router.policy.route_arms). The question's embedding and retrieval scores are
computed beforehand, as the gateway has them from retrieval when it routes; the classifier
runs on the policy's worker thread under its time limit, as in service.

    python benchmarks/router_bench.py --router RUN/router.joblib --labels RUN

Prints a table and writes benchmarks/results/router_bench.json. Target: classifier plus
policy at most 2 ms p50.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from common import RESULTS, machine, percentile
from rich.console import Console
from rich.table import Table

from retrieval import Embedder
from router.data import read_labels
from router.model import RouterModel
from router.policy import Policy, route, route_arms

console = Console()


def timings(policy: Policy, calls, arms=None) -> list[float]:
    out = []
    for predict in calls:
        start = time.perf_counter()
        if arms is None:
            route(policy, "small", "large", predict)
        else:
            route_arms(policy, arms, "small", "large", predict, lambda arm: 0.0)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", required=True, help="a trained router (sluice train-router RUN)")
    ap.add_argument("--labels", required=True, help="a run folder or labels.jsonl: the questions to route")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--out", default=str(RESULTS / "router_bench.json"))
    args = ap.parse_args()
    router = RouterModel.load(args.router)
    labels = read_labels(args.labels)
    vectors = Embedder().encode([l.question for l in labels])
    inputs = [(l.question, v, l.retrieval_scores) for l, v in zip(labels, vectors)]
    predicts = [lambda q=q, v=v, s=s: router.classifier.predict(q, v, s) for q, v, s in inputs]
    calls = [predicts[i % len(predicts)] for i in range(args.requests)]
    base = Policy("small", ("small", "large"), {"easy": 0, "medium": 256, "hard": 1024}, 0.5,
                  classifier_timeout_s=0.05)
    off = replace(base, classifier=False)
    timings(base, calls[:200])                        # warm up: first sklearn calls, the thread pool
    rows = {"policy alone (classifier off)": timings(off, calls), "classifier + policy": timings(base, calls)}
    if router.arms is not None:
        arm_calls = [lambda q=q, v=v, s=s: router.arms.predict(q, v, s) for q, v, s in inputs]
        arm_calls = [arm_calls[i % len(arm_calls)] for i in range(args.requests)]
        timings(base, arm_calls[:200], router.arms.arms)
        rows[f"arms ({len(router.arms.arms)}) + policy"] = timings(base, arm_calls, router.arms.arms)
    result = {"machine": machine(), "requests": args.requests, "questions": len(labels), "target_p50_ms": 2.0,
              "rows": {k: {"p50_ms": round(percentile(v, 0.5), 4), "p99_ms": round(percentile(v, 0.99), 4)}
                       for k, v in rows.items()}}
    table = Table(title=f"Router overhead per request ({args.requests} requests over {len(labels)} questions)")
    for col in ("", "p50 ms", "p99 ms"):
        table.add_column(col)
    for k, v in result["rows"].items():
        table.add_row(k, f"{v['p50_ms']:.3f}", f"{v['p99_ms']:.3f}")
    console.print(table)
    for k in [k for k in result["rows"] if k != "policy alone (classifier off)"]:
        added = result["rows"][k]["p50_ms"]
        console.print(f"{k} p50 {added:.3f} ms: target 2 ms {'met' if added <= 2 else 'missed'}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
