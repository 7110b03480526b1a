"""A run's report: summary.json, report.md with its tables, and two plots: quality against
cost for every mode (with the random and oracle routing curves between small and large),
and the distributions of TTFT and total latency per mode."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")      # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402

from evals.records import RecordLog  # noqa: E402
from evals.runner import RECORDS_FILE, RunError, read_config  # noqa: E402
from evals.summary import COST_TARGET, TARGET, ordered_modes, paired, router_curves, summarize, trained_router  # noqa: E402

PLOTS = ("quality_cost.png", "latency.png")


def write_report(folder: Path, router=None, embedder=None) -> dict:
    """(Re)write summary.json, report.md and the plots from the run folder's log, every mode
    over the questions all of them answered; with a trained router, also its curves on the
    questions it was not trained on."""
    config = read_config(folder)
    log = RecordLog(folder / RECORDS_FILE)
    modes = log.modes()
    left_out = log.keep_common()
    if modes and not log.records:
        raise RunError(f"{folder}: no question was answered by every mode ({', '.join(sorted(modes))})")
    trained = trained_router(log, router, embedder, config.thinking_budget) if router is not None else None
    summary = summarize(config, log, trained, left_out)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot_quality_cost(folder / PLOTS[0], summary, log, trained)
    _plot_latency(folder / PLOTS[1], log)
    (folder / "report.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    run, modes = summary["run"], summary["modes"]
    prices = ", ".join(f"{m} ${p['input']}/${p['cached_input']}/${p['output']}" for m, p in run["prices"].items())
    lines = [
        f"# Eval: {run['dataset']}, {'all' if run['n'] is None else run['n']} questions (seed {run['seed']})", "",
        f"Models: {', '.join(f'{k} = `{v}`' for k, v in run['models'].items())}. Context budget "
        f"{run['context_budget']} tokens, top {run['k']} hits, at most {run['max_tokens']} output tokens, thinking "
        f"budget {run['thinking_budget']}, {run['quant'] if run['quant'] != 'none' else 'float32'} weights, questions "
        f"from the {run['split']} split"
        f"{' (SQuAD:GSM8K ' + ':'.join(map(str, run['mix'])) + ')' if run['dataset'] == 'mixed' else ''}. "
        "Greedy decoding." + (f" Every mode over the {next(iter(modes.values()))['questions']} questions all of "
                              f"them answered ({summary['left_out']} answered by some modes only are left out)."
                              if summary["left_out"] else ""), "",
        f"Prices per million input / cached input / output tokens (illustrative): {prices}.", "",
        "Quality is the mean of F1 (SQuAD, JSONL sets) or exact match of the final number (GSM8K). "
        "Tokens are means per question; TTFT and latency are in seconds, under the run's concurrency.", "",
        "| mode | questions | quality | correct | $ / 1k questions | prompt | cached | output | thinking "
        "| engine s / q | TTFT p50 / p95 | latency p50 / p95 | escalated | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in modes.items():
        t = s["tokens_per_question"]
        lines.append(f"| {m} | {s['questions']} | {_f(s['quality'])} | {_f(s['accuracy'])} "
                     f"| {s['cost']['per_1k_questions']:.4f} | {t['prompt']:.0f} | {t['cached']:.0f} "
                     f"| {t['output']:.0f} | {t['thinking']:.0f} | {s['engine_s']['per_question']:.2f} "
                     f"| {_pct(s['ttft_s'])} | {_pct(s['latency_s'])} | {_f(s['escalation_rate'])} | {s['errors']} |")
    lines += ["", "By kind of question:", "", "| mode | kind | questions | EM | F1 | $ / 1k questions | thinking |",
              "|---|---|---|---|---|---|---|"]
    for m, s in modes.items():
        for kind, k in s["by_kind"].items():
            lines.append(f"| {m} | {kind} | {k['questions']} | {_f(k['em'])} | {_f(k.get('f1'))} "
                         f"| {k['cost_per_1k_questions']:.4f} | {k['thinking_per_question']:.0f} |")
    if summary.get("vs_large"):
        lines += ["", "## Against large-only, by kind of question", "",
                  "Each mode's quality, dollars, engine seconds and thinking tokens on a kind of question, as "
                  "shares of the large mode's on the same questions. The target: at least "
                  f"{TARGET:.0%} of large-only quality at {COST_TARGET:.0%} of its dollars or less.", "",
                  f"| mode | kind | quality | $ | engine s | thinking | {TARGET:.0%} at ≤{COST_TARGET:.0%} $ |",
                  "|---|---|---|---|---|---|---|"]
        for m, kinds in summary["vs_large"].items():
            for kind, x in kinds.items():
                lines.append(f"| {m} | {kind} | {share(x['quality'])} | {share(x['cost_per_1k_questions'])} "
                             f"| {share(x['engine_s_per_question'])} | {share(x['thinking_per_question'])} "
                             f"| {verdict(x['target_met'])} |")
    pair = summary.get("small_vs_large")
    if pair:
        c, b = pair["correct"], pair["router_bounds"]
        lines += [
            "", f"## Small and large on the same {pair['questions']} questions", "",
            f"Same answer: {_f(pair['agreement'])}. Correct (score >= 0.5): both {c['both']}, small only "
            f"{c['small_only']}, large only {c['large_only']}, neither {c['neither']}.", "",
            "What routing between them can reach: at random (the straight line between the two), with an "
            "oracle that sends the large model exactly the questions it answers better, and with a cascade "
            "that escalates as that oracle would but pays every small call first (the most a confidence "
            "cascade can do). APGR: the share of the quality gap recovered, averaged over the share of calls "
            "to the large model (RouteLLM).", "",
            "| routing | APGR | $ / 1k questions at 95% of large-only quality |", "|---|---|---|",
            *(f"| {name} | {_f(x['apgr'])} | {_money(x['cost_at_95_per_1k_questions'])} |" for name, x in b.items()),
        ]
    trained = summary.get("trained_router")
    if trained:
        lines += [
            "", f"## The trained router on {trained['questions']} questions it was not trained on", "",
            f"({trained['left_out_as_trained_on']} questions of this run were in its training labels and are left "
            "out.) Each curve sweeps the router's threshold over the small and large modes' answers: greedy "
            "answers are deterministic, so an escalated question gets the large mode's answer (up to near-ties "
            "that batch-dependent numerics flip in long answers), and a cascade pays for both calls at the "
            "single-model runs' engine seconds; a routed mode run for real (its row in the first table) "
            "measures what drafts and a batch split across two models do to that. "
            "\"At 95%\": the cheapest threshold reaching 95% of large-only quality, with its cost as a share of "
            "large-only cost in dollars and in engine seconds.", "",
            "APGR averages over the shares of questions sent to the large model that the curve spans "
            "(\"to large, span\"); over a narrow span it says little.", "",
            "| router | to large, span | APGR | $ / 1k questions at 95% | threshold | quality | to large "
            "| $ vs large | engine s vs large |", "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, x in trained["curves"].items():
            p = x["at_95"] or {}
            lo, hi = x["large_share_range"]
            lines.append(f"| {name} | {lo:.2f}–{hi:.2f} | {_f(x['apgr'])} | {_money(x['cost_at_95_per_1k_questions'])} "
                         f"| {_f(x['threshold_at_95'])} | {_f(p.get('quality'))} | {_f(p.get('large_share'))} "
                         f"| {_f(p.get('cost_vs_large'))} | {_f(p.get('engine_s_vs_large'))} |")
    lines += ["", "![quality against cost](quality_cost.png)", "", "![latency](latency.png)", ""]
    return "\n".join(lines)


def _plot_quality_cost(path: Path, summary: dict, log: RecordLog, trained=None) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if "small_vs_large" in summary:
        small, large = paired(log)
        n = len(small)
        for (name, curve), style in zip(router_curves(small, large).items(), (":", "-")):
            pts = sorted(curve, key=lambda p: p.cost)
            ax.plot([1000 * p.cost / n for p in pts], [p.quality for p in pts], style, color="grey",
                    label=f"{name} routing (small/large)")
    if trained is not None:
        for name, curve in trained.curves().items():
            pts = sorted(curve, key=lambda p: p.cost)
            ax.plot([1000 * p.cost / len(trained.small) for p in pts], [p.quality for p in pts], "-", lw=1.2,
                    label=name)
    for m, s in summary["modes"].items():
        ax.scatter([s["cost"]["per_1k_questions"]], [s["quality"]], s=60, zorder=3, label=m)
        ax.annotate(m, (s["cost"]["per_1k_questions"], s["quality"]), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("cost, $ per 1,000 questions")
    ax.set_ylabel("quality (F1 or exact match)")
    ax.set_title(f"{summary['run']['dataset']}: quality against cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_latency(path: Path, log: RecordLog) -> None:
    modes = ordered_modes(log.modes())
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, what in zip(axes, ("ttft", "latency")):
        data = [[getattr(r, what) for r in log.of_mode(m) if getattr(r, what) is not None] or [0.0] for m in modes]
        ax.boxplot(data, tick_labels=modes, showfliers=True)
        ax.set_title("time to first token" if what == "ttft" else "total latency")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def share(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def verdict(met: bool) -> str:
    return "met" if met else "missed"


def _money(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.4f}"


def _pct(p: dict | None) -> str:
    return "–" if p is None else f"{p['p50']:.2f} / {p['p95']:.2f}"
