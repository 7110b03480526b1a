"""How likely the small model's answer is right, from its own token log-probabilities.

The mean log-probability falls with length even when every token is sure, so it would
reward short answers; the features lean on quantiles of token probability (p10, p25, p50:
how unsure the unsure tokens were) and the minimum, with the mean and the length beside
them so the model can learn how much length matters rather than assume it. A trained model
is calibrated into P(correct) on the evals labels; without one, a stated rule stands in and
every decision says that its number is uncalibrated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from sklearn.model_selection import train_test_split

from router.arms import parse_arm
from router.calibration import fit_calibrated
from router.data import Confidence as LabelConfidence
from router.data import Label, RouterError

# The untrained rule: the 25th percentile of token probability. Uncalibrated, but length-free.
DEFAULT_RULE = "p25 token probability (uncalibrated)"
# Answer prefixes an early verdict may read (labels carry their features): the trained router
# keeps the shortest that judges almost as well as the whole answer (`train_early`).
EARLY_TOKENS = (8, 16, 32)
# "Almost as well": held-out Brier score within this factor of the whole answer's.
EARLY_BRIER_SLACK = 1.05


@dataclass(frozen=True)
class Confidence:
    value: float                # in [0, 1]
    calibrated: bool


@dataclass(frozen=True)
class ConfidenceReport:
    n_train: int
    n_test: int
    brier: float                # held-out mean squared error of P(correct)
    base_rate: float            # share of held-out answers that were right: the Brier of always saying it is
    accuracy: float             # of "right" when P >= 0.5


def quantiles(logprobs: list[float]) -> tuple[float, float, float, float, float, int]:
    """mean, min, p10, p25, p50 of the log-probabilities, and the count. evals/lab/labels.py
    writes its labels with this same function, so serving computes what training read."""
    lp = np.asarray(logprobs, float)
    p10, p25, p50 = np.percentile(lp, [10, 25, 50])
    return (round(float(lp.mean()), 4), round(float(lp.min()), 4), round(float(p10), 4),
            round(float(p25), 4), round(float(p50), 4), len(lp))


def _row(mean: float, least: float, p10: float, p25: float, p50: float, length: int) -> list[float]:
    return [math.exp(p10), math.exp(p25), math.exp(p50), math.exp(least), math.exp(mean), math.log1p(length)]


def features(c: LabelConfidence) -> list[float]:
    """The confidence model's features of an answer, from its label's quantiles."""
    return _row(c.mean, c.min, c.p10, c.p25, c.p50, c.length)


@dataclass
class ConfidenceModel:
    model: object | None = None          # fitted CalibratedClassifierCV; None: the default rule

    def __call__(self, logprobs: list[float]) -> Confidence:
        if not logprobs:                  # nothing produced: nothing to trust
            return Confidence(0.0, self.model is not None)
        return self.of_quantiles(quantiles(logprobs))

    def of_quantiles(self, q: tuple[float, float, float, float, float, int]) -> Confidence:
        """From `quantiles` of the log-probabilities, as labels keep them."""
        if self.model is None:
            return Confidence(math.exp(q[3]), False)
        proba = self.model.predict_proba(np.array([_row(*q)]))[0]
        return Confidence(float(proba[list(self.model.classes_).index(True)]), True)


@dataclass(frozen=True)
class Verdict:
    """After the first answer: how sure it is, and whether the large model takes over."""
    confidence: float
    calibrated: bool
    escalate: bool
    reason: str


def judge(escalate_to: str, threshold: float, confidence: ConfidenceModel, logprobs: list[float]) -> Verdict:
    c = confidence(logprobs)
    sure = f"confidence {c.value:.2f}{'' if c.calibrated else ' (uncalibrated)'}"
    if c.value < threshold:
        return Verdict(c.value, c.calibrated, True, f"{sure} < {threshold:.2f}: escalated to {escalate_to}")
    return Verdict(c.value, c.calibrated, False, f"{sure} >= {threshold:.2f}: kept")


@dataclass
class EarlyExit:
    """An early verdict: after the first `tokens` of the small answer, how likely it ends right."""
    tokens: int
    confidence: ConfidenceModel


@dataclass(frozen=True)
class EarlyReport:
    # Held-out Brier scores by prefix length, (prefix, whole answer) on the same answers (those
    # longer than the prefix) and split; None: too few such answers.
    brier: dict[int, tuple[float, float] | None]
    chosen: int | None                 # None: no prefix judged well enough


def train_confidence(labels: list[Label], seed: int = 0,
                     test_size: float = 0.25) -> tuple[ConfidenceModel, ConfidenceReport]:
    rows = [(l.confidence, l.small_correct) for l in labels if l.confidence is not None]
    return _fit(rows, seed, test_size, "labels carry the small model's log-probabilities")


def train_narrow(labels: list[Label], seed: int = 0,
                 test_size: float = 0.25) -> tuple[dict[str, ConfidenceModel], dict[str, ConfidenceReport | str]]:
    """A confidence model per narrow arm (one with a context budget of its own, `large@256`),
    on its generated answers: a narrow answer judged unsure is asked again of the same model
    with a wider context (pipeline.Pipeline.plan). Arms too thinly labelled are
    left out, and the report says why."""
    models, reports = {}, {}
    names = sorted({name for l in labels for name in l.arms if parse_arm(name).context_budget is not None})
    for name in names:
        rows = [(l.arms[name].confidence, l.arms[name].correct) for l in labels
                if name in l.arms and l.arms[name].confidence is not None]
        try:
            models[name], reports[name] = _fit(rows, seed, test_size, f"generated {name} answers")
        except RouterError as e:
            reports[name] = str(e)
    return models, reports


def train_early(labels: list[Label], seed: int = 0, test_size: float = 0.25) -> tuple[EarlyExit | None, EarlyReport]:
    """The confidence model on answer prefixes, at the shortest prefix (of EARLY_TOKENS) whose
    held-out Brier score is within EARLY_BRIER_SLACK of the whole answer's on the same answers:
    a shorter prefix cuts more of a doomed answer, a longer one judges more surely."""
    scores, chosen = {}, None
    for k in EARLY_TOKENS:
        rows = [l for l in labels if str(k) in l.early and l.confidence is not None]
        try:
            model, prefix = _fit([(l.early[str(k)], l.small_correct) for l in rows], seed, test_size,
                                 f"answers reach {k} tokens")
            _, whole = _fit([(l.confidence, l.small_correct) for l in rows], seed, test_size, "")
        except RouterError:
            scores[k] = None
            continue
        scores[k] = (prefix.brier, whole.brier)
        if chosen is None and prefix.brier <= whole.brier * EARLY_BRIER_SLACK:
            chosen = EarlyExit(k, model)
    return chosen, EarlyReport(scores, chosen.tokens if chosen else None)


def _fit(rows: list[tuple[object, bool]], seed: int, test_size: float,
         what: str) -> tuple[ConfidenceModel, ConfidenceReport]:
    if len(rows) < 8:
        raise RouterError(f"{len(rows)} {what}; need at least 8")
    x = np.array([features(c) for c, _ in rows])
    y = np.array([right for _, right in rows])
    try:
        xa, xb, ya, yb = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    except ValueError as e:
        raise RouterError("cannot hold out a test share "
                          f"({int(y.sum())} right, {int((~y).sum())} wrong): {e}") from None
    held = fit_calibrated(xa, ya)
    p = held.predict_proba(xb)[:, list(held.classes_).index(True)]
    report = ConfidenceReport(len(ya), len(yb), float(np.mean((p - yb) ** 2)), float(yb.mean()),
                              float(((p >= 0.5) == yb).mean()))
    return ConfidenceModel(fit_calibrated(x, y)), report
