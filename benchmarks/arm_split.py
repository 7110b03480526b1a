"""Does the arms' router earn its keep between the large model at a narrow context budget and
at the run's own? From run folders that answered the same questions with `large` and
`routed` (MAIN) and with `large` at the narrow budget alone (NARROW), pooled over the pairs:

- the narrow arm alone and the routed mode, as shares of large-only F1 and dollars;
- a random split between the narrow arm and large at the routed mode's dollars (the line
  between the two), the bar a router with skill must clear;
- per arm the router picked: large-only's F1 there against the narrow arm's (the router has
  skill if the arm loses less where it was picked);
- how many routed answers of the narrow arm equal the narrow run's (the same prompt served);
- with --widened, run folders over the same questions in mode `routed+cascade` (the router's
  widening: an unsure narrow answer asked again with the whole context, both calls paid as
  served, the shared prefix cached): its shares and how many it widened, pooled the same way
  (dollars, not engine seconds: the large-only runs may come from another day);
- escalating from the narrow answer to the wide one when the narrow answer's mean token
  log-probability is under a threshold, both calls paid in full: thresholds are quantiles
  of that log-probability in TRAIN_NARROW (with TRAIN_WIDE the same questions at the wide
  budget), applied to the test pairs; the oracle that escalates exactly where the wide answer
  scores higher; and the ROC AUC of the log-probability for "wide did better" on both;
- with --proxy, whether the proxy's labels hold at the narrow budget: its verdicts at the
  thresholds fitted at the wide one (a proxy.json) against TRAIN_NARROW's and TRAIN_WIDE's
  generated answers, from the proxy scores of runs at each budget.

Routed picks are read from each record's first call and context tokens (at most 300: the
narrow arm). Writes benchmarks/results/arm_split.json.

    python benchmarks/arm_split.py --pair .cache/evals/test-cascade .cache/evals/test-60-256 \
        --pair .cache/evals/test-60-seed1 .cache/evals/test-60-seed1-256 \
        --train .cache/evals/train-squad-256 .cache/evals/train-squad \
        --proxy .cache/evals/train-squad-256 .cache/evals/train-squad .cache/evals/train-squad \
        --widened .cache/evals/test-widen-s0 .cache/evals/test-widen-s1
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import RESULTS
from rich.console import Console
from rich.table import Table
from sklearn.metrics import roc_auc_score

from evals.lab.proxy import best_scores, read_scores, read_thresholds
from evals.records import Record, RecordLog
from evals.runner import RECORDS_FILE, load_dataset, read_config

NARROW_TOKENS = 300          # context tokens at most: a routed answer from the narrow arm
QUANTILES = (0.1, 0.2, 0.3, 0.4)
console = Console()


def answers(folder: Path, mode: str) -> dict[str, Record]:
    log = RecordLog(folder / RECORDS_FILE)
    try:
        return {r.id: r for r in log.of_mode(mode)}
    finally:
        log.close()


def mean_logprob(r: Record) -> float:
    lp = r.calls[0].logprobs
    return float(np.mean(lp)) if lp else 0.0


def pick(r: Record) -> str:
    if r.calls[0].model == "small":
        return "small"
    return "narrow" if r.context_tokens <= NARROW_TOKENS else "large"


def proxy_agreement(scored: Path, answers: dict[str, Record], threshold: float) -> dict:
    """The large model's proxy verdicts from `scored` (a run's proxy scores) at `threshold`,
    against generated correctness on the questions both have."""
    best = best_scores(read_scores(scored), load_dataset(read_config(scored)).examples)
    pairs = [(best[qid, "large"] >= threshold, r.correct) for qid, r in answers.items() if (qid, "large") in best]
    said, right = np.array(pairs).T
    return {"questions": len(pairs), "agreement": float((said == right).mean()),
            "proxy_right": float(said.mean()), "generated_right": float(right.mean())}


def widen_row(folders: list[str], large: dict[str, Record], narrow: dict[str, Record]) -> dict | None:
    """routed+cascade pooled over these run folders, against large-only on the same questions,
    with how many of its answers equal large-only's (widened) or the narrow run's (kept);
    None without any."""
    runs = {}
    for folder in folders:
        runs |= answers(Path(folder), "routed+cascade")
    ids = sorted(set(runs) & set(large))
    if not ids:
        return None
    f1, big = np.array([runs[i].score for i in ids]), np.array([large[i].score for i in ids])
    models = [[c.model for c in runs[i].calls] for i in ids]
    widened = [i for i, m in zip(ids, models) if m == ["large", "large"]]
    return {"questions": len(ids), "f1": float(f1.mean()), "large_f1": float(big.mean()),
            "f1_vs_large": float(f1.mean() / big.mean()),
            "f1_se": float((f1 - big).std(ddof=1) / np.sqrt(len(ids)) / big.mean()),
            "dollars_vs_large": sum(runs[i].cost for i in ids) / sum(large[i].cost for i in ids),
            "widened": len(widened),
            "widened_equal_large": sum(runs[i].answer == large[i].answer for i in widened),
            "kept_equal_narrow": sum(runs[i].answer == narrow[i].answer for i, m in zip(ids, models)
                                     if len(m) == 1 and pick(runs[i]) == "narrow" and i in narrow),
            "from_small": sum(m == ["small", "large"] for m in models),
            "cached_prompt_share_of_widenings": sum(runs[i].calls[1].cached_tokens for i in widened) /
                                                max(1, sum(runs[i].calls[1].prompt_tokens for i in widened))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("MAIN", "NARROW"))
    ap.add_argument("--train", nargs=2, required=True, metavar=("TRAIN_NARROW", "TRAIN_WIDE"))
    ap.add_argument("--proxy", nargs=3, metavar=("SCORES_NARROW", "SCORES_WIDE", "THRESHOLDS"))
    ap.add_argument("--widened", nargs="*", default=[], metavar="RUN", help="runs of mode routed+cascade")
    args = ap.parse_args()
    runs: dict[str, dict[str, Record]] = {"large": {}, "routed": {}, "narrow": {}}
    for main_run, narrow_run in args.pair:
        for mode in ("large", "routed"):
            runs[mode] |= answers(Path(main_run), mode)
        runs["narrow"] |= answers(Path(narrow_run), "large")
    ids = sorted(set(runs["large"]) & set(runs["routed"]) & set(runs["narrow"]))
    f1 = {m: np.array([runs[m][i].score for i in ids]) for m in runs}
    cost = {m: np.array([runs[m][i].cost for i in ids]) for m in runs}
    large_q, large_c = f1["large"].mean(), cost["large"].sum()
    share = {m: {"f1_vs_large": f1[m].mean() / large_q, "dollars_vs_large": cost[m].sum() / large_c,
                 "f1_se": float((f1[m] - f1["large"]).std(ddof=1) / np.sqrt(len(ids)) / large_q)}
             for m in ("narrow", "routed")}
    along = (cost["routed"].sum() - cost["narrow"].sum()) / (large_c - cost["narrow"].sum())
    random_split = (f1["narrow"].mean() + along * (large_q - f1["narrow"].mean())) / large_q
    picks = {i: pick(runs["routed"][i]) for i in ids}
    per_pick = {}
    for arm in ("narrow", "large"):
        sel = [k for k, i in enumerate(ids) if picks[i] == arm]
        per_pick[arm] = {"questions": len(sel), "large_f1": float(f1["large"][sel].mean()),
                         "narrow_f1": float(f1["narrow"][sel].mean())}
    same = sum(runs["routed"][i].answer == runs["narrow"][i].answer for i in ids if picks[i] == "narrow")

    train_narrow, train_wide = (answers(Path(f), "large") for f in args.train)
    train_ids = sorted(set(train_narrow) & set(train_wide))
    train_conf = np.array([mean_logprob(train_narrow[i]) for i in train_ids])
    conf = np.array([mean_logprob(runs["narrow"][i]) for i in ids])
    cascade = []
    for q in QUANTILES:
        t = float(np.quantile(train_conf, q))
        esc = conf < t
        cascade.append({"quantile": q, "threshold": t, "escalated": float(esc.mean()),
                        "f1_vs_large": float(np.where(esc, f1["large"], f1["narrow"]).mean() / large_q),
                        "dollars_vs_large": float((cost["narrow"] + esc * cost["large"]).sum() / large_c)})
    better = f1["large"] > f1["narrow"]          # widening that knew where 512 tokens do better
    oracle = {"escalated": float(better.mean()),
              "f1_vs_large": float(np.where(better, f1["large"], f1["narrow"]).mean() / large_q),
              "dollars_vs_large": float((cost["narrow"] + better * cost["large"]).sum() / large_c)}
    train_gain = np.array([train_wide[i].score > train_narrow[i].score for i in train_ids])
    auc = {"train": float(roc_auc_score(train_gain, -train_conf)) if 0 < train_gain.sum() < len(train_gain) else None,
           "test": float(roc_auc_score(f1["large"] > f1["narrow"], -conf))}

    table = Table(title=f"{len(ids)} questions: shares of large-only (F1 {large_q:.3f})")
    for col in ("row", "F1", "dollars"):
        table.add_column(col)
    for m in ("narrow", "routed"):
        table.add_row(m, f"{share[m]['f1_vs_large']:.0%} ± {share[m]['f1_se']:.0%}",
                      f"{share[m]['dollars_vs_large']:.0%}")
    table.add_row("random split at routed dollars", f"{random_split:.0%}", f"{share['routed']['dollars_vs_large']:.0%}")
    for c in cascade:
        table.add_row(f"narrow -> wide below {c['threshold']:.3f} ({c['escalated']:.0%} escalated)",
                      f"{c['f1_vs_large']:.0%}", f"{c['dollars_vs_large']:.0%}")
    table.add_row(f"narrow -> wide where wide does better (oracle, {oracle['escalated']:.0%} escalated)",
                  f"{oracle['f1_vs_large']:.0%}", f"{oracle['dollars_vs_large']:.0%}")
    console.print(table)
    proxy = None
    if args.proxy:
        threshold = read_thresholds(Path(args.proxy[2]))["large"]
        proxy = {"threshold": threshold,
                 "narrow": proxy_agreement(Path(args.proxy[0]), train_narrow, threshold),
                 "wide": proxy_agreement(Path(args.proxy[1]), train_wide, threshold)}
        console.print(f"proxy at the wide budget's threshold {threshold}: {proxy}")
    console.print(f"picked narrow / large: {per_pick}; routed narrow answers equal the narrow run's: {same} of "
                  f"{per_pick['narrow']['questions']}; log-probability AUC for 'wide better': {auc}")
    widened = widen_row(args.widened, runs["large"], runs["narrow"])
    if widened:
        console.print(f"routed+cascade over {widened['questions']} questions: {widened['f1_vs_large']:.1%} "
                      f"± {widened['f1_se']:.1%} of large-only F1 at {widened['dollars_vs_large']:.1%} of its dollars; "
                      f"widened {widened['widened']}, "
                      f"escalated from small {widened['from_small']}, the widened prompts "
                      f"{widened['cached_prompt_share_of_widenings']:.0%} cached; widened answers equal to "
                      f"large-only's {widened['widened_equal_large']}, kept equal to the narrow run's "
                      f"{widened['kept_equal_narrow']}")
    out = {"questions": len(ids), "large_f1": float(large_q), "shares": share, "random_split_f1_vs_large": random_split,
           "routed_cascade": widened,
           "per_pick": per_pick, "narrow_answers_equal": same, "escalate_to_wide": cascade,
           "escalate_to_wide_oracle": oracle, "auc": auc,
           "proxy": proxy, "train_questions": len(train_ids), "pairs": args.pair, "train": args.train,
           "proxy_runs": args.proxy, "widened_runs": args.widened}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "arm_split.json").write_text(json.dumps(out, indent=2, default=float) + "\n")
    console.print(f"wrote {RESULTS / 'arm_split.json'}")


if __name__ == "__main__":
    main()
