"""Early exit's settings, fitted on a run that observed its probes (`eval run --thinking-budget
B --early-exit observe,every=E`): such a run probes every E thinking tokens and never exits,
and its requests wait for their probes, so each thinks exactly as without them. A probe at t
reads the answer greedy decoding gives when the span is closed at t, which is where an exit at
t answers from, so one observed run answers for every policy that probes at multiples of E:

- fixed budgets: thinking stopped at t, the probe's answer (no probe cost);
- early exit (the first probe at `first`, then every k*E tokens, `agree` probes in a row, the
  last at least `confidence` sure, each reading at most `answer_tokens`): the first probe where
  engine.early_exit.settled holds, its answer taken as the answer; thinking tokens up to
  there, and every probe made before it billed. A probe that read more answer tokens than a
  policy's `answer_tokens` would have been cut there: not whole, and cheaper.

A probe reads the whole answer, so what it scores is what an exit answers (greedy decoding). A
real early-exit run (`--early-exit` with the chosen settings) checks it: `--real RUN` tabulates
that run on the same questions.

The chosen policy: the fewest thinking and probe tokens per question keeping `target` of the
full run's exact match. Beside it, the bound no policy that reads its answer from these probes
can beat: an oracle that knows which probes are right. Writes exits.json, exits.md and exits.png.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from engine import EngineConfig, ModelEntry, Probe, Prompter, ThinkingExit, settled  # noqa: E402
from evals.budgets import save_plot  # noqa: E402
from evals.metrics import score  # noqa: E402
from evals.records import Record, read_records  # noqa: E402
from evals.runner import RECORDS_FILE, RunError, load_dataset, read_config  # noqa: E402

STRIDES = (1, 2, 3, 4)                  # policies probe every k * E tokens
FIRSTS = (1, 2, 3, 4)                   # from the j-th observed probe on (at j * E tokens)
AGREE = (1, 2, 3)
CONFIDENCE = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
ANSWER_TOKENS = (16, 24, 32)
TARGET = 0.95                           # of the full run's exact match
THINKING_TARGET = 0.5                   # of its thinking tokens, probes included (issue's target)


@dataclass(frozen=True)
class Trace:
    """One question's thinking as the observed run saw it."""
    id: str
    probes: list[Probe]
    thinking: int               # tokens it thought in full
    em: float                   # of the full answer
    probe_em: list[float]       # of each probe's answer


@dataclass(frozen=True)
class Outcome:
    thinking: int
    probe_tokens: int
    em: float
    exited: bool


def traces(folder: Path, mode: str = "large") -> tuple[list[Trace], ThinkingExit]:
    """The observed run's questions (of `mode`) with their probes; and how it probed."""
    config = read_config(folder)
    if config.thinking_exit is None or not config.thinking_exit.observe:
        raise RunError(f"{folder} is not an observed run: it needs --early-exit observe (its run.json has "
                       f"thinking_exit {config.thinking_exit})")
    answers = {ex.id: ex for ex in load_dataset(config).examples}
    out = []
    for r in read_records(folder / RECORDS_FILE):
        if r.mode != mode or r.error or not r.calls:
            continue
        call, ex = r.calls[-1], answers[r.id]
        probes = [Probe(*p[:5]) for p in call.probes]
        out.append(Trace(r.id, probes, call.thinking_tokens, r.em,
                         [score(ex.kind, p.text, ex.answers).em for p in probes]))
    if not out:
        raise RunError(f"{folder}: no answered {mode!r} questions")
    return out, config.thinking_exit


def exit_outcome(t: Trace, stride: int, agree: int, confidence: float, first: int = 1,
                 answer_tokens: int | None = None, marker: int = 0) -> Outcome:
    """What early exit at these settings would have done on this question (`marker`: the
    closing marker's tokens, which every probe's cost includes)."""
    seen, spent = [], 0
    for i, p in enumerate(t.probes):
        if i + 1 < first or (i + 1 - first) % stride:
            continue
        if answer_tokens is not None and p.tokens - marker > answer_tokens:     # cut short at the cap
            p = Probe(p.at, p.text, p.confidence, False, marker + answer_tokens)
        seen.append(p)
        if settled(seen, agree, confidence):
            return Outcome(p.at, spent, t.probe_em[i], True)
        spent += p.tokens
    return Outcome(t.thinking, spent, t.em, False)


def marker_tokens(folder: Path) -> int:
    """The closing marker's tokens in the run's large model (what each probe's cost includes)."""
    config = read_config(folder)
    engine = EngineConfig(models={"large": ModelEntry(config.models["large"])})
    return Prompter.load(engine, "large").marker_tokens


def budget_outcome(t: Trace, budget: int) -> Outcome:
    """Thinking stopped at `budget` tokens (a probe point): that probe's answer."""
    i = next((i for i, p in enumerate(t.probes) if p.at >= budget), None)
    if i is None:
        return Outcome(t.thinking, 0, t.em, False)
    return Outcome(t.probes[i].at, 0, t.probe_em[i], True)


def oracle(ts: list[Trace], target: float) -> dict:
    """Each question exited at its first probe that reads the right answer, with no probe
    before it (none is needed to know) and that one's answer taken, as an exit's is; one with
    no right probe exits at its first (wrong) probe unless its full thinking is right. Then,
    down to `target` of full thinking's exact match, the right answers that cost the most over
    their cheapest exit are given up: the fewest tokens at that quality that any policy exiting
    where this run probed could spend."""
    def cheapest(t: Trace) -> Outcome:
        return Outcome(t.probes[0].at, 0, 0.0, True) if t.probes else Outcome(t.thinking, 0, 0.0, False)

    outcomes = []
    for t in ts:
        i = next((i for i, em in enumerate(t.probe_em) if em == 1.0), None)
        outcomes.append(Outcome(t.probes[i].at, 0, 1.0, True) if i is not None
                        else Outcome(t.thinking, 0, 1.0, False) if t.em == 1.0 else cheapest(t))
    full_em = float(np.mean([t.em for t in ts]))
    saving = sorted(((o.thinking - cheapest(t).thinking, k) for k, (o, t) in enumerate(zip(outcomes, ts))
                     if o.em == 1.0), reverse=True)
    for _, k in saving:
        if (sum(o.em for o in outcomes) - 1) / len(ts) < target * full_em:
            break
        outcomes[k] = cheapest(ts[k])
    return summarize(outcomes, {"em": full_em, "thinking_tokens": float(np.mean([t.thinking for t in ts]))},
                     policy="oracle")


CONFIDENCE_BINS = (0.0, 0.5, 0.7, 0.9, 0.98, 1.0)


def calibration(ts: list[Trace]) -> list[dict]:
    """How often a whole probe answer is right, by its confidence: overall, and among probes in
    the first half of their question's thinking (where an exit would save half of it)."""
    probes = [(p.confidence, em, p.at < t.thinking / 2) for t in ts for p, em in zip(t.probes, t.probe_em)
              if p.complete]
    rows = []
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]):
        ours = [(em, early) for c, em, early in probes if lo <= c < hi or (hi == 1.0 and c == 1.0)]
        early = [em for em, e in ours if e]
        rows.append({"confidence": [lo, hi], "probes": len(ours), "right": float(np.mean([em for em, _ in ours]))
                     if ours else None, "early_probes": len(early),
                     "early_right": float(np.mean(early)) if early else None})
    return rows


def summarize(outcomes: list[Outcome], full: dict | None = None, **settings) -> dict:
    row = settings | {"em": float(np.mean([o.em for o in outcomes])),
                      "thinking_tokens": float(np.mean([o.thinking for o in outcomes])),
                      "probe_tokens": float(np.mean([o.probe_tokens for o in outcomes])),
                      "exited": float(np.mean([o.exited for o in outcomes]))}
    row["spent"] = row["thinking_tokens"] + row["probe_tokens"]
    if full:
        row["em_share"] = row["em"] / full["em"] if full["em"] else 0.0
        row["spent_share"] = row["spent"] / full["thinking_tokens"] if full["thinking_tokens"] else 0.0
    return row


def real_row(folder: Path, ts: list[Trace], mode: str = "large") -> dict:
    """A run served with early exit, on the observed questions it answered, beside their full
    thinking; and how many of its exits answered what the observed probe read at that point
    (greedy decoding writes the same tokens whatever the batch: batch invariance)."""
    observed = {t.id: t for t in ts}
    records: list[Record] = [r for r in read_records(folder / RECORDS_FILE)
                             if r.mode == mode and r.id in observed and not r.error and r.calls]
    if not records:
        raise RunError(f"{folder}: none of the observed run's questions answered in mode {mode!r}")
    calls, mine = [r.calls[-1] for r in records], [observed[r.id] for r in records]
    seen = {(t.id, p.at): p.text for t in mine for p in t.probes}
    taken = [(r.id, p[0], p[1]) for r, c in zip(records, calls) for p in c.probes if len(p) > 5 and p[5]]
    return {"policy": f"served ({folder.name})", "n": len(records), "em": float(np.mean([r.em for r in records])),
            "thinking_tokens": float(np.mean([c.thinking_tokens for c in calls])),
            "probe_tokens": float(np.mean([c.probe_tokens for c in calls])),
            "exited": float(np.mean([c.thinking_exited for c in calls])),
            "full_em": float(np.mean([t.em for t in mine])),
            "full_thinking_tokens": float(np.mean([t.thinking for t in mine])),
            "exits_as_observed": sum(seen.get((i, at)) == text for i, at, text in taken),
            "exits_observed": sum((i, at) in seen for i, at, _ in taken)}


def fit(folder: Path, out: Path, target: float = TARGET, policy: ThinkingExit | None = None,
        real: Path | None = None) -> str:
    """Tabulate every policy on the observed run; `policy` given (settings fitted on another
    split): judge that one, else choose the cheapest at `target`."""
    ts, observed = traces(folder)
    every, marker = observed.every, marker_tokens(folder)
    full = summarize([Outcome(t.thinking, 0, t.em, False) for t in ts], policy="full thinking")
    caps = [n for n in ANSWER_TOKENS if n <= observed.answer_tokens]
    rows = [summarize([exit_outcome(t, s, a, c, f, n, marker) for t in ts], full, first=f * every, every=s * every,
                      stride=s, agree=a, confidence=c, answer_tokens=n)
            for f in FIRSTS for s in STRIDES for a in AGREE for c in CONFIDENCE for n in caps]
    budgets = sorted({p.at for t in ts for p in t.probes})
    fixed = [summarize([budget_outcome(t, b) for t in ts], full, budget=b) for b in budgets]
    if policy is not None:
        key = {"first": policy.first or policy.every, "every": policy.every, "agree": policy.agree,
               "confidence": policy.confidence, "answer_tokens": policy.answer_tokens}
        chosen = next((r for r in rows if all(r[k] == v for k, v in key.items())), None)
        if chosen is None:
            raise RunError(f"--policy {key} is not on this run's grid: first and every multiples of its probe "
                           f"interval {every}, agree in {AGREE}, confidence in {CONFIDENCE}, answer_tokens in {caps}")
    else:
        good = [r for r in rows if r["em_share"] >= target]
        chosen = min(good, key=lambda r: (r["spent"], -r["em"])) if good else max(rows, key=lambda r: r["em"])
    pays = chosen["spent"] < full["thinking_tokens"]
    bound, calibrated = oracle(ts, target), calibration(ts)
    served = real_row(real, ts) if real is not None else None
    # What `eval run --early-exit` and a tenant's [thinking_budget.exit] take.
    flag = (f"every={chosen['every']},first={chosen['first']},confidence={chosen['confidence']},"
            f"agree={chosen['agree']},answer_tokens={chosen['answer_tokens']}")
    result = {"run": str(folder), "n": len(ts), "probe_every": every, "target": target, "full": full,
              "chosen": chosen, "pays": pays, "flag": flag, "given": policy is not None, "fixed_budgets": fixed,
              "policies": rows, "oracle": bound, "calibration": calibrated, "served": served}
    front = pareto(rows)
    out.mkdir(parents=True, exist_ok=True)
    # The JSON keeps the front (the packed run replays the rest); the plot shows every policy.
    (out / "exits.json").write_text(json.dumps(result | {"policies": front, "policies_tried": len(rows)}, indent=2)
                                    + "\n")
    text = markdown(result)
    (out / "exits.md").write_text(text)
    plot(result, out / "exits.png")
    return text


def pareto(rows: list[dict]) -> list[dict]:
    """The policies no other beats on both exact match and tokens spent."""
    rows = sorted(rows, key=lambda r: (r["spent"], -r["em"]))
    front, best = [], -1.0
    for r in rows:
        if r["em"] > best:
            front.append(r)
            best = r["em"]
    return front


def markdown(result: dict) -> str:
    full, c, o = result["full"], result["chosen"], result["oracle"]
    pct = lambda x: f"{100 * x:.0f}%"     # noqa: E731
    lines = [f"# Early exit from thinking: {result['run']}", "",
             f"{result['n']} questions, probed every {result['probe_every']} thinking tokens. Full thinking: "
             f"exact match {full['em']:.3f}, {full['thinking_tokens']:.0f} thinking tokens per question.", "",
             f"{'Judged' if result['given'] else 'Chosen'}: probes from {c['first']} every {c['every']} thinking "
             f"tokens reading up to {c['answer_tokens']} answer tokens, {c['agree']} agreeing, "
             f"confidence >= {c['confidence']}: exact match {c['em']:.3f} ({pct(c['em_share'])} of full thinking's; "
             f"target {pct(result['target'])}), {c['spent']:.0f} tokens per question ({c['thinking_tokens']:.0f} "
             f"thinking + {c['probe_tokens']:.0f} probe) = {pct(c['spent_share'])} of full thinking's (target <= "
             f"{pct(THINKING_TARGET)}); {pct(c['exited'])} exited early."
             + ("" if result["pays"] else " It spends more than full thinking: on these questions early exit does "
                "not pay at this quality, and a tenant should leave it off."), "",
             f"The bound (an oracle that knows which probes read the right answer, each question exiting at its "
             f"first right one with no probe before it, giving up the costliest right answers down to "
             f"{pct(result['target'])}): exact match {o['em']:.3f} ({pct(o['em_share'])}) at {o['spent']:.0f} tokens "
             f"per question ({pct(o['spent_share'])}). No policy probing where this run probed spends less.", ""]
    if result["served"]:
        s = result["served"]
        spent = s["thinking_tokens"] + s["probe_tokens"]
        lines += [f"Served with early exit ({s['policy']}, {s['n']} of these questions): exact match {s['em']:.3f} "
                  f"against {s['full_em']:.3f} with full thinking ({pct(s['em'] / max(s['full_em'], 1e-9))}), "
                  f"{spent:.0f} tokens ({s['thinking_tokens']:.0f} thinking + {s['probe_tokens']:.0f} probe) against "
                  f"{s['full_thinking_tokens']:.0f} ({pct(spent / max(s['full_thinking_tokens'], 1))}); "
                  f"{pct(s['exited'])} exited early. Of its exits at a point the observed run probed, "
                  f"{s['exits_as_observed']} of {s['exits_observed']} answered exactly what the probe read there.", ""]
    share = lambda x: "–" if x is None else pct(x)     # noqa: E731
    lines += ["What a probe's confidence says: whole probe answers right, by confidence, and among them those "
              "in the first half of their question's thinking.", "",
              "| confidence | probes | right | in the first half | right |", "|---|---|---|---|---|"]
    for r in result["calibration"]:
        lo, hi = r["confidence"]
        lines.append(f"| {lo}-{hi} | {r['probes']} | {share(r['right'])} | {r['early_probes']} | "
                     f"{share(r['early_right'])} |")
    lines += ["", "| policy | exact match | share | thinking | probe | spent | share | exited |",
              "|---|---|---|---|---|---|---|---|"]
    for r in pareto(result["policies"]):
        lines.append(f"| first {r['first']}, every {r['every']}, agree {r['agree']}, conf {r['confidence']}, "
                     f"answer {r['answer_tokens']} | {r['em']:.3f} | "
                     f"{pct(r['em_share'])} | {r['thinking_tokens']:.0f} | {r['probe_tokens']:.0f} | "
                     f"{r['spent']:.0f} | {pct(r['spent_share'])} | {pct(r['exited'])} |")
    lines += ["", "Fixed budgets (thinking stopped at the budget, the probe's answer):", "",
              "| budget | exact match | share | thinking | share |", "|---|---|---|---|---|"]
    for r in result["fixed_budgets"]:
        lines.append(f"| {r['budget']} | {r['em']:.3f} | {pct(r['em_share'])} | {r['thinking_tokens']:.0f} | "
                     f"{pct(r['spent_share'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    fixed, front = result["fixed_budgets"], pareto(result["policies"])
    ax.scatter([r["spent"] for r in result["policies"]], [r["em"] for r in result["policies"]], s=6, color="0.75",
               label="early exit, every policy")
    ax.plot([r["spent"] for r in front], [r["em"] for r in front], "o-", ms=3, label="early exit, best policies")
    ax.plot([r["spent"] for r in fixed], [r["em"] for r in fixed], "s--", ms=3, label="fixed budgets")
    full, c = result["full"], result["chosen"]
    ax.plot([full["thinking_tokens"]], [full["em"]], "k*", ms=10, label="full thinking")
    ax.plot([c["spent"]], [c["em"]], "r*", ms=10, label="chosen" if not result["given"] else "judged")
    o = result["oracle"]
    ax.plot([o["spent"]], [o["em"]], "m^", ms=7, label="oracle bound")
    if result["served"]:
        s = result["served"]
        ax.plot([s["thinking_tokens"] + s["probe_tokens"]], [s["em"]], "gD", ms=6, label="served with early exit")
    save_plot(fig, ax, path, "thinking + probe tokens per question (mean)", "exact match",
              "Exact match against thinking spent")
