"""`sluice train-router RUN...`: the difficulty classifier, the arms and the confidence models
from runs' labels, saved with a sidecar that says how to make them again."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_train_router(args, config) -> int:
    from evals.lab.contexts import read_chosen
    from evals.lab.labels import provenance
    from retrieval import Embedder
    from router.model import ROUTER_FILE, train
    runs = [Path(f) for f in args.folders]
    folders = [run if run.is_dir() else run.parent for run in runs]
    budgets = read_chosen(Path(args.context_curve)) if args.context_curve else None
    if not 0 <= args.holdout < 1:
        print(f"sluice train-router: --holdout must be at least 0 and below 1, got {args.holdout}", file=sys.stderr)
        return 2
    about = provenance(folders) if all((f / "run.json").exists() for f in folders) else {}
    # Closed-book runs read no passages; the retrieved ones say how theirs were made.
    selection = any(run["run"]["selection"] for run in about["labels"]) if about else None
    model, report = train(runs, Embedder(device="cpu"), context_budgets=budgets, holdout=args.holdout,
                          selection=selection)
    out = Path(args.out) if args.out else folders[0] / ROUTER_FILE
    command = " ".join(["sluice train-router", *args.folders,
                        *(["--context-curve", args.context_curve] if budgets else []),
                        *([f"--holdout {args.holdout}"] if args.holdout else []),
                        *(["--out", args.out] if args.out else [])])
    model.save(out, {"command": command, "rebuild": args.rebuild, **about, "context_budgets": budgets,
                     "report": report.as_dict()})
    print(json.dumps(report.as_dict(), indent=2))
    print(f"router: {out}", file=sys.stderr)
    return 0


def add_command(sub) -> None:
    train = sub.add_parser("train-router", help="train the difficulty classifier and the confidence model on "
                                                 "runs' labels.jsonl; print held-out accuracy, ECE, confusion")
    train.add_argument("folders", nargs="+", metavar="RUN", help="run folders (or their labels.jsonl): a SQuAD "
                                                                 "run and a GSM8K one, each labelled with its arms")
    train.add_argument("--out", help="where to save the router (default: the first RUN/router.joblib)")
    train.add_argument("--context-curve", metavar="FILE", help="context.json from `sluice eval context`: each model's "
                                                               "chosen context budget goes to its arms")
    train.add_argument("--holdout", type=float, default=0.0, metavar="SHARE",
                       help="leave this share of the questions out (by a hash of their ids), so `sluice eval heldout "
                            "RUN --router OUT` scores the router on labels it never saw (default: none)")
    train.add_argument("--rebuild", metavar="COMMAND", help="the command that makes the labels and this router from "
                                                            "nothing (e.g. `make router ...`), recorded in its sidecar")
    train.set_defaults(run=cmd_train_router)
