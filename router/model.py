"""A trained router on disk: the difficulty classifier, the arm model (router.arms) and the
confidence model in one joblib file, stamped with FEATURE_VERSION so a router trained on other features is refused
with a clear error instead of routing on garbage."""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import joblib
import numpy as np
import sklearn

from router.arms import ArmModel, ArmReport, parse_arm, train_arms
from router.classifier import ClassifierReport, DifficultyClassifier, train_classifier
from router.confidence import (
    ConfidenceModel,
    ConfidenceReport,
    EarlyExit,
    EarlyReport,
    train_confidence,
    train_early,
    train_narrow,
)
from router.data import RouterError, read_labels
from router.features import FEATURE_VERSION

ROUTER_FILE = "router.joblib"
# Trained artifacts and their labels live in a data folder, not in the code: the checkout's
# artifacts/, or $SLUICE_ARTIFACTS. The router a fresh checkout serves (`make router` rebuilds
# it) has its sidecar router.json: how it was made, from which labels and model weights, and
# its training report.
ARTIFACTS = Path(os.environ.get("SLUICE_ARTIFACTS") or Path(__file__).resolve().parents[1] / "artifacts")
TRAINED_ROUTER = ARTIFACTS / "router" / ROUTER_FILE


@dataclass
class RouterModel:
    classifier: DifficultyClassifier
    confidence: ConfidenceModel
    early: EarlyExit | None = None      # a verdict on the answer's first tokens; None: whole answers only
    arms: ArmModel | None = None        # mode=auto picks among arms; None: by difficulty between two models
    # Per narrow arm (`large@256`), the confidence model that judges its answers: an unsure one
    # is asked again with a wider context. An arm without one keeps its answer.
    narrow: dict[str, ConfidenceModel] = field(default_factory=dict)
    feature_version: int = FEATURE_VERSION
    trained_on: frozenset[str] = field(default_factory=frozenset)   # question ids: evals keep them out
    # The passages its labels read: cut to what bears on the question (a tenant's passage_selection),
    # or whole; None: not recorded. A narrow arm's chance of being right holds only for contexts
    # made the same way (at 192 tokens selected clauses hold the answer far more often than whole chunks).
    selection: bool | None = None

    def offers(self, arm: str, selection: bool) -> bool:
        """Whether it may offer `arm` to a tenant whose passages are cut (`selection`) or whole:
        a narrow arm only where its contexts are made as its labels' were."""
        return self.selection in (None, selection) or parse_arm(arm).context_budget is None

    def save(self, path: str | Path, about: dict | None = None) -> None:
        """`about`: what made it (command, labels, weights, report), saved beside it as JSON."""
        path = Path(path)
        joblib.dump({"feature_version": self.feature_version, "sklearn": sklearn.__version__,
                     "classifier": self.classifier, "confidence": self.confidence, "early": self.early,
                     "arms": self.arms, "narrow": self.narrow,
                     "trained_on": sorted(self.trained_on), "selection": self.selection}, path, compress=3)
        if about is not None:
            side = {"feature_version": self.feature_version, "sklearn": sklearn.__version__,
                    "bytes": path.stat().st_size, "arms": [asdict(a) for a in self.arms.arms] if self.arms else None,
                    **about}
            path.with_suffix(".json").write_text(json.dumps(side, indent=2, default=str) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RouterModel:
        try:
            saved = joblib.load(path)
        except Exception as e:        # missing, truncated, or pickled by incompatible code
            raise RouterError(f"{path}: cannot load a router: {type(e).__name__}: {e}") from None
        version = saved.get("feature_version") if isinstance(saved, dict) else None
        if version != FEATURE_VERSION:
            raise RouterError(f"{path}: router trained on feature version {version}; this code computes version "
                              f"{FEATURE_VERSION}. Train it again: sluice train-router RUN")
        return cls(saved["classifier"], saved["confidence"], saved.get("early"), saved.get("arms"),
                   saved.get("narrow", {}), version, frozenset(saved.get("trained_on", ())), saved.get("selection"))


@dataclass(frozen=True)
class TrainReport:
    labels: int
    classifier: ClassifierReport
    confidence: ConfidenceReport
    early: EarlyReport
    arms: ArmReport
    narrow: dict[str, ConfidenceReport | str]     # per narrow arm: its confidence model's report, or why none

    def as_dict(self) -> dict:
        return asdict(self)


def held_out(question_id: str, share: float) -> bool:
    """Whether a question falls in the held-out `share` of its labels: by a hash of its id
    alone, so the same labels always split the same way and a grown label file keeps its
    held-out questions held out."""
    return int.from_bytes(hashlib.blake2b(question_id.encode(), digest_size=4).digest(), "little") < share * 2**32


def train(labels_from: str | Path | list[str | Path], embedder, seed: int = 0,
          context_budgets: dict[str, int] | None = None, holdout: float = 0.0,
          selection: bool | None = None) -> tuple[RouterModel, TrainReport]:
    """Every model from the labels.jsonl of one run or several (a SQuAD run and a GSM8K one,
    each with its arms), or their run folders. `embedder.encode(texts)`
    embeds the questions, as the gateway embeds them when it searches. `context_budgets`:
    each engine model's context budget, for its arms (evals' context-budget curve chooses them).
    `holdout`: the share of questions (by `held_out`) left out, for `evals heldout` to score.
    `selection`: whether the labels' runs read selected passages (RouterModel.selection)."""
    sources = labels_from if isinstance(labels_from, list) else [labels_from]
    every = [l for source in sources for l in read_labels(source)]
    twice = sorted(i for i, n in Counter(l.id for l in every).items() if n > 1)
    if twice:
        raise RouterError(f"questions labelled in more than one of {', '.join(map(str, sources))}: "
                          f"{', '.join(twice[:5])}")
    labels = [l for l in every if not held_out(l.id, holdout)]
    if not labels:
        raise RouterError(f"{', '.join(map(str, sources))}: no labels left after holding out {holdout:.0%}")
    embeddings = np.asarray(embedder.encode([l.question for l in labels]), np.float32)
    classifier, c_report = train_classifier(labels, embeddings, seed)
    confidence, k_report = train_confidence(labels, seed)
    early, e_report = train_early(labels, seed)
    arms, a_report = train_arms(labels, embeddings, seed)
    if arms is not None and context_budgets:
        arms = arms.with_budgets(context_budgets)
    offered = {a.name for a in arms.arms} if arms else set()
    narrow, n_report = train_narrow(labels, seed)
    narrow = {name: m for name, m in narrow.items() if name in offered}
    return (RouterModel(classifier, confidence, early, arms, narrow, trained_on=frozenset(l.id for l in labels),
                        selection=selection),
            TrainReport(len(labels), c_report, k_report, e_report, a_report, n_report))
