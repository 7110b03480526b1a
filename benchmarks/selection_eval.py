"""Arms of eval runs side by side, each against the others on the questions both answered:
quality, dollars, and the paired difference with its standard error. For passage selection
(issue 36): the same questions answered at one context budget with `--selection` and at
another without, e.g.

    python benchmarks/selection_eval.py \\
        "large@256, selection=.cache/evals/sq500-sel-256:large" \\
        "large@512=.cache/evals/sq500-whole-512:large" \\
        "small@256, selection=.cache/evals/sq500-sel-256:small" \\
        "small@512=.cache/evals/sq500-whole-512:small" \\
        --pairs "large@256, selection/large@512" "small@256, selection/small@512"

An arm is LABEL=RUN_FOLDER:MODE. Each pair A/B gives A's F1 as a share of B's, with a bootstrap
95% interval over the questions, A's dollars as a share of B's, and the paired F1 gain. Prints a
table and writes benchmarks/results/selection_eval.json and a quality-cost plot beside it.

`--presence` also rebuilds the context each arm's model read (retrieval's rag_context over the
run's own collection, at its budget, with its selection, counted by the model's tokenizer: the
pipeline's composition) and asks whether a gold answer is inside it: per arm the share, and F1
with the answer there and without; per pair, of the questions only B answered right, how many
A's context missed the answer (retrieval or selection lost it) and how many A misread.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

import numpy as np
from common import RESULTS
from rich.console import Console
from rich.table import Table

from evals.datasets import load
from evals.records import Record, RecordLog
from evals.runner import COLLECTION, TENANT, RunConfig

console = Console(width=160)


def arm(spec: str) -> tuple[str, Path, str]:
    label, sep, where = spec.partition("=")
    folder, colon, mode = where.rpartition(":")
    if not (sep and colon and label and mode):
        raise SystemExit(f"arm {spec!r}: expected LABEL=RUN_FOLDER:MODE")
    return label, Path(folder), mode


def summary(records: list[Record]) -> dict:
    return {"questions": len(records),
            "f1": statistics.fmean(r.score for r in records),
            "em": statistics.fmean(r.em for r in records),
            "dollars_per_1k": 1000 * statistics.fmean(r.cost for r in records),
            "prompt_tokens": statistics.fmean(r.tokens("prompt") for r in records),
            "cached_tokens": statistics.fmean(r.tokens("cached") for r in records),
            "engine_s": statistics.fmean(r.engine_s for r in records)}


def compare(a: list[Record], b: list[Record], seed: int = 0) -> dict:
    """a and b over the same questions in the same order."""
    fa, fb = np.array([r.score for r in a]), np.array([r.score for r in b])
    ca, cb = np.array([r.cost for r in a]), np.array([r.cost for r in b])
    diff = fa - fb
    idx = np.random.default_rng(seed).integers(0, len(a), (2000, len(a)))
    ratios = fa[idx].mean(1) / np.maximum(fb[idx].mean(1), 1e-12)
    return {"questions": len(a), "f1_share": fa.mean() / fb.mean(),
            "f1_share_95": [float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))],
            "dollar_share": ca.mean() / cb.mean(), "f1_gain": diff.mean(),
            "f1_gain_se": diff.std(ddof=1) / np.sqrt(len(a)),
            "a_only_correct": int(sum(x.correct and not y.correct for x, y in zip(a, b))),
            "b_only_correct": int(sum(y.correct and not x.correct for x, y in zip(a, b)))}


def presence(folder: Path, mode: str, ids: frozenset[str]) -> dict[str, bool]:
    """Question id -> whether one of its gold answers is inside the context `mode` read."""
    import msgspec

    from models.store import resolve
    config = msgspec.json.decode((folder / "run.json").read_bytes(), type=RunConfig)
    model = resolve(config.models[mode], progress=False)
    # Once per run and tokenizer: a run's two models read one context when they share a
    # tokenizer, and this is the slow part (a search per question).
    key = (folder, hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest(), ids)
    if key not in _PRESENCE:
        _PRESENCE[key] = _presence(folder, config, model, ids)
    return _PRESENCE[key]


_PRESENCE: dict[tuple, dict[str, bool]] = {}


def _presence(folder: Path, config: RunConfig, model: Path, ids: frozenset[str]) -> dict[str, bool]:
    from engine.tokenizer import Tokenizer
    from retrieval import CollectionStore, Embedder, Selector, rag_context
    examples = [e for e in load(config.dataset, [Path(f) for f in config.files], config.n, config.seed, config.split,
                                config.mix).examples if e.id in ids and e.retrieve]
    store = CollectionStore(folder / "collections", Embedder())
    collection = store.collection(TENANT, COLLECTION, create=False)
    tokenizer = Tokenizer(model)
    selector = Selector(top=config.k) if config.selection else None
    out = {}
    for e in examples:
        context = rag_context(collection, e.question, config.context_budget, tokenizer, config.k, selector=selector)
        out[e.id] = any(a.strip() in context.messages[0]["content"] for a in e.answers)
    store.close()
    return out


def presence_split(records: list[Record], there: dict[str, bool]) -> dict:
    have = [r for r in records if r.id in there]
    inside = [r for r in have if there[r.id]]
    missing = [r for r in have if not there[r.id]]
    f1 = lambda rs: statistics.fmean(r.score for r in rs) if rs else None
    return {"questions": len(have), "answer_in_context": len(inside) / max(len(have), 1),
            "f1_answer_in": f1(inside), "f1_answer_out": f1(missing),
            "wrong_with_answer_in": sum(not r.correct for r in inside)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arms", nargs="+", metavar="LABEL=RUN_FOLDER:MODE")
    ap.add_argument("--pairs", nargs="*", default=[], metavar="A/B", help="arm labels to compare, A against B")
    ap.add_argument("--presence", action="store_true",
                    help="also whether a gold answer is inside the context each arm read (rebuilt, no model)")
    ap.add_argument("--out", type=Path, default=RESULTS / "selection_eval.json")
    args = ap.parse_args()
    records: dict[str, dict[str, Record]] = {}
    runs = {}
    for spec in args.arms:
        label, folder, mode = arm(spec)
        if not (folder / "records.jsonl").exists():
            raise SystemExit(f"arm {label!r}: {folder} has no records.jsonl")
        log = RecordLog(folder / "records.jsonl")
        records[label] = {r.id: r for r in log.of_mode(mode) if r.error is None}
        log.close()
        if not records[label]:
            raise SystemExit(f"arm {label!r}: no answered question of mode {mode!r} in {folder}")
        runs[label] = {"folder": str(folder), "mode": mode,
                       **json.loads((folder / "run.json").read_text())}
    common = set.intersection(*(set(r) for r in records.values()))
    order = sorted(common)
    arms = {label: summary([recs[i] for i in order]) for label, recs in records.items()}
    there = {label: presence(Path(runs[label]["folder"]), runs[label]["mode"], frozenset(order))
             for label in records} if args.presence else {}
    for label, p in there.items():
        arms[label]["presence"] = presence_split([records[label][i] for i in order], p)
    pairs = {}
    for pair in args.pairs:
        a, _, b = pair.partition("/")
        if a not in records or b not in records:
            raise SystemExit(f"pair {pair!r}: both must be arm labels ({', '.join(records)})")
        both = sorted(set(records[a]) & set(records[b]))
        pairs[pair] = compare([records[a][i] for i in both], [records[b][i] for i in both])
        if there:
            lost = [i for i in both if records[b][i].correct and not records[a][i].correct and i in there[a]]
            pairs[pair]["only_b_right"] = {"a_context_missed_answer": sum(not there[a][i] for i in lost),
                                           "a_misread": sum(there[a][i] for i in lost),
                                           "a_context_missed_ids": [i for i in lost if not there[a][i]]}

    table = Table(title=f"Arms on the {len(order)} questions all of them answered")
    for col in ("arm", "F1", "EM", "$ / 1k questions", "prompt tokens", "cached", "engine s / q"):
        table.add_column(col, justify="right")
    for label, s in arms.items():
        table.add_row(label, f"{s['f1']:.3f}", f"{s['em']:.3f}", f"{s['dollars_per_1k']:.4f}",
                      f"{s['prompt_tokens']:.0f}", f"{s['cached_tokens']:.0f}", f"{s['engine_s']:.2f}")
    console.print(table)
    if there:
        table = Table(title="Is a gold answer inside the context the arm's model read?")
        for col in ("arm", "answer in context", "F1 with it", "F1 without", "wrong with it there"):
            table.add_column(col, justify="right")
        for label in there:
            p = arms[label]["presence"]
            fmt = lambda v: "" if v is None else f"{v:.3f}"
            table.add_row(label, f"{p['answer_in_context']:.1%}", fmt(p["f1_answer_in"]), fmt(p["f1_answer_out"]),
                          str(p["wrong_with_answer_in"]))
        console.print(table)
    if pairs:
        table = Table(title="Pairs, on the questions both answered: A's F1 and dollars as shares of B's")
        for col in ("A / B", "questions", "F1 share (95% bootstrap)", "$ share", "paired F1 gain",
                    "only A / only B right", "of those B only: A's context missed / A misread"):
            table.add_column(col, justify="right")
        for pair, c in pairs.items():
            lost = c.get("only_b_right")
            table.add_row(pair, str(c["questions"]),
                          f"{c['f1_share']:.1%} ({c['f1_share_95'][0]:.1%}-{c['f1_share_95'][1]:.1%})",
                          f"{c['dollar_share']:.1%}", f"{100 * c['f1_gain']:+.1f} ± {100 * c['f1_gain_se']:.1f}",
                          f"{c['a_only_correct']} / {c['b_only_correct']}",
                          f"{lost['a_context_missed_answer']} / {lost['a_misread']}" if lost else "")
        console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "selection_eval", "common_questions": len(order), "runs": runs,
                                    "arms": arms, "pairs": pairs}, indent=1) + "\n")
    plot(args.out.with_suffix(".png"), arms)
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(path: Path, arms: dict[str, dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for label, s in arms.items():
        ax.scatter(s["dollars_per_1k"], s["f1"])
        ax.annotate(label, (s["dollars_per_1k"], s["f1"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("$ / 1k questions")
    ax.set_ylabel("F1")
    ax.set_title("Arms on the same questions")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
