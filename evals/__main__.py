"""python -m evals (also `sluice eval`): run a dataset through answering modes, and
regenerate a run's report or router labels.

    python -m evals run squad -n 200 --modes small large
    python -m evals report RUN_FOLDER
    python -m evals labels RUN_FOLDER
    python -m evals budgets RUN_FOLDER... --out DIR
    python -m evals context RUN_FOLDER... --out DIR
    python -m evals heldout RUN_FOLDER --router FILE

A run writes into its folder as it goes; the same command again resumes it. Exit codes:
0 done, 2 bad arguments or files (the message says which), 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msgspec

from engine import QUANT_SCHEMES, EngineConfig, LLMEngine, ModelEntry, SpecConfig, ThinkingExit, default_quant
from evals.budgets import write_budget_table
from evals.datasets import DATASETS, SPLITS, DatasetError, files_for, parse_mix
from evals.lab.contexts import write_context_curve
from evals.lab.exits import fit
from evals.lab.heldout import HELDOUT_FILE, write_heldout
from evals.lab.labels import LABELS_FILE, write_labels
from evals.lab.proxy import PROXY_FILE, PROXY_REPORT, agreement, read_thresholds, score_run
from evals.pack import pack, unpack
from evals.report import write_report
from evals.runner import (
    DEFAULT_CONTEXT_BUDGET,
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    MODES,
    ROUTED_MODES,
    RunConfig,
    RunError,
    build_collection,
    check_modes,
    load_dataset,
    open_run,
    pipeline_for,
    read_config,
    reusable,
    routed_modes,
    run_modes,
)
from models.store import StoreError
from pipeline import default_prices, parse_price
from retrieval import Embedder
from router.data import RouterError
from router.model import RouterModel

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = {"small": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"}


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _exit(text: str) -> ThinkingExit:
    """--early-exit "every=64,confidence=0.9,agree=2" (ThinkingExit's keys; "observe" alone: probe, never exit)."""
    fields: dict = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key == "observe" and not value:
            fields["observe"] = True
            continue
        if key not in ThinkingExit.__struct_fields__ or key == "observe" or not value:
            raise argparse.ArgumentTypeError(f"{part!r}: expected KEY=VALUE with KEY one of every, confidence, agree, "
                                             f"answer_tokens, or observe alone")
        try:
            fields[key] = float(value) if key == "confidence" else int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key} must be a number, got {value!r}") from None
    exit = ThinkingExit(**fields)
    if errors := exit.errors():
        raise argparse.ArgumentTypeError("; ".join(f"{key} {message}" for key, message in errors))
    return exit


def _price(text: str):
    try:
        return parse_price(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(prog: str = "python -m evals") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Sluice evals: quality, cost and latency of "
                                                            "answering modes on a question set")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="answer a dataset with each mode; resumes an interrupted run")
    run.add_argument("dataset", choices=DATASETS, help="squad: SQuAD v1.1 JSON, through retrieval; gsm8k: GSM8K "
                     "JSONL; jsonl: your own {question, answers, context?} lines; mixed: SQuAD and GSM8K alternating")
    run.add_argument("--path", help="the data file (required for jsonl; default: the standard file under --data)")
    run.add_argument("--data", default=os.environ.get("SLUICE_DATA", str(REPO.parent / "shared" / "data")),
                     metavar="DIR", help="folder of the standard data files (default: $SLUICE_DATA or %(default)s)")
    run.add_argument("-n", "--sample", type=_count(1), metavar="N", help="questions to draw (default: all)")
    run.add_argument("--seed", type=int, default=0, help="seed of the draw (default: %(default)s)")
    run.add_argument("--limit", type=_count(1), metavar="N", help="answer only the first N of the run's questions "
                     "this time; a later invocation without it (or with a larger N) goes on with the rest")
    run.add_argument("--split", choices=SPLITS, default="all",
                     help="draw from the train or test half only, a fixed split by question id, so a router "
                          "trained on one is measured on the other (default: %(default)s)")
    run.add_argument("--mix", default="1:1", metavar="SQUAD:GSM8K",
                     help="mixed only: SQuAD questions to GSM8K problems (default: %(default)s)")
    run.add_argument("--modes", nargs="*", choices=[*MODES, *ROUTED_MODES], default=list(MODES),
                     help="answering modes, one after another (default: %(default)s); routed and "
                          "routed+cascade need --router")
    run.add_argument("--router", metavar="FILE", help="a trained router (sluice train-router RUN); without it "
                                                      "cascade uses the default, uncalibrated confidence rule")
    run.add_argument("--threshold", type=float, default=0.5,
                     help="escalation threshold of the cascade modes, as a tenant's (default: %(default)s)")
    run.add_argument("--margin", type=float, default=0.05,
                     help="routed modes with a router that has arms: the cheapest arm whose P(correct) is within "
                          "this of the best arm's, as a tenant's arm_margin (default: %(default)s)")
    run.add_argument("--closed-book-margin", type=float, metavar="MARGIN",
                     help="--margin for closed-book questions (nothing searched: GSM8K), as a tenant's "
                          "[router] closed_book_arm_margin (default: --margin)")
    run.add_argument("--widen-from-cache", action="store_true",
                     help="a widened answer's wider context leads with the narrow call's passages, which the "
                          "prefix cache serves, as a tenant's [router] widen_from_cache = true "
                          "(default: canonical order)")
    run.add_argument("--router-models", choices=("auto", "never_large", "always_large"), default="auto",
                     help="routed modes: which models the router may pick, as a tenant's [router] models; "
                          "always_large with --margin 1 starts every question at the cheapest large arm "
                          "(default: %(default)s)")
    run.add_argument("--small", default=DEFAULT_MODELS["small"], metavar="MODEL",
                     help="the small model: a store name, a Hugging Face folder or a GGUF file (default: %(default)s)")
    run.add_argument("--large", default=DEFAULT_MODELS["large"], metavar="MODEL",
                     help="the large model (default: %(default)s)")
    run.add_argument("--quant", choices=QUANT_SCHEMES, default="auto",
                     help="both models' weights: none (float32), int8, int4, gguf (each file's own blocks), ...; "
                          "auto: the server's default on this machine, gguf on the CPU and int8 on a GPU "
                          "(default: %(default)s)")
    run.add_argument("--out", metavar="DIR", help="run folder (default: .cache/evals/DATASET-nN-seedS in the repo)")
    run.add_argument("--context-budget", type=_count(1), default=DEFAULT_CONTEXT_BUDGET, metavar="TOKENS",
                     help="prompt tokens for instructions, passages and question "
                          "(default: %(default)s, the demo tenant's)")
    run.add_argument("--selection", action=argparse.BooleanOptionalAction, default=True,
                     help="cut the hits to the clauses that bear on the question before trimming, as a tenant's "
                          "passage_selection (default: on; --no-selection reads whole passages)")
    run.add_argument("--k", type=_count(1), default=DEFAULT_K,
                     help="hits searched for before trimming (default: %(default)s)")
    run.add_argument("--max-tokens", type=_count(1), default=DEFAULT_MAX_TOKENS,
                     help="answer tokens per question (default: %(default)s)")
    run.add_argument("--thinking-budget", type=_count(0), default=0, metavar="TOKENS",
                     help="thinking tokens per question; 0: no thinking span (default)")
    run.add_argument("--early-exit", type=_exit, metavar="KEY=VALUE,...",
                     help="thinking stops once its answer has settled (engine/early_exit.py): every, confidence, "
                          "agree, answer_tokens; 'observe' probes without exiting (what `eval exits` fits on)")
    run.add_argument("--price", type=_price, action="append", default=[], metavar="MODEL=IN,CACHED,OUT",
                     help="dollars per million input, cached input and output tokens; repeat per model "
                          "(default: small=0.1,0.025,0.4 large=0.3,0.075,1.2)")
    run.add_argument("--reuse", metavar="RUN",
                     help="a run with the same settings and a larger --thinking-budget (its answers that thought "
                          "less than this run's budget) or another -n (all its answers): copied, not generated "
                          "again (greedy decoding writes the same tokens)")
    run.add_argument("--concurrency", type=_count(1), default=8,
                     help="questions in the engine at once (default: %(default)s)")
    run.add_argument("--memory-gb", type=float, default=12.0,
                     help="engine memory for weights and KV (default: %(default)s)")
    run.set_defaults(run=cmd_run)

    for name, what in (("report", "rewrite summary.json, report.md and the plots"), ("labels", "rewrite labels.jsonl")):
        p = sub.add_parser(name, help=f"{what} from a run folder's records")
        p.add_argument("folder", metavar="RUN")
        if name == "labels":
            p.add_argument("--proxy", metavar="RUN2", help="also label the run's proxy-scored questions that have no "
                                                           "generated answers, at the thresholds `proxy` fitted on "
                                                           "RUN2 (a run folder, or a proxy.json it wrote)")
            p.add_argument("--arms", nargs="+", default=[], metavar="RUN3",
                           help="runs over the same questions at other thinking or context budgets: their answers "
                                "(and with --proxy their proxy scores) add arms (large+think256, large@256, ...) "
                                "to the labels")
        if name == "report":
            p.add_argument("--router", metavar="FILE", help="also draw this trained router's curves, on the "
                                                            "run's questions it was not trained on")
        p.set_defaults(run=cmd_report if name == "report" else cmd_labels)

    p = sub.add_parser("proxy", help="score every SQuAD-style question of a run by the reference answer's "
                                     "teacher-forced log-probability under each model (one prefill, no "
                                     "generation), and report how well that agrees with the run's generated "
                                     "correctness (proxy.json)")
    p.add_argument("folder", metavar="RUN")
    p.add_argument("--limit", type=_count(1), metavar="N", help="score only the first N of the run's questions this "
                                                               "time (resumable: a larger N goes on)")
    p.add_argument("--models", nargs="+", choices=list(MODES), default=list(MODES),
                   help="the models to score (default: both); one alone labels its arm at this run's context budget "
                        "(labels --arms)")
    p.add_argument("--memory-gb", type=float, default=12.0,
                   help="engine memory for weights and KV (default: %(default)s)")
    p.set_defaults(run=cmd_proxy)

    p = sub.add_parser("budgets", help="exact match by thinking budget, from runs that differ in their budget")
    p.add_argument("folders", nargs="+", metavar="RUN", help="run folders over the same questions")
    p.add_argument("--kind", default="gsm8k", help="the kind of question to tabulate (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="where budgets.md, .json and .png go")
    p.add_argument("--router", metavar="FILE", help="also tabulate thinking budgets by difficulty, with this trained "
                                                    "router choosing model and difficulty")
    p.set_defaults(run=cmd_budgets)

    p = sub.add_parser("exits", help="the router lab: early exit's settings from a run that observed its probes "
                                     "(--early-exit observe): every policy's exact match and tokens, fixed budgets")
    p.add_argument("folder", metavar="RUN", help="an observed run (run ... --thinking-budget B --early-exit observe)")
    p.add_argument("--out", required=True, metavar="DIR", help="where exits.md, .json and .png go")
    p.add_argument("--target", type=float, default=0.95,
                   help="the share of full thinking's exact match the chosen policy keeps (default: %(default)s)")
    p.add_argument("--policy", type=_exit, metavar="KEY=VALUE,...",
                   help="judge these settings (every, confidence, agree; fitted on another split) instead of choosing")
    p.add_argument("--real", metavar="RUN2", help="a run served with early exit over the same questions: tabulated "
                                                 "beside the simulation")
    p.set_defaults(run=cmd_exits)

    p = sub.add_parser("context", help="quality by context budget per model, from runs that differ in their budget; "
                                       "chooses each model's (its arms') budget")
    p.add_argument("folders", nargs="+", metavar="RUN", help="run folders over the same questions")
    p.add_argument("--kind", default="squad", help="the kind of question to tabulate (default: %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR", help="where context.md, .json and .png go")
    p.set_defaults(run=cmd_context)

    p = sub.add_parser("heldout", help="a trained router's arms on a run's labels it was not trained on: APGR, and "
                                       "quality and expected cost per arm margin (heldout.json)")
    p.add_argument("folder", metavar="RUN", help="a run folder with labels.jsonl (e.g. the test split's, labelled "
                                                 "with `labels RUN --proxy TRAIN_RUN`)")
    p.add_argument("--router", required=True, metavar="FILE")
    p.set_defaults(run=cmd_heldout)

    p = sub.add_parser("pack", help="a run's settings and records without the dataset's text (questions), to commit, "
                                    "so the run goes on elsewhere after `unpack` (evals/pack.py)")
    p.add_argument("folder", metavar="RUN")
    p.add_argument("out", metavar="DIR")
    p.set_defaults(run=cmd_pack)
    p = sub.add_parser("unpack", help="make a run folder from a packed run, its questions read back from the data")
    p.add_argument("packed", metavar="DIR")
    p.add_argument("folder", metavar="RUN", help="a new run folder (refused where one holds records)")
    p.set_defaults(run=cmd_pack)
    return parser


def cmd_run(args) -> int:
    needs_router = {"routed", "routed+cascade"} & set(args.modes)
    if needs_router and not args.router:
        raise RunError(f"mode {sorted(needs_router)[0]} needs --router FILE (train one: sluice train-router RUN)")
    router = RouterModel.load(args.router) if args.router else None
    files = files_for(args.dataset, args.path, args.data)
    prices = default_prices()
    for model, price in args.price:
        if model not in DEFAULT_MODELS:
            raise RunError(f"--price names model {model!r}; the models are {', '.join(DEFAULT_MODELS)}")
        prices[model] = price
    config = RunConfig(args.dataset, [str(f.resolve()) for f in files], args.sample, args.seed,
                       {"small": args.small, "large": args.large}, prices, args.context_budget, args.k,
                       args.max_tokens, args.thinking_budget,
                       default_quant() if args.quant == "auto" else args.quant, args.split,
                       parse_mix(args.mix) if args.dataset == "mixed" else (1, 1), args.selection, args.early_exit)
    folder = Path(args.out) if args.out else (
        REPO / ".cache" / "evals" / f"{args.dataset}-n{args.sample or 'all'}-seed{args.seed}")
    dataset = load_dataset(config)
    if not dataset.documents:       # closed-book questions: nothing searched, so nothing to select
        config = msgspec.structs.replace(config, selection=False)
    open_run(folder, config)
    print(f"{len(dataset.examples)} questions; run folder {folder}", file=sys.stderr)
    embedder = Embedder() if dataset.documents or router else None
    collection = build_collection(folder, dataset, embedder) if dataset.documents else None
    routed = routed_modes(args.threshold, args.margin, args.router_models, args.closed_book_margin,
                          args.widen_from_cache)
    modes = [MODES[m] if m in MODES else routed[m] for m in args.modes]
    check_modes(folder, modes)                                              # refused before the models load
    reuse = reusable(Path(args.reuse), config) if args.reuse else None
    try:
        if modes:                # none: just the folder and its collection, for `proxy`
            pipeline = pipeline_for(_engine(config, modes, args.memory_gb), config, router, embedder)
            run_modes(folder, config, dataset.examples[:args.limit], modes, pipeline, collection, args.concurrency,
                      reuse=reuse)
    finally:
        if collection is not None:
            collection.close()
    return _finish(folder, router, embedder) if modes else 0


def _engine(config: RunConfig, modes, memory_gb: float) -> LLMEngine:
    """The engine with just the models these modes call. A mode that escalates gets the large
    model as speculative target with external drafts only, as the gateway's cascade uses it:
    the escalated call verifies the small answer, and no other call drafts."""
    names = sorted({m for mode in modes for m in mode.models})
    escalating = any(m.escalation for m in modes)
    spec = SpecConfig("large", draft=None, prompt_lookup=False) if escalating else None
    try:
        return LLMEngine(EngineConfig(models={n: ModelEntry(config.models[n], quant=config.quant) for n in names},
                                      memory_budget_gb=memory_gb, speculative=spec))
    except ValueError as e:           # a model the engine cannot serve, or a budget too small
        raise RunError(f"cannot load the models: {e}") from None


def _finish(folder: Path, router=None, embedder=None) -> int:
    write_report(folder, router, embedder)
    n = write_labels(folder)
    print((folder / "report.md").read_text())
    print(f"report: {folder / 'report.md'}; {n} router labels: {folder / 'labels.jsonl'}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    folder = Path(args.folder)
    router = RouterModel.load(args.router) if args.router else None
    write_report(folder, router, Embedder() if router else None)
    print((folder / "report.md").read_text())
    return 0


def cmd_labels(args) -> int:
    folder = Path(args.folder)
    read_config(folder)            # a run folder, or a clear error
    thresholds = read_thresholds(Path(args.proxy)) if args.proxy else None
    arm_runs = [Path(f) for f in args.arms]
    for f in arm_runs:
        read_config(f)
    print(f"{write_labels(folder, thresholds, arm_runs)} labels: {folder / LABELS_FILE}")
    return 0


def cmd_proxy(args) -> int:
    folder = Path(args.folder)
    config = read_config(folder)
    dataset = load_dataset(config)
    embedder = Embedder() if dataset.documents else None
    collection = build_collection(folder, dataset, embedder) if dataset.documents else None
    try:
        pipeline = pipeline_for(_engine(config, [MODES[m] for m in args.models], args.memory_gb), config)
        scores = score_run(folder, pipeline, config, dataset.examples[:args.limit], collection,
                           models=tuple(args.models))
    finally:
        if collection is not None:
            collection.close()
    found = agreement(folder, scores, dataset.examples)
    (folder / PROXY_REPORT).write_bytes(msgspec.json.format(msgspec.json.encode(found)) + b"\n")
    print("| model | questions | threshold | agreement | generated correct | kappa |\n|---|---|---|---|---|---|")
    for a in found:
        print(f"| {a.model} | {a.questions} | {a.threshold:.3f} | {a.agreement:.3f} | {a.base_rate:.3f} "
              f"| {a.kappa:.3f} |")
    print(f"{len(scores)} proxy scores: {folder / PROXY_FILE}; agreement: {folder / PROXY_REPORT}", file=sys.stderr)
    return 0


def cmd_pack(args) -> int:
    if args.command == "pack":
        print(f"{pack(Path(args.folder), Path(args.out))} records packed: {args.out}")
    else:
        print(f"{unpack(Path(args.packed), Path(args.folder))} records unpacked: {args.folder}")
    return 0


def cmd_budgets(args) -> int:
    router = RouterModel.load(args.router) if args.router else None
    print(write_budget_table([Path(f) for f in args.folders], Path(args.out), args.kind, router,
                             Embedder() if router else None))
    return 0


def cmd_exits(args) -> int:
    print(fit(Path(args.folder), Path(args.out), args.target, args.policy, Path(args.real) if args.real else None))
    return 0


def cmd_context(args) -> int:
    print(write_context_curve([Path(f) for f in args.folders], Path(args.out), args.kind))
    return 0


def cmd_heldout(args) -> int:
    folder = Path(args.folder)
    report = write_heldout(folder, RouterModel.load(args.router), Embedder())
    print(json.dumps(report, indent=2))
    print(f"{folder / HELDOUT_FILE}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m evals") -> int:
    args = build_parser(prog).parse_args(argv)      # exits 2 with a message on bad arguments
    try:
        return args.run(args)
    except (DatasetError, RunError, StoreError, RouterError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
